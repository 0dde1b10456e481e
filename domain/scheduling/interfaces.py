"""The scheduling extension points. A plugin fills every slot whose method it has."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar, runtime_checkable

from domain.plugins.base import TypedName
from domain.plugins.state import RequestState
from domain.scheduling.types import (
    Candidate,
    InferenceRequest,
    ProfileRunResult,
    SchedulingResult,
    ScoredCandidate,
)

#: A scheduler profile as a profile handler sees it: something to choose by name.
ProfileT = TypeVar("ProfileT")

__all__ = [
    "AFFINITY",
    "BALANCE",
    "DISTRIBUTION",
    "CycleState",
    "Filter",
    "Picker",
    "ProfileHandler",
    "Scorer",
]

AFFINITY = "Affinity"
DISTRIBUTION = "Distribution"
BALANCE = "Balance"


@dataclass(slots=True)
class CycleState:
    """The context of one profile run: its name and the request's state store.

    Plugins namespace what they keep per run with ``profile`` (``state.put(name, key,
    value, profile=cycle.profile)``).
    """

    profile: str
    state: RequestState


@runtime_checkable
class Filter(Protocol):
    """Keeps a subset of the candidates, in order. Must not mutate its input."""

    @property
    def typed_name(self) -> TypedName: ...

    def filter(
        self, cycle: CycleState, request: InferenceRequest, candidates: Sequence[Candidate]
    ) -> Sequence[Candidate]: ...


@runtime_checkable
class Scorer(Protocol):
    """Scores every candidate in [0, 1] (values outside are clamped), one per candidate.

    ``category`` is ``Affinity``, ``Distribution`` or ``Balance``.
    """

    @property
    def typed_name(self) -> TypedName: ...

    @property
    def category(self) -> str: ...

    def score(
        self, cycle: CycleState, request: InferenceRequest, candidates: Sequence[Candidate]
    ) -> Sequence[float]: ...


@runtime_checkable
class Picker(Protocol):
    """Chooses the target endpoints, best first, from the scored candidates."""

    @property
    def typed_name(self) -> TypedName: ...

    def pick(
        self, cycle: CycleState, request: InferenceRequest, scored: Sequence[ScoredCandidate]
    ) -> ProfileRunResult: ...


@runtime_checkable
class ProfileHandler(Protocol):
    """Decides which profiles run (called until it returns none) and combines results.

    ``pick_profiles`` chooses among the configured profiles by name and returns the ones to
    run next (a sub-mapping of ``profiles``). A profile that failed has ``None`` as its
    result.
    """

    @property
    def typed_name(self) -> TypedName: ...

    def pick_profiles(
        self,
        request: InferenceRequest,
        profiles: Mapping[str, ProfileT],
        results: Mapping[str, ProfileRunResult | None],
    ) -> Mapping[str, ProfileT]: ...

    def process_results(
        self, request: InferenceRequest, results: Mapping[str, ProfileRunResult | None]
    ) -> SchedulingResult: ...
