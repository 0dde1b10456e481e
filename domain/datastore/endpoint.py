"""One endpoint as the EPP knows it: metadata, latest metrics, extensible attributes."""

from __future__ import annotations

from dataclasses import dataclass, field

from ports.endpoints import EndpointInfo

__all__ = ["Endpoint", "EndpointMetrics"]


@dataclass(frozen=True, slots=True, kw_only=True)
class EndpointMetrics:
    """An immutable snapshot of one model server's metrics.

    ``kv_cache_usage_percent`` is a fraction in [0, 1] (the reference's name).
    ``update_time`` is the monotonic time (seconds) the snapshot was taken.
    """

    waiting_queue_size: int = 0
    running_requests_size: int = 0
    kv_cache_usage_percent: float = 0.0
    active_models: frozenset[str] = frozenset()
    waiting_models: frozenset[str] = frozenset()
    max_active_models: int = 0
    cache_block_size: int = 0
    cache_num_blocks: int = 0
    update_time: float = 0.0


@dataclass(slots=True, eq=False)
class Endpoint:
    """The live entry of one endpoint in the datastore.

    ``metrics`` is replaced whole (never mutated) by the data layer, so a reader holding
    the old snapshot keeps a consistent view. ``attributes`` holds extension data keyed by
    attribute name; values must be immutable (replace them to update). Everything runs on
    the event loop thread.
    """

    info: EndpointInfo
    metrics: EndpointMetrics | None = None
    attributes: dict[str, object] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.info.name
