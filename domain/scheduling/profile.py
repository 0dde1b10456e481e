"""A scheduler profile: filters in order, weighted scorers, one picker."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from domain.errors import ResourceExhaustedError
from domain.scheduling.interfaces import CycleState, Filter, Picker, Scorer
from domain.scheduling.observer import SchedulingObserver
from domain.scheduling.types import (
    Candidate,
    InferenceRequest,
    ProfileRunResult,
    ScoredCandidate,
)

__all__ = ["EXPLAIN_KEY", "NoEndpointsError", "SchedulerProfile", "WeightedScorer"]

#: When ``request.extra`` holds a dict under this key, each profile run records there, under
#: its name, every candidate's total and per-scorer scores (for explaining decisions).
EXPLAIN_KEY = "explain"


class NoEndpointsError(ResourceExhaustedError):
    """Filters removed every candidate."""


@dataclass(frozen=True, slots=True)
class WeightedScorer:
    scorer: Scorer
    weight: float


class SchedulerProfile:
    """Runs on a candidate snapshot, never on live state.

    Filters run in order; a filter that leaves nothing fails the profile. Each candidate's
    score is the weighted sum of its clamped scorer scores (not normalised by the weights).
    """

    def __init__(
        self,
        name: str,
        *,
        filters: Sequence[Filter] = (),
        scorers: Sequence[WeightedScorer] = (),
        picker: Picker,
        observer: SchedulingObserver | None = None,
    ) -> None:
        self.name = name
        self.filters = tuple(filters)
        self.scorers = tuple(scorers)
        self.picker = picker
        self._own_observer = observer is not None
        self._observer = observer or SchedulingObserver()

    def adopt_observer(self, observer: SchedulingObserver) -> None:
        """Report to ``observer`` unless this profile was built with its own (the scheduler
        hands its observer to its profiles)."""
        if not self._own_observer:
            self._observer = observer

    def run(self, request: InferenceRequest, candidates: Sequence[Candidate]) -> ProfileRunResult:
        cycle = CycleState(profile=self.name, state=request.state)
        observe = self._observer.plugin_duration
        clock = time.perf_counter
        for f in self.filters:
            started = clock()
            candidates = f.filter(cycle, request, candidates)
            observe("Filter", f.typed_name, clock() - started)
            if not candidates:
                raise NoEndpointsError("no endpoints available for the given request")

        totals = [0.0] * len(candidates)
        explain = request.extra.get(EXPLAIN_KEY)
        breakdown: list[list[str]] | None = None
        if isinstance(explain, dict):
            breakdown = [[] for _ in candidates]
            explain[self.name] = (candidates, totals, breakdown)
        for weighted in self.scorers:
            started = clock()
            scores = weighted.scorer.score(cycle, request, candidates)
            observe("Scorer", weighted.scorer.typed_name, clock() - started)
            weight = weighted.weight
            for i, score in enumerate(scores):
                if score > 1.0:
                    score = 1.0
                elif not score >= 0.0:  # negative or NaN
                    score = 0.0
                totals[i] += weight * score
            if breakdown is not None:
                name = weighted.scorer.typed_name.name
                for i, score in enumerate(scores):
                    breakdown[i].append(f"{name}={score:.2f}")

        started = clock()
        result = self.picker.pick(
            cycle,
            request,
            [ScoredCandidate(c, s) for c, s in zip(candidates, totals, strict=True)],
        )
        observe("Picker", self.picker.typed_name, clock() - started)
        return result

    def __repr__(self) -> str:
        return f"SchedulerProfile({self.name!r})"
