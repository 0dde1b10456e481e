"""``running-requests-size-scorer``: prefer endpoints running fewer requests."""

from __future__ import annotations

from collections.abc import Sequence

from domain.plugins.base import EmptyParameters, PluginRegistry, TypedName, class_factory
from domain.scheduling.interfaces import DISTRIBUTION, CycleState
from domain.scheduling.plugins.queue_scorer import min_max_inverse
from domain.scheduling.types import Candidate, InferenceRequest

__all__ = ["TYPE", "RunningRequestsScorer", "register"]

TYPE = "running-requests-size-scorer"


class RunningRequestsScorer:
    """Scores ``(maxR - r) / (maxR - minR)`` on the running-requests count.

    1.0 for all when every count is the same; 0 for a candidate without metrics.
    """

    __slots__ = ("typed_name",)

    category = DISTRIBUTION

    def __init__(self, typed_name: TypedName, parameters: EmptyParameters) -> None:
        self.typed_name = typed_name

    def score(
        self, cycle: CycleState, request: InferenceRequest, candidates: Sequence[Candidate]
    ) -> Sequence[float]:
        return min_max_inverse(
            [None if c.metrics is None else c.metrics.running_requests_size for c in candidates]
        )


def register(registry: PluginRegistry) -> None:
    registry.register(
        TYPE,
        class_factory(TYPE, RunningRequestsScorer),
        description="prefers endpoints running fewer requests",
    )
