"""``random-picker``: endpoints chosen uniformly at random, scores ignored."""

from __future__ import annotations

import random
from collections.abc import Sequence

from domain.plugins.base import Plugin, PluginRegistry, TypedName
from domain.plugins.handle import Handle
from domain.scheduling.interfaces import CycleState
from domain.scheduling.plugins.picker_parameters import PickerParameters
from domain.scheduling.types import Candidate, InferenceRequest, ProfileRunResult, ScoredCandidate

__all__ = ["TYPE", "RandomPicker", "pick_at_random", "register"]

TYPE = "random-picker"


def pick_at_random(
    scored: Sequence[ScoredCandidate], count: int, rng: random.Random
) -> tuple[Candidate, ...]:
    """Up to ``count`` distinct candidates in uniformly random order."""
    if not scored:
        return ()
    if count == 1:
        return (rng.choice(scored).candidate,)
    chosen = rng.sample(scored, min(count, len(scored)))
    return tuple(s.candidate for s in chosen)


class RandomPicker:
    """Returns up to ``maxNumOfEndpoints`` distinct candidates in random order."""

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
        return ProfileRunResult(target_endpoints=pick_at_random(scored, self._max, self._rng))


def _factory(name: str, parameters: PickerParameters, handle: Handle) -> Plugin:
    return RandomPicker(TypedName(TYPE, name), parameters, rng=handle.rng)


def register(registry: PluginRegistry) -> None:
    registry.register(
        TYPE,
        _factory,
        parameters=PickerParameters,
        description="picks endpoints uniformly at random",
    )
