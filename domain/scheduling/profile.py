"""A scheduler profile: filters in order, weighted scorers, one picker."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from domain.errors import ResourceExhaustedError
from domain.plugins.base import Plugin, TypedName
from domain.scheduling.interfaces import CycleState, Filter, Picker, Scorer
from domain.scheduling.observer import PLUGIN_SPAN, SchedulingObserver
from domain.scheduling.types import (
    Candidate,
    InferenceRequest,
    ProfileExplanation,
    ProfileRunResult,
    ScoredCandidate,
)
from ports.observer import Span

__all__ = ["NoEndpointsError", "SchedulerProfile", "WeightedScorer"]


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
        self._span_attributes: dict[tuple[str, TypedName], dict[str, str]] = {}

    def adopt_observer(self, observer: SchedulingObserver) -> None:
        """Report to ``observer`` unless this profile was built with its own (the scheduler
        hands its observer to its profiles)."""
        if not self._own_observer:
            self._observer = observer

    def run(
        self,
        request: InferenceRequest,
        candidates: Sequence[Candidate],
        span: Span | None = None,
    ) -> ProfileRunResult:
        """Filters, scorers and the picker on ``candidates``; with a recording ``span``,
        each plugin call is a child span of it."""
        cycle = CycleState(profile=self.name, state=request.state)
        observer = self._observer
        observe = observer.plugin_duration
        clock = time.perf_counter
        traced = span if span is not None and span.recording else None
        for f in self.filters:
            plugin_span = self._plugin_span(traced, "Filter", f) if traced is not None else None
            started = clock()
            try:
                candidates = f.filter(cycle, request, candidates)
            finally:
                observe("Filter", f.typed_name, clock() - started)
                if plugin_span is not None:
                    plugin_span.end()
            if not candidates:
                raise NoEndpointsError("no endpoints available for the given request")

        totals = [0.0] * len(candidates)
        explanations = request.explanations
        breakdown: list[list[str]] | None = None
        if explanations is not None:
            breakdown = [[] for _ in candidates]
            explanations[self.name] = ProfileExplanation(candidates, totals, breakdown)
        if request.profile_scores is not None:
            request.profile_scores[self.name] = (candidates, totals)
        for weighted in self.scorers:
            scorer = weighted.scorer
            plugin_span = (
                self._plugin_span(traced, "Scorer", scorer) if traced is not None else None
            )
            started = clock()
            try:
                scores = scorer.score(cycle, request, candidates)
            finally:
                observe("Scorer", scorer.typed_name, clock() - started)
                if plugin_span is not None:
                    plugin_span.end()
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

        picker = self.picker
        plugin_span = self._plugin_span(traced, "Picker", picker) if traced is not None else None
        started = clock()
        try:
            result = picker.pick(
                cycle,
                request,
                [ScoredCandidate(c, s) for c, s in zip(candidates, totals, strict=True)],
            )
        finally:
            observe("Picker", picker.typed_name, clock() - started)
            if plugin_span is not None:
                plugin_span.end()
        targets = result.target_endpoints
        if len(candidates) > len(targets):
            picked = {id(c) for c in targets}
            result = ProfileRunResult(
                target_endpoints=targets,
                alternates=tuple(c for c in candidates if id(c) not in picked),
            )
        return result

    def _plugin_span(self, parent: Span, extension_point: str, plugin: Plugin) -> Span:
        """A child of ``parent`` for one plugin call (``PLUGIN_SPAN``)."""
        key = (extension_point, plugin.typed_name)
        attributes = self._span_attributes.get(key)
        if attributes is None:
            attributes = self._span_attributes[key] = {
                "extension_point": extension_point,
                "plugin.type": plugin.typed_name.type,
                "plugin.name": plugin.typed_name.name,
            }
        return self._observer.start_span(PLUGIN_SPAN, parent, attributes)

    def __repr__(self) -> str:
        return f"SchedulerProfile({self.name!r})"
