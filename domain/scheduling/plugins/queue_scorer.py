"""``queue-scorer``: prefer endpoints with fewer waiting requests."""

from __future__ import annotations

from collections.abc import Sequence

from domain.plugins.base import EmptyParameters, PluginRegistry, TypedName, class_factory
from domain.scheduling.interfaces import DISTRIBUTION, CycleState
from domain.scheduling.types import Candidate, InferenceRequest

__all__ = ["TYPE", "QueueScorer", "min_max_inverse", "register"]

TYPE = "queue-scorer"


def min_max_inverse(values: Sequence[int | None]) -> list[float]:
    """``(max - v) / (max - min)`` over the known values: the lowest scores 1, the highest 0.

    All known values equal: each scores 1. An unknown value (``None``: the endpoint has no
    metrics yet) scores 0 and is left out of the min/max, so an endpoint we know nothing
    about is never preferred over one we know is idle.
    """
    known = [v for v in values if v is not None]
    if not known:
        return [0.0] * len(values)
    low = min(known)
    high = max(known)
    if high == low:
        return [0.0 if v is None else 1.0 for v in values]
    span = float(high - low)
    return [0.0 if v is None else (high - v) / span for v in values]


class QueueScorer:
    """Scores ``(maxQ - q) / (maxQ - minQ)`` on the waiting-queue size over the candidates.

    1.0 for all when every queue is the same size; 0 for a candidate without metrics.
    """

    __slots__ = ("typed_name",)

    category = DISTRIBUTION

    def __init__(self, typed_name: TypedName, parameters: EmptyParameters) -> None:
        self.typed_name = typed_name

    def score(
        self, cycle: CycleState, request: InferenceRequest, candidates: Sequence[Candidate]
    ) -> Sequence[float]:
        return min_max_inverse(
            [None if c.metrics is None else c.metrics.waiting_queue_size for c in candidates]
        )


def register(registry: PluginRegistry) -> None:
    registry.register(
        TYPE,
        class_factory(TYPE, QueueScorer),
        description="prefers endpoints with shorter waiting queues",
    )
