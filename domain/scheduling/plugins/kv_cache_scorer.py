"""``kv-cache-utilization-scorer``: prefer endpoints with free KV-cache."""

from __future__ import annotations

from collections.abc import Sequence

from domain.plugins.base import EmptyParameters, PluginRegistry, TypedName, class_factory
from domain.scheduling.interfaces import DISTRIBUTION, CycleState
from domain.scheduling.types import Candidate, InferenceRequest

__all__ = ["TYPE", "KvCacheScorer", "register"]

TYPE = "kv-cache-utilization-scorer"


class KvCacheScorer:
    """Scores ``1 - kv_cache_usage_percent`` (a fraction); 0 for a candidate without
    metrics."""

    __slots__ = ("typed_name",)

    category = DISTRIBUTION

    def __init__(self, typed_name: TypedName, parameters: EmptyParameters) -> None:
        self.typed_name = typed_name

    def score(
        self, cycle: CycleState, request: InferenceRequest, candidates: Sequence[Candidate]
    ) -> Sequence[float]:
        return [
            0.0 if c.metrics is None else 1.0 - c.metrics.kv_cache_usage_percent for c in candidates
        ]


def register(registry: PluginRegistry) -> None:
    registry.register(
        TYPE,
        class_factory(TYPE, KvCacheScorer),
        description="prefers endpoints with lower KV-cache utilisation",
    )
