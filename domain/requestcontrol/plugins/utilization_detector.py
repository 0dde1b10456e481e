"""``utilization-detector``: saturation from the model servers' queue depth and KV-cache use.

The default saturation detector. Also a Filter that drops endpoints near their limits.

- ``saturation(candidates)`` is the mean over the candidates of
  ``max(waiting_queue_size / queueDepthThreshold, kv_cache_usage / kvCacheUtilThreshold)``;
  a candidate without metrics, or whose metrics are older than
  ``metricsStalenessThreshold`` (``clock() - metrics.update_time > threshold``), counts
  as 1.0. No candidates is 1.0 (saturated).
- ``filter`` keeps the candidates with fresh metrics whose queue is below
  ``queueDepthThreshold * (1 + headroom)`` and whose KV-cache use is below
  ``kvCacheUtilThreshold * (1 + headroom)``. When none qualifies it returns all the
  candidates (fail-open), so the filter alone never makes a request unschedulable.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from domain.plugins.base import Duration, Plugin, PluginRegistry, TypedName
from domain.plugins.handle import Handle
from domain.scheduling.interfaces import CycleState
from domain.scheduling.types import Candidate, InferenceRequest

__all__ = ["TYPE", "UtilizationDetector", "UtilizationDetectorParameters", "register"]

TYPE = "utilization-detector"

_DEFAULT_STALENESS = Duration(0.2)  # "200ms"


@dataclass(frozen=True, slots=True, kw_only=True)
class UtilizationDetectorParameters:
    """``queueDepthThreshold`` (> 0), ``kvCacheUtilThreshold`` (in (0, 1]),
    ``metricsStalenessThreshold`` (a duration > 0) and ``headroom`` (>= 0)."""

    queue_depth_threshold: int = 5
    kv_cache_util_threshold: float = 0.8
    metrics_staleness_threshold: Duration = _DEFAULT_STALENESS
    headroom: float = 0.0

    def __post_init__(self) -> None:
        if not self.queue_depth_threshold > 0:
            raise ValueError(f"queueDepthThreshold: must be > 0, got {self.queue_depth_threshold}")
        if not 0 < self.kv_cache_util_threshold <= 1:
            raise ValueError(
                f"kvCacheUtilThreshold: must be in (0, 1], got {self.kv_cache_util_threshold}"
            )
        if not self.metrics_staleness_threshold > 0:
            raise ValueError(
                f"metricsStalenessThreshold: must be > 0, got {self.metrics_staleness_threshold}s"
            )
        if not self.headroom >= 0:
            raise ValueError(f"headroom: must be >= 0, got {self.headroom}")


class UtilizationDetector:
    """SaturationDetector and Filter over queue depth and KV-cache utilization."""

    def __init__(
        self,
        typed_name: TypedName,
        parameters: UtilizationDetectorParameters,
        clock: Callable[[], float],
    ) -> None:
        self._typed_name = typed_name
        self._clock = clock
        self._queue_threshold = float(parameters.queue_depth_threshold)
        self._kv_threshold = parameters.kv_cache_util_threshold
        self._staleness = float(parameters.metrics_staleness_threshold)
        self._queue_limit = self._queue_threshold * (1.0 + parameters.headroom)
        self._kv_limit = self._kv_threshold * (1.0 + parameters.headroom)

    @property
    def typed_name(self) -> TypedName:
        return self._typed_name

    # SaturationDetector
    def saturation(self, candidates: Sequence[Candidate]) -> float:
        if not candidates:
            return 1.0
        now = self._clock()
        queue_threshold = self._queue_threshold
        kv_threshold = self._kv_threshold
        total = 0.0
        for candidate in candidates:
            metrics = candidate.metrics
            if metrics is None or now - metrics.update_time > self._staleness:
                total += 1.0
            else:
                total += max(
                    metrics.waiting_queue_size / queue_threshold,
                    metrics.kv_cache_usage_percent / kv_threshold,
                )
        return total / len(candidates)

    # Filter
    def filter(
        self, cycle: CycleState, request: InferenceRequest, candidates: Sequence[Candidate]
    ) -> Sequence[Candidate]:
        now = self._clock()
        queue_limit = self._queue_limit
        kv_limit = self._kv_limit
        kept = [
            candidate
            for candidate in candidates
            if (metrics := candidate.metrics) is not None
            and now - metrics.update_time <= self._staleness
            and metrics.waiting_queue_size < queue_limit
            and metrics.kv_cache_usage_percent < kv_limit
        ]
        return kept if kept else candidates


def _factory(name: str, parameters: Any, handle: Handle) -> Plugin:
    return UtilizationDetector(TypedName(TYPE, name), parameters, handle.clock)


def register(registry: PluginRegistry) -> None:
    registry.register(
        TYPE,
        _factory,
        parameters=UtilizationDetectorParameters,
        description="saturation from queue depth and KV-cache utilization; fail-open filter",
    )
