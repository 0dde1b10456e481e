"""``metrics-data-source``: polls each model server's ``/metrics`` over HTTP."""

from __future__ import annotations

import ssl
import time
from dataclasses import dataclass
from typing import Literal

from adapters.prometheus.http_client import MAX_BODY_BYTES, HttpGetConnection
from ports.datalayer import MetricsText
from ports.endpoints import EndpointInfo
from ports.plugins import Duration, TypedName

__all__ = ["MetricsDataSource", "MetricsSourceParameters"]


_EVERY_TICK = Duration(0.0)


@dataclass(frozen=True, slots=True, kw_only=True)
class MetricsSourceParameters:
    """``scheme`` (http|https), ``path`` (/metrics), ``insecureSkipVerify`` (true), ``port``
    (0: each endpoint's metrics port, else its serving port; otherwise this port on the
    endpoint's host), ``interval`` (how often each endpoint is polled, a Go duration; 0: every
    ``--refresh-metrics-interval``). Over https: ``caCertPath`` (a PEM bundle the servers'
    certificates are verified against when ``insecureSkipVerify`` is false; "": the system's),
    ``clientCertPath`` and ``clientKeyPath`` (a PEM certificate and key presented to the
    servers, for mTLS; both or neither)."""

    scheme: Literal["http", "https"] = "http"
    path: str = "/metrics"
    insecure_skip_verify: bool = True
    port: int = 0
    interval: Duration = _EVERY_TICK
    ca_cert_path: str = ""
    client_cert_path: str = ""
    client_key_path: str = ""

    def __post_init__(self) -> None:
        if bool(self.client_cert_path) != bool(self.client_key_path):
            raise ValueError("clientCertPath: give clientCertPath and clientKeyPath together")
        if self.scheme not in ("http", "https"):
            raise ValueError("scheme: must be http or https")
        if not self.path.startswith("/") or any(c in self.path for c in " \r\n"):
            raise ValueError("path: must be an absolute path without spaces")
        if not 0 <= self.port <= 65535:
            raise ValueError("port: must be in 0..65535")


class MetricsDataSource:
    """A ``PollingDataSource`` returning ``MetricsText``.

    One keep-alive connection per endpoint (an endpoint's polls are sequential), opened on
    first use and again after any failure or when the endpoint's metrics address changes,
    and closed by ``forget`` when the endpoint is deleted; a non-200 answer is an error. The
    collector bounds each poll with its timeout (the reference's 10 s client timeout is
    never reached). A body larger than ``max_body_bytes`` (or a malformed one) fails the
    poll with an ``HttpProtocolError`` (a ``ValueError``) saying why, as soon as it is seen.
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
        # per endpoint name: its metrics host, the connection to it and the request bytes
        self._connections: dict[str, tuple[str, HttpGetConnection]] = {}
        self._requests: dict[str, tuple[str, bytes]] = {}
        self._tls = _tls_context(parameters) if parameters.scheme == "https" else None

    @property
    def typed_name(self) -> TypedName:
        return self._typed_name

    def output_type(self) -> type:
        return MetricsText

    def poll_interval(self) -> float | None:
        """The ``interval`` parameter (seconds), ``None`` when unset."""
        return self._parameters.interval or None

    def config_notices(self) -> tuple[str, ...]:
        """The TLS parameters that have no effect as configured (said once at start-up)."""
        parameters = self._parameters
        tls = ("caCertPath", "clientCertPath", "clientKeyPath")
        given = [key for key, value in zip(tls, _tls_paths(parameters), strict=True) if value]
        if parameters.scheme != "https" and given:
            return (f"{given[0]}: accepted and ignored: the scheme is http",)
        if parameters.ca_cert_path and parameters.insecure_skip_verify:
            return ("caCertPath: accepted and ignored: insecureSkipVerify is true",)
        return ()

    async def poll(self, endpoint: EndpointInfo) -> MetricsText:
        host = endpoint.metrics_host or endpoint.address.host_port()
        if self._parameters.port:
            host = f"{host.rpartition(':')[0]}:{self._parameters.port}"
        held = self._connections.get(endpoint.name)
        connection = held[1] if held is not None and held[0] == host else None
        if connection is None or connection.closed:
            if held is not None:
                held[1].close()  # a failed one, or one to the endpoint's former address
                del self._connections[endpoint.name]
            name, _, port = host.rpartition(":")
            try:
                connection = await HttpGetConnection.open(
                    name.strip("[]"), int(port), tls=self._tls, max_body_bytes=self._max_body_bytes
                )
            except ValueError as exc:
                raise OSError(f"{host}: {exc}") from exc
            self._connections[endpoint.name] = (host, connection)
        request = self._requests.get(endpoint.name)
        if request is None or request[0] != host:
            request = (
                host,
                (
                    f"GET {self._parameters.path} HTTP/1.1\r\nHost: {host}\r\n"
                    "Accept: text/plain\r\nUser-Agent: epp\r\n\r\n"
                ).encode(),
            )
            self._requests[endpoint.name] = request
        status, body = await connection.get(request[1])
        if status != 200:
            raise ValueError(
                f"GET {self._parameters.scheme}://{host}{self._parameters.path}: status {status}"
            )
        return MetricsText(body=body, fetched_at=time.monotonic())

    def forget(self, endpoint: EndpointInfo) -> None:
        """Close the endpoint's connection and drop its request (it was deleted)."""
        held = self._connections.pop(endpoint.name, None)
        self._requests.pop(endpoint.name, None)
        if held is not None:
            held[1].close()

    @property
    def open_connections(self) -> int:
        """Connections held (one per endpoint polled and not forgotten)."""
        return sum(1 for _, connection in self._connections.values() if not connection.closed)

    async def close(self) -> None:
        for _, connection in self._connections.values():
            connection.close()
        self._connections.clear()
        self._requests.clear()


def _tls_paths(parameters: MetricsSourceParameters) -> tuple[str, str, str]:
    return (parameters.ca_cert_path, parameters.client_cert_path, parameters.client_key_path)


def _tls_context(parameters: MetricsSourceParameters) -> ssl.SSLContext:
    """The client TLS context of an https source; a file that cannot be loaded raises
    ``ValueError`` naming its parameter."""
    context = ssl.create_default_context()
    if parameters.insecure_skip_verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    elif parameters.ca_cert_path:
        try:
            context.load_verify_locations(cafile=parameters.ca_cert_path)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(
                f"caCertPath: cannot load {parameters.ca_cert_path}: {exc.strerror or exc}"
            ) from None
    if parameters.client_cert_path:
        try:
            context.load_cert_chain(parameters.client_cert_path, parameters.client_key_path)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(
                f"clientCertPath: cannot load {parameters.client_cert_path} with "
                f"{parameters.client_key_path}: {exc.strerror or exc}"
            ) from None
    return context
