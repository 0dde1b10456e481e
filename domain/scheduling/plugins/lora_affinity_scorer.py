"""``lora-affinity-scorer``: prefer endpoints that have (or can load) the LoRA adapter."""

from __future__ import annotations

from collections.abc import Sequence

from domain.datastore.endpoint import EndpointMetrics
from domain.plugins.base import EmptyParameters, PluginRegistry, TypedName, class_factory
from domain.scheduling.interfaces import AFFINITY, CycleState
from domain.scheduling.types import Candidate, InferenceRequest

__all__ = ["TYPE", "LoraAffinityScorer", "register"]

TYPE = "lora-affinity-scorer"


def _affinity(model: str, metrics: EndpointMetrics | None) -> float:
    if metrics is None:
        return 0.0
    active = metrics.active_models
    if model in active:
        return 1.0
    waiting = metrics.waiting_models
    if len(active) + len(waiting) < metrics.max_active_models:
        return 0.8
    if model in waiting:
        return 0.6
    return 0.0


class LoraAffinityScorer:
    """Scores the request's target model against each endpoint's adapters.

    1.0 when it is active; else 0.8 when the endpoint has a free adapter slot
    (active + waiting < max); else 0.6 when it is waiting to load; else 0 (also for a
    candidate without metrics).
    """

    __slots__ = ("typed_name",)

    category = AFFINITY

    def __init__(self, typed_name: TypedName, parameters: EmptyParameters) -> None:
        self.typed_name = typed_name

    def score(
        self, cycle: CycleState, request: InferenceRequest, candidates: Sequence[Candidate]
    ) -> Sequence[float]:
        model = request.target_model
        return [_affinity(model, c.metrics) for c in candidates]


def register(registry: PluginRegistry) -> None:
    registry.register(
        TYPE,
        class_factory(TYPE, LoraAffinityScorer),
        description="prefers endpoints with the request's LoRA adapter loaded or loadable",
    )
