"""``slo-headroom-tier-filter``: keep the endpoints predicted to meet the request's SLOs
(the llm-d router's type and parameter).

Reads every candidate's ``LatencyPredictionInfo`` (``predicted-latency-producer``). The
positive tier holds the candidates whose TTFT and TPOT headrooms are both >= 0; the
negative tier the others, and the candidates without a prediction. When both tiers exist,
the negative one is kept with probability ``epsilonExploreNeg`` (0.01: an endpoint that
recovers from overload still gets some traffic, so its state is seen again), the positive
one otherwise; when one exists, it is kept; with no prediction at all, or one candidate,
every candidate passes. Without SLO headers every headroom is negative (0 minus the
prediction): the filter keeps everyone.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from domain.datalayer.attributes import LATENCY_PREDICTION_INFO, LatencyPredictionInfo
from domain.plugins.base import Plugin, PluginRegistry, TypedName
from domain.plugins.handle import Handle
from domain.plugins.hooks import ConsumerPlugin
from domain.scheduling.interfaces import CycleState
from domain.scheduling.types import Candidate, InferenceRequest

__all__ = ["TYPE", "SloHeadroomTierFilter", "SloHeadroomTierFilterParameters", "register"]

TYPE = "slo-headroom-tier-filter"


@dataclass(frozen=True, slots=True, kw_only=True)
class SloHeadroomTierFilterParameters:
    """``epsilonExploreNeg`` (0.01) within [0, 1]; ``latencyPredictionInfoProducerName``
    accepted (this EPP has one producer of the key)."""

    epsilon_explore_neg: float = 0.01
    latency_prediction_info_producer_name: str = ""

    def __post_init__(self) -> None:
        if not 0.0 <= self.epsilon_explore_neg <= 1.0:
            raise ValueError("epsilonExploreNeg: must be within [0, 1]")


class SloHeadroomTierFilter(ConsumerPlugin):
    """See the module docstring."""

    __slots__ = ("_epsilon", "_rng", "typed_name")

    def __init__(
        self,
        typed_name: TypedName,
        parameters: SloHeadroomTierFilterParameters,
        rng: random.Random,
    ) -> None:
        self.typed_name = typed_name
        self._epsilon = parameters.epsilon_explore_neg
        self._rng = rng

    def consumes(self) -> Sequence[str]:
        return (LATENCY_PREDICTION_INFO,)

    def filter(
        self, cycle: CycleState, request: InferenceRequest, candidates: Sequence[Candidate]
    ) -> Sequence[Candidate]:
        if len(candidates) <= 1:
            return candidates
        positive: list[Candidate] = []
        negative: list[Candidate] = []
        predicted = False
        for c in candidates:
            info = c.attributes.get(LATENCY_PREDICTION_INFO)
            if isinstance(info, LatencyPredictionInfo):
                predicted = True
                if info.ttft_headroom_ms >= 0 and info.tpot_headroom_ms >= 0:
                    positive.append(c)
                    continue
            negative.append(c)
        if not predicted:
            return candidates
        if positive and negative:
            return negative if self._rng.random() < self._epsilon else positive
        return positive or negative


def _factory(name: str, parameters: SloHeadroomTierFilterParameters, handle: Handle) -> Plugin:
    return SloHeadroomTierFilter(TypedName(TYPE, name), parameters, handle.rng)


def register(registry: PluginRegistry) -> None:
    registry.register(
        TYPE,
        _factory,
        parameters=SloHeadroomTierFilterParameters,
        description="keeps the endpoints predicted to meet the request's SLOs",
    )
