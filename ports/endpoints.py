"""Endpoints (model-server ranks) and the events that announce them."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

__all__ = [
    "EndpointAddress",
    "EndpointEvent",
    "EndpointEventKind",
    "EndpointInfo",
    "EndpointSink",
    "EndpointSource",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class EndpointAddress:
    """Where a request goes: an IP (v4 or v6, without brackets) and a port."""

    ip: str
    port: int

    def host_port(self) -> str:
        """``ip:port``, with IPv6 addresses bracketed (``[::1]:8000``)."""
        if ":" in self.ip:
            return f"[{self.ip}]:{self.port}"
        return f"{self.ip}:{self.port}"


@dataclass(frozen=True, slots=True, kw_only=True)
class EndpointInfo:
    """Metadata of one endpoint: one target port of one model-server pod.

    ``name`` is unique in the pool (``<pod>-rank-<i>`` under Kubernetes,
    ``ip:port`` in static mode). ``rank`` is ``i``: the index of the endpoint's port in the
    pool's target ports, which is the data-parallel rank serving it when a pod runs one
    engine per port (0 in static mode).
    """

    name: str
    address: EndpointAddress
    pod_name: str = ""
    namespace: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)
    metrics_host: str = ""
    rank: int = 0


class EndpointEventKind(enum.Enum):
    ADD_OR_UPDATE = 0
    DELETE = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class EndpointEvent:
    kind: EndpointEventKind
    endpoint: EndpointInfo


class EndpointSink(Protocol):
    """Receives endpoint events. Called on the event loop thread; must not block."""

    def apply(self, event: EndpointEvent) -> None: ...

    def mark_synced(self) -> None:
        """The source has delivered the complete current endpoint set."""
        ...

    def mark_unsynced(self) -> None:
        """The source no longer knows the endpoint set (e.g. its InferencePool was deleted):
        readiness turns NOT_SERVING until ``mark_synced`` is called again."""
        ...


class EndpointSource(Protocol):
    """Discovers endpoints and reports them to a sink.

    ``run`` delivers events until cancelled; it calls ``sink.mark_synced()`` once the
    first complete set has been delivered. Transient errors are retried inside ``run``;
    it raises only on unrecoverable configuration errors.
    """

    async def run(self, sink: EndpointSink) -> None: ...
