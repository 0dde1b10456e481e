"""``metrics-data-source``: polls each model server's ``/metrics`` over HTTP."""

from __future__ import annotations

import asyncio
import ssl
import time
from dataclasses import dataclass
from typing import Literal

import aiohttp

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
        if not self.path.startswith("/"):
            raise ValueError("path: must start with /")


class MetricsDataSource:
    """A ``PollingDataSource`` returning ``MetricsText``.

    One keep-alive HTTP client for all endpoints (at most 2 idle connections per host,
    as the reference), a 10 s overall timeout per request; a non-200 answer is an error.
    The session is created lazily on the running event loop.
    """

    def __init__(self, typed_name: TypedName, parameters: MetricsSourceParameters) -> None:
        self._typed_name = typed_name
        self._parameters = parameters
        self._session: aiohttp.ClientSession | None = None

    @property
    def typed_name(self) -> TypedName:
        return self._typed_name

    def output_type(self) -> type:
        return MetricsText

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            ssl_context: ssl.SSLContext | bool = True
            if self._parameters.scheme == "https" and self._parameters.insecure_skip_verify:
                ssl_context = False
            connector = aiohttp.TCPConnector(
                limit=0, limit_per_host=2, ssl=ssl_context, keepalive_timeout=60
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                timeout=aiohttp.ClientTimeout(total=10),
                auto_decompress=True,
                skip_auto_headers=("User-Agent",),
            )
        return self._session

    async def poll(self, endpoint: EndpointInfo) -> MetricsText:
        host = endpoint.metrics_host or endpoint.address.host_port()
        url = f"{self._parameters.scheme}://{host}{self._parameters.path}"
        try:
            async with self._client().get(url) as response:
                body = await response.read()
                if response.status != 200:
                    raise ValueError(f"GET {url}: status {response.status}")
        except aiohttp.ClientError as exc:
            raise OSError(f"GET {url}: {exc}") from exc
        return MetricsText(body=body, fetched_at=time.monotonic())

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
            await asyncio.sleep(0)
