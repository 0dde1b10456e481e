"""``weighted-random-picker``: endpoints drawn with probability proportional to score."""

from __future__ import annotations

import random
from collections.abc import Sequence

from domain.plugins.base import Plugin, PluginRegistry, TypedName
from domain.plugins.handle import Handle
from domain.scheduling.interfaces import CycleState
from domain.scheduling.plugins.picker_parameters import PickerParameters
from domain.scheduling.plugins.random_picker import pick_at_random
from domain.scheduling.types import Candidate, InferenceRequest, ProfileRunResult, ScoredCandidate

__all__ = ["TYPE", "WeightedRandomPicker", "register"]

TYPE = "weighted-random-picker"


class WeightedRandomPicker:
    """Weighted sampling without replacement (A-Res).

    Each candidate with score > 0 gets the key ``U ** (1 / score)``, ``U`` uniform in
    (0, 1]; the candidates are ordered by key, highest first, and the first
    ``maxNumOfEndpoints`` returned. The first pick is thus candidate *i* with probability
    ``score_i / sum(scores)``. Candidates scored <= 0 have key 0 and come last, in random
    order. When no score is positive this behaves as ``random-picker``.
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
        rng = self._rng
        keyed: list[tuple[float, Candidate]] = []
        unscored: list[Candidate] = []
        for s in scored:
            if s.score > 0.0:
                keyed.append(((1.0 - rng.random()) ** (1.0 / s.score), s.candidate))
            else:
                unscored.append(s.candidate)
        if not keyed:
            return ProfileRunResult(target_endpoints=pick_at_random(scored, self._max, rng))
        count = self._max
        if count == 1:
            return ProfileRunResult(target_endpoints=(max(keyed, key=_key)[1],))
        keyed.sort(key=_key, reverse=True)
        chosen = [c for _, c in keyed[:count]]
        if len(chosen) < count and unscored:
            rng.shuffle(unscored)
            chosen.extend(unscored[: count - len(chosen)])
        return ProfileRunResult(target_endpoints=tuple(chosen))


def _key(item: tuple[float, Candidate]) -> float:
    return item[0]


def _factory(name: str, parameters: PickerParameters, handle: Handle) -> Plugin:
    return WeightedRandomPicker(TypedName(TYPE, name), parameters, rng=handle.rng)


def register(registry: PluginRegistry) -> None:
    registry.register(
        TYPE,
        _factory,
        parameters=PickerParameters,
        description="picks endpoints at random, weighted by score (A-Res sampling)",
    )
