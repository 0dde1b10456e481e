"""Data sources: what the data layer polls for each endpoint."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from ports.endpoints import EndpointInfo
from ports.plugins import TypedName

__all__ = ["MetricsText", "PollingDataSource"]


@dataclass(frozen=True, slots=True, kw_only=True)
class MetricsText:
    """A model server's ``/metrics`` body in the Prometheus text exposition format.

    ``fetched_at`` is the monotonic time (seconds) the response arrived.
    """

    body: bytes
    fetched_at: float


@runtime_checkable
class PollingDataSource(Protocol):
    """A plugin polled by the data layer, once per interval per endpoint.

    ``poll`` returns one value of ``output_type()`` or raises (``TimeoutError``,
    ``OSError``, ``ValueError`` with the reason, e.g. a non-200 status). Each endpoint's
    polls are sequential; polls of different endpoints run concurrently. ``close`` releases
    connections (called once at shutdown).
    """

    @property
    def typed_name(self) -> TypedName: ...

    def output_type(self) -> type: ...

    async def poll(self, endpoint: EndpointInfo) -> object: ...

    async def close(self) -> None: ...
