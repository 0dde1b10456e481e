"""``metrics-data-source``: polls each model server's ``/metrics`` over HTTP."""

from __future__ import annotations

import ssl
import time
from dataclasses import dataclass
from typing import Literal

from adapters.prometheus.http_client import MAX_BODY_BYTES, HttpGetConnection
from ports.datalayer import MetricsText
from ports.endpoints import EndpointInfo
from ports.plugins import TypedName

__all__ = ["MetricsDataSource", "MetricsSourceParameters"]


@dataclass(frozen=True, slots=True, kw_only=True)
class MetricsSourceParameters:
    """``scheme`` (http|https), ``path`` (/metrics), ``insecureSkipVerify`` (true)."""

    scheme: Literal["http", "https"] = "http"
    path: str = "/metrics"
    insecure_skip_verify: bool = True

    def __post_init__(self) -> None:
        if self.scheme not in ("http", "https"):
            raise ValueError("scheme: must be http or https")
        if not self.path.startswith("/") or any(c in self.path for c in " \r\n"):
            raise ValueError("path: must be an absolute path without spaces")


class MetricsDataSource:
    """A ``PollingDataSource`` returning ``MetricsText``.

    One keep-alive connection per endpoint (an endpoint's polls are sequential), opened on
    first use and again after any failure; a non-200 answer is an error. The collector
    bounds each poll with its timeout (the reference's 10 s client timeout is never reached).
    A body larger than ``max_body_bytes`` (or a malformed one) fails the poll with an
    ``HttpProtocolError`` (a ``ValueError``) saying why, as soon as it is seen.
    """

    def __init__(
        self,
        typed_name: TypedName,
        parameters: MetricsSourceParameters,
        *,
        max_body_bytes: int = MAX_BODY_BYTES,
    ) -> None:
        self._typed_name = typed_name
        self._parameters = parameters
        self._max_body_bytes = max_body_bytes
        self._connections: dict[str, HttpGetConnection] = {}
        self._requests: dict[str, bytes] = {}
        self._tls: ssl.SSLContext | None = None
        if parameters.scheme == "https":
            self._tls = ssl.create_default_context()
            if parameters.insecure_skip_verify:
                self._tls.check_hostname = False
                self._tls.verify_mode = ssl.CERT_NONE

    @property
    def typed_name(self) -> TypedName:
        return self._typed_name

    def output_type(self) -> type:
        return MetricsText

    async def poll(self, endpoint: EndpointInfo) -> MetricsText:
        host = endpoint.metrics_host or endpoint.address.host_port()
        connection = self._connections.get(host)
        if connection is None or connection.closed:
            name, _, port = host.rpartition(":")
            try:
                connection = await HttpGetConnection.open(
                    name.strip("[]"), int(port), tls=self._tls, max_body_bytes=self._max_body_bytes
                )
            except ValueError as exc:
                raise OSError(f"{host}: {exc}") from exc
            self._connections[host] = connection
            if host not in self._requests:
                self._requests[host] = (
                    f"GET {self._parameters.path} HTTP/1.1\r\nHost: {host}\r\n"
                    "Accept: text/plain\r\nUser-Agent: epp\r\n\r\n"
                ).encode()
        status, body = await connection.get(self._requests[host])
        if status != 200:
            raise ValueError(
                f"GET {self._parameters.scheme}://{host}{self._parameters.path}: status {status}"
            )
        return MetricsText(body=body, fetched_at=time.monotonic())

    def forget(self, endpoint: EndpointInfo) -> None:
        """Close the endpoint's connection (it was removed)."""
        host = endpoint.metrics_host or endpoint.address.host_port()
        connection = self._connections.pop(host, None)
        self._requests.pop(host, None)
        if connection is not None:
            connection.close()

    async def close(self) -> None:
        for connection in self._connections.values():
            connection.close()
        self._connections.clear()
