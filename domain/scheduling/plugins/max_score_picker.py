"""``max-score-picker``: the highest-scored endpoints, ties broken at random."""

from __future__ import annotations

import random
from collections.abc import Sequence

from domain.plugins.base import Plugin, PluginRegistry, TypedName
from domain.plugins.handle import Handle
from domain.scheduling.interfaces import CycleState
from domain.scheduling.plugins.picker_parameters import PickerParameters
from domain.scheduling.types import InferenceRequest, ProfileRunResult, ScoredCandidate

__all__ = ["TYPE", "MaxScorePicker", "register"]

TYPE = "max-score-picker"


def _score(scored: ScoredCandidate) -> float:
    return scored.score


class MaxScorePicker:
    """Returns up to ``maxNumOfEndpoints`` candidates by descending score.

    Equal scores are ordered at random (shuffle, then a stable sort), so ties spread load
    instead of always favouring the first endpoint listed. The default picker.
    """

    __slots__ = ("_max", "_rng", "typed_name")

    def __init__(
        self, typed_name: TypedName, parameters: PickerParameters, *, rng: random.Random
    ) -> None:
        self.typed_name = typed_name
        self._max = parameters.max_num_of_endpoints
        self._rng = rng

    def pick(
        self, cycle: CycleState, request: InferenceRequest, scored: Sequence[ScoredCandidate]
    ) -> ProfileRunResult:
        if not scored:
            return ProfileRunResult(target_endpoints=())
        if self._max == 1:
            best = max(s.score for s in scored)
            # ``or``: a NaN total equals nothing; treat every candidate as tied then.
            tied = [s.candidate for s in scored if s.score == best] or [s.candidate for s in scored]
            return ProfileRunResult(target_endpoints=(self._rng.choice(tied),))
        order = list(scored)
        self._rng.shuffle(order)
        order.sort(key=_score, reverse=True)
        return ProfileRunResult(target_endpoints=tuple(s.candidate for s in order[: self._max]))


def _factory(name: str, parameters: PickerParameters, handle: Handle) -> Plugin:
    return MaxScorePicker(TypedName(TYPE, name), parameters, rng=handle.rng)


def register(registry: PluginRegistry) -> None:
    registry.register(
        TYPE,
        _factory,
        parameters=PickerParameters,
        description="picks the highest-scored endpoints, random tie-break",
    )
