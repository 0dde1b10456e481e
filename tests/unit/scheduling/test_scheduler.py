"""The scheduling framework: a profile's filter/score/pick run and the scheduler's loop.

Also checks that the in-tree scheduling plugin modules register exactly the reference's
type names.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from types import ModuleType

import pytest

from domain.errors import BadRequestError, InternalError
from domain.plugins.base import PluginRegistry, TypedName
from domain.scheduling.interfaces import (
    CycleState,
    Filter,
    Picker,
    ProfileHandler,
    ProfileT,
    Scorer,
)
from domain.scheduling.observer import SchedulingObserver
from domain.scheduling.plugins import (
    disagg_profile_handler,
    header_filter,
    kv_cache_scorer,
    lora_affinity_scorer,
    max_score_picker,
    queue_scorer,
    random_picker,
    running_requests_scorer,
    single_profile_handler,
    token_load_scorer,
    weighted_random_picker,
)
from domain.scheduling.plugins.picker_parameters import PickerParameters
from domain.scheduling.profile import NoEndpointsError, SchedulerProfile, WeightedScorer
from domain.scheduling.scheduler import Scheduler, SchedulingFailedError
from domain.scheduling.types import (
    Candidate,
    InferenceRequest,
    ProfileRunResult,
    SchedulingResult,
    ScoredCandidate,
)
from tests.support.scheduling import candidate, inference_request, plugin_handle

# --- test plugins ---------------------------------------------------------------------


class _Keep:
    """Keeps the named candidates and records what it was given."""

    def __init__(self, name: str, *keep: str, log: list[str] | None = None) -> None:
        self.typed_name = TypedName("keep", name)
        self._keep = keep
        self.seen: list[list[str]] = []
        self._log = log

    def filter(
        self, cycle: CycleState, request: InferenceRequest, candidates: Sequence[Candidate]
    ) -> Sequence[Candidate]:
        self.seen.append([c.name for c in candidates])
        if self._log is not None:
            self._log.append(self.typed_name.name)
        return [c for c in candidates if c.name in self._keep]


class _Fixed:
    """Scores from a table by candidate name."""

    category = "Distribution"

    def __init__(self, name: str, scores: Mapping[str, float]) -> None:
        self.typed_name = TypedName("fixed", name)
        self._scores = scores

    def score(
        self, cycle: CycleState, request: InferenceRequest, candidates: Sequence[Candidate]
    ) -> Sequence[float]:
        return [self._scores[c.name] for c in candidates]


class _Recorder:
    """Picks the candidate named ``choose`` (or the first) and records the scores."""

    def __init__(self, choose: str | None = None) -> None:
        self.typed_name = TypedName("recorder", "recorder")
        self.scored: dict[str, float] = {}
        self.calls = 0
        self._choose = choose

    def pick(
        self, cycle: CycleState, request: InferenceRequest, scored: Sequence[ScoredCandidate]
    ) -> ProfileRunResult:
        self.calls += 1
        self.scored = {s.candidate.name: s.score for s in scored}
        chosen = [s.candidate for s in scored if s.candidate.name == self._choose]
        return ProfileRunResult(target_endpoints=tuple(chosen or [scored[0].candidate]))


class _Observer(SchedulingObserver):
    def __init__(self) -> None:
        self.points: list[tuple[str, str]] = []
        self.outcomes: list[bool] = []

    def plugin_duration(self, extension_point: str, plugin: TypedName, seconds: float) -> None:
        assert seconds >= 0
        self.points.append((extension_point, plugin.name))

    def attempt(self, seconds: float, target_model: str, result: SchedulingResult | None) -> None:
        self.outcomes.append(result is not None)


def _candidates(*names: str) -> list[Candidate]:
    return [candidate(n) for n in names]


def _run(profile: SchedulerProfile, candidates: Sequence[Candidate]) -> list[str]:
    result = profile.run(inference_request(), candidates)
    return [c.name for c in result.target_endpoints]


# --- SchedulerProfile -----------------------------------------------------------------


def test_filters_run_in_order_on_each_others_output() -> None:
    log: list[str] = []
    first = _Keep("first", "a", "b", "c", log=log)
    second = _Keep("second", "b", "c", log=log)
    third = _Keep("third", "c", "d", log=log)
    picker = _Recorder()
    profile = SchedulerProfile("p", filters=[first, second, third], picker=picker)
    assert _run(profile, _candidates("a", "b", "c", "d")) == ["c"]
    assert log == ["first", "second", "third"]
    assert first.seen == [["a", "b", "c", "d"]]
    assert second.seen == [["a", "b", "c"]]
    assert third.seen == [["b", "c"]]


def test_filter_leaving_nothing_fails_the_profile() -> None:
    empty = _Keep("empty")
    after = _Keep("after", "a")
    picker = _Recorder()
    profile = SchedulerProfile("p", filters=[empty, after], picker=picker)
    with pytest.raises(NoEndpointsError, match=r"^no endpoints available for the given request$"):
        profile.run(inference_request(), _candidates("a", "b"))
    assert after.seen == []
    assert picker.calls == 0


def test_scores_are_clamped_then_summed_by_weight_without_normalising() -> None:
    a = _Fixed("a", {"x": 1.5, "y": -1.0, "z": math.nan, "w": 0.5})
    b = _Fixed("b", {"x": 0.2, "y": 0.4, "z": 1.0, "w": math.nan})
    picker = _Recorder()
    profile = SchedulerProfile(
        "p", scorers=[WeightedScorer(a, 2.0), WeightedScorer(b, 3.0)], picker=picker
    )
    profile.run(inference_request(), _candidates("x", "y", "z", "w"))
    assert picker.scored == pytest.approx({"x": 2.6, "y": 1.2, "z": 3.0, "w": 1.0})


def test_without_scorers_every_candidate_scores_zero() -> None:
    picker = _Recorder()
    SchedulerProfile("p", picker=picker).run(inference_request(), _candidates("a", "b"))
    assert picker.scored == {"a": 0.0, "b": 0.0}


def test_result_is_exactly_the_pickers_choice() -> None:
    scorer = _Fixed("s", {"a": 1.0, "b": 0.0, "c": 0.5})
    profile = SchedulerProfile("p", scorers=[WeightedScorer(scorer, 1.0)], picker=_Recorder("b"))
    assert _run(profile, _candidates("a", "b", "c")) == ["b"]


def test_the_result_names_the_other_candidates_that_passed_the_filters() -> None:
    profile = SchedulerProfile("p", filters=[_Keep("k", "a", "b", "c")], picker=_Recorder("b"))
    result = profile.run(inference_request(), _candidates("a", "b", "c", "d"))
    assert [c.name for c in result.target_endpoints] == ["b"]
    assert sorted(c.name for c in result.alternates) == ["a", "c"]  # not "d": filtered out


def test_profile_with_max_score_picker_follows_the_weighted_sum() -> None:
    queue = _Fixed("queue", {"a": 1.0, "b": 0.0})
    prefix = _Fixed("prefix", {"a": 0.0, "b": 1.0})
    picker = max_score_picker.MaxScorePicker(
        TypedName(max_score_picker.TYPE, "m"),
        PickerParameters(max_num_of_endpoints=2),
        rng=random.Random(0),
    )
    profile = SchedulerProfile(
        "p", scorers=[WeightedScorer(queue, 2.0), WeightedScorer(prefix, 3.0)], picker=picker
    )
    assert _run(profile, _candidates("a", "b")) == ["b", "a"]


def test_profile_does_not_mutate_the_candidate_list() -> None:
    candidates = _candidates("a", "b", "c")
    before = list(candidates)
    profile = SchedulerProfile("p", filters=[_Keep("k", "b")], picker=_Recorder())
    assert _run(profile, candidates) == ["b"]
    assert candidates == before


def test_profile_reports_plugin_durations() -> None:
    observer = _Observer()
    profile = SchedulerProfile(
        "p",
        filters=[_Keep("k", "a")],
        scorers=[WeightedScorer(_Fixed("s", {"a": 1.0}), 1.0)],
        picker=_Recorder(),
        observer=observer,
    )
    profile.run(inference_request(), _candidates("a"))
    assert observer.points == [("Filter", "k"), ("Scorer", "s"), ("Picker", "recorder")]


# --- Scheduler ------------------------------------------------------------------------


class _TwoRounds:
    """Round 1 runs ``first``; round 2 runs ``second`` and ``third``; primary is ``first``.

    Records the results it saw at each call.
    """

    def __init__(self) -> None:
        self.typed_name = TypedName("two-rounds", "two-rounds")
        self.seen: list[dict[str, list[str] | None]] = []
        self.final: dict[str, list[str] | None] = {}

    def pick_profiles(
        self,
        request: InferenceRequest,
        profiles: Mapping[str, ProfileT],
        results: Mapping[str, ProfileRunResult | None],
    ) -> Mapping[str, ProfileT]:
        self.seen.append(_names(results))
        if not results:
            return {"first": profiles["first"]}
        if len(results) == 1:
            return {n: profiles[n] for n in ("second", "third")}
        return {}

    def process_results(
        self, request: InferenceRequest, results: Mapping[str, ProfileRunResult | None]
    ) -> SchedulingResult:
        self.final = _names(results)
        return SchedulingResult(profile_results=dict(results), primary_profile_name="first")


def _names(results: Mapping[str, ProfileRunResult | None]) -> dict[str, list[str] | None]:
    return {
        k: None if v is None else [c.name for c in v.target_endpoints] for k, v in results.items()
    }


def _keeping(name: str, *keep: str) -> SchedulerProfile:
    return SchedulerProfile(name, filters=[_Keep(name, *keep)], picker=_Recorder())


def test_multi_round_handler_sees_earlier_results_and_failures() -> None:
    handler = _TwoRounds()
    profiles = {
        "first": _keeping("first", "a"),
        "second": _keeping("second", "b"),
        "third": _keeping("third", "nobody"),
    }
    observer = _Observer()
    outcome = Scheduler(handler, profiles, observer).schedule(
        inference_request(), _candidates("a", "b")
    )
    assert handler.seen == [
        {},
        {"first": ["a"]},
        {"first": ["a"], "second": ["b"], "third": None},
    ]
    assert handler.final == {"first": ["a"], "second": ["b"], "third": None}
    assert outcome.primary_profile_name == "first"
    assert outcome.profile_results["third"] is None
    assert [p for p, _ in observer.points].count("ProfilePicker") == 3
    assert observer.points[-1] == ("ProcessProfilesResults", "two-rounds")
    assert observer.outcomes == [True]


class _Scripted:
    """Returns the given profiles once, then nothing; ``process_results`` as given."""

    def __init__(self, names: Sequence[str], fail_with: Exception | None = None) -> None:
        self.typed_name = TypedName("scripted", "scripted")
        self._names = names
        self._fail_with = fail_with
        self.results: dict[str, list[str] | None] = {}

    def pick_profiles(
        self,
        request: InferenceRequest,
        profiles: Mapping[str, ProfileT],
        results: Mapping[str, ProfileRunResult | None],
    ) -> Mapping[str, ProfileT]:
        return {} if results else {n: profiles[n] for n in self._names}

    def process_results(
        self, request: InferenceRequest, results: Mapping[str, ProfileRunResult | None]
    ) -> SchedulingResult:
        self.results = _names(results)
        if self._fail_with is not None:
            raise self._fail_with
        return SchedulingResult(profile_results=dict(results), primary_profile_name="p")


def test_no_profile_run_is_an_error() -> None:
    observer = _Observer()
    scheduler = Scheduler(_Scripted([]), {"p": _keeping("p", "a")}, observer)
    with pytest.raises(SchedulingFailedError, match=r"^failed to run any scheduler profile$"):
        scheduler.schedule(inference_request(), _candidates("a"))
    assert observer.outcomes == [False]


def test_failing_profile_is_recorded_as_none() -> None:
    handler = _Scripted(["p", "q"])
    profiles = {"p": _keeping("p", "a"), "q": _keeping("q", "nobody")}
    outcome = Scheduler(handler, profiles).schedule(inference_request(), _candidates("a"))
    assert handler.results == {"p": ["a"], "q": None}
    assert outcome.profile_results["q"] is None


def test_handler_error_reports_the_profile_failures() -> None:
    handler = _Scripted(["q"], fail_with=BadRequestError("primary missing"))
    scheduler = Scheduler(handler, {"q": _keeping("q", "nobody")})
    with pytest.raises(SchedulingFailedError) as info:
        scheduler.schedule(inference_request(), _candidates("a"))
    assert info.value.message == (
        "failed to find target endpoint: q: no endpoints available for the given request"
    )


def test_handler_error_without_profile_failures_keeps_its_message() -> None:
    handler = _Scripted(["p"], fail_with=BadRequestError("nope"))
    scheduler = Scheduler(handler, {"p": _keeping("p", "a")})
    with pytest.raises(SchedulingFailedError, match=r"^failed to find target endpoint: nope$"):
        scheduler.schedule(inference_request(), _candidates("a"))


class _Endless(_Scripted):
    def pick_profiles(
        self,
        request: InferenceRequest,
        profiles: Mapping[str, ProfileT],
        results: Mapping[str, ProfileRunResult | None],
    ) -> Mapping[str, ProfileT]:
        return profiles


def test_handler_that_never_stops_is_an_internal_error() -> None:
    scheduler = Scheduler(_Endless([]), {"p": _keeping("p", "a")}, max_rounds=3)
    with pytest.raises(InternalError):
        scheduler.schedule(inference_request(), _candidates("a"))


def test_scheduler_needs_a_profile() -> None:
    with pytest.raises(ValueError, match="at least one profile"):
        Scheduler(_Scripted([]), {})


# --- registration ---------------------------------------------------------------------

MODULES: tuple[ModuleType, ...] = (
    max_score_picker,
    random_picker,
    weighted_random_picker,
    single_profile_handler,
    disagg_profile_handler,
    queue_scorer,
    running_requests_scorer,
    kv_cache_scorer,
    lora_affinity_scorer,
    token_load_scorer,
    header_filter,
)

EXPECTED: dict[str, type] = {
    "max-score-picker": Picker,
    "random-picker": Picker,
    "weighted-random-picker": Picker,
    "single-profile-handler": ProfileHandler,
    "disagg-profile-handler": ProfileHandler,
    "pd-profile-handler": ProfileHandler,
    "queue-scorer": Scorer,
    "running-requests-size-scorer": Scorer,
    "kv-cache-utilization-scorer": Scorer,
    "lora-affinity-scorer": Scorer,
    "token-load-scorer": Scorer,
    "header-based-testing-filter": Filter,
}


def test_modules_register_the_reference_type_names() -> None:
    registry = PluginRegistry()
    for module in MODULES:
        module.register(registry)
    assert registry.types() == sorted(EXPECTED)


@pytest.mark.parametrize("type_name", sorted(EXPECTED))
def test_each_type_builds_with_defaults(type_name: str) -> None:
    registry = PluginRegistry()
    for module in MODULES:
        module.register(registry)
    plugin = registry.create(type_name, "my-" + type_name, None, plugin_handle())
    assert isinstance(plugin, EXPECTED[type_name])
    assert plugin.typed_name.name == "my-" + type_name
    assert registry.spec(type_name).description
