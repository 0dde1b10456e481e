"""``utilization-filter``: drop endpoints that exceed any configured utilization cap.

Each condition caps one metric; an endpoint is kept only when every condition holds
(value <= ``maxValue``). Metrics:

- ``active-requests``: the requests in flight to the endpoint (its ``InFlightLoad``, from
  the ``inflight-load-producer``; pool-wide when a shared store is configured);
- ``running-requests``, ``waiting-queue``: the model server's own counts;
- ``kv-cache-utilization``: the model server's KV-cache usage, a fraction in [0, 1].

A missing value (no metrics yet, no in-flight load) counts as 0. When every endpoint is
dropped, ``fallbackOnEmpty`` (false) returns the candidates unchanged instead of none.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from domain.datalayer.attributes import IN_FLIGHT_LOAD, InFlightLoad
from domain.plugins.base import PluginRegistry, TypedName, class_factory
from domain.plugins.hooks import ConsumerPlugin, NamedProducerConsumer
from domain.scheduling.interfaces import CycleState
from domain.scheduling.types import Candidate, InferenceRequest

__all__ = [
    "METRICS",
    "TYPE",
    "UtilizationCondition",
    "UtilizationFilter",
    "UtilizationFilterParameters",
    "register",
]

TYPE = "utilization-filter"
ACTIVE_REQUESTS = "active-requests"
KV_CACHE_UTILIZATION = "kv-cache-utilization"


def _active(c: Candidate) -> float:
    load = c.attributes.get(IN_FLIGHT_LOAD)
    return float(load.requests) if isinstance(load, InFlightLoad) else 0.0


def _running(c: Candidate) -> float:
    return float(c.metrics.running_requests_size) if c.metrics is not None else 0.0


def _waiting(c: Candidate) -> float:
    return float(c.metrics.waiting_queue_size) if c.metrics is not None else 0.0


def _kv(c: Candidate) -> float:
    return c.metrics.kv_cache_usage_percent if c.metrics is not None else 0.0


#: Metric name -> how to read it from a candidate.
METRICS: dict[str, Callable[[Candidate], float]] = {
    ACTIVE_REQUESTS: _active,
    "running-requests": _running,
    "waiting-queue": _waiting,
    KV_CACHE_UTILIZATION: _kv,
}


@dataclass(frozen=True, slots=True, kw_only=True)
class UtilizationCondition:
    """One cap: ``metric`` (one of ``METRICS``) and ``maxValue`` (>= 0; <= 1 for
    ``kv-cache-utilization``)."""

    metric: str
    max_value: float

    def __post_init__(self) -> None:
        if self.metric not in METRICS:
            raise ValueError(f"metric: must be one of {', '.join(METRICS)}, got {self.metric!r}")
        if not self.max_value >= 0:
            raise ValueError(f"maxValue: must be >= 0, got {self.max_value}")
        if self.metric == KV_CACHE_UTILIZATION and self.max_value > 1:
            raise ValueError(f"maxValue: a KV-cache fraction must be <= 1, got {self.max_value}")


@dataclass(frozen=True, slots=True, kw_only=True)
class UtilizationFilterParameters:
    """``conditions`` (required, at least one), ``fallbackOnEmpty`` (false),
    ``inFlightLoadProducerName`` (checked to name a producer of the in-flight load, of which
    this EPP has one per endpoint)."""

    conditions: tuple[UtilizationCondition, ...]
    fallback_on_empty: bool = False
    in_flight_load_producer_name: str = ""

    def __post_init__(self) -> None:
        if not self.conditions:
            raise ValueError("conditions: at least one condition is required")


class UtilizationFilter(ConsumerPlugin, NamedProducerConsumer):
    """Keeps the candidates within every cap, in order."""

    __slots__ = ("_checks", "_fallback", "_producer", "_uses_load", "typed_name")

    def __init__(self, typed_name: TypedName, parameters: UtilizationFilterParameters) -> None:
        self.typed_name = typed_name
        self._checks = tuple((METRICS[c.metric], c.max_value) for c in parameters.conditions)
        self._fallback = parameters.fallback_on_empty
        self._uses_load = any(c.metric == ACTIVE_REQUESTS for c in parameters.conditions)
        self._producer = parameters.in_flight_load_producer_name

    def consumes(self) -> Sequence[str]:
        return [IN_FLIGHT_LOAD] if self._uses_load else []

    def producer_names(self) -> Mapping[str, str]:
        return {IN_FLIGHT_LOAD: self._producer} if self._uses_load else {}

    def filter(
        self, cycle: CycleState, request: InferenceRequest, candidates: Sequence[Candidate]
    ) -> Sequence[Candidate]:
        checks = self._checks
        kept = [c for c in candidates if all(read(c) <= cap for read, cap in checks)]
        if not kept and self._fallback:
            return candidates
        return kept


def register(registry: PluginRegistry) -> None:
    registry.register(
        TYPE,
        class_factory(TYPE, UtilizationFilter),
        parameters=UtilizationFilterParameters,
        description="drops endpoints over any in-flight, running, waiting or KV-cache cap",
    )
