"""Data sources: what the data layer polls for each endpoint."""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from ports.endpoints import EndpointInfo
from ports.plugins import TypedName

__all__ = [
    "MetricsText",
    "NotificationEvent",
    "NotificationKind",
    "NotificationSource",
    "PollingDataSource",
    "SourceWithEndpointState",
]


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


@runtime_checkable
class SourceWithEndpointState(Protocol):
    """A polling source that holds something per endpoint (a connection, a cached request).

    The data layer calls ``forget`` once for an endpoint that was deleted, after that
    endpoint's collector has stopped (no poll of it runs or follows, unless the endpoint is
    added again, when it is not forgotten); ``forget`` releases what the source holds for it
    and does not raise.
    """

    def forget(self, endpoint: EndpointInfo) -> None: ...


class NotificationKind(enum.Enum):
    """What happened to a watched object."""

    ADD_OR_UPDATE = 0
    DELETE = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class NotificationEvent:
    """One change of a watched Kubernetes object.

    ``gvk`` is the watching source's GVK string (see ``NotificationSource.gvk``); ``object``
    is the unstructured object as decoded JSON (for a deletion, its last known state).
    """

    kind: NotificationKind
    gvk: str
    object: Mapping[str, Any]


@runtime_checkable
class NotificationSource(Protocol):
    """A plugin that watches one kind of object and reports its changes.

    ``gvk()`` names what it watches (``"<group>/<version>, Kind=<kind>"``, the group part
    empty for the core API: ``"/v1, Kind=ConfigMap"``); ``output_type()`` is
    ``NotificationEvent``. ``run`` lists then watches until cancelled, calling ``deliver``
    on the event loop thread once per change, in order; it recovers from API failures on
    its own (retrying with a backoff) and never delivers after it has been cancelled.
    """

    @property
    def typed_name(self) -> TypedName: ...

    def gvk(self) -> str: ...

    def output_type(self) -> type: ...

    async def run(self, deliver: Callable[[NotificationEvent], None]) -> None: ...
