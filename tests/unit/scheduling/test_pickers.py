"""The in-tree pickers: max-score, random and weighted-random."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import pytest

from domain.plugins.base import PluginRegistry
from domain.scheduling.interfaces import Picker
from domain.scheduling.plugins import max_score_picker, random_picker, weighted_random_picker
from domain.scheduling.plugins.picker_parameters import PickerParameters
from domain.scheduling.types import ScoredCandidate
from tests.support.scheduling import candidate, cycle, inference_request, plugin_handle

PICKER_TYPES = ("max-score-picker", "random-picker", "weighted-random-picker")


def _registry() -> PluginRegistry:
    registry = PluginRegistry()
    for module in (max_score_picker, random_picker, weighted_random_picker):
        module.register(registry)
    return registry


def _picker(type_name: str, seed: int = 0, max_num: int | None = None) -> Picker:
    params = (
        PickerParameters() if max_num is None else PickerParameters(max_num_of_endpoints=max_num)
    )
    plugin = _registry().create(type_name, type_name, params, plugin_handle(seed))
    assert isinstance(plugin, Picker)
    return plugin


def _scored(**scores: float) -> list[ScoredCandidate]:
    return [ScoredCandidate(candidate(name), score) for name, score in scores.items()]


def _pick(picker: Picker, scored: Sequence[ScoredCandidate]) -> list[str]:
    request = inference_request()
    result = picker.pick(cycle(request), request, scored)
    return [c.name for c in result.target_endpoints]


def _first_picks(picker: Picker, scored: Sequence[ScoredCandidate], runs: int) -> Counter[str]:
    return Counter(_pick(picker, scored)[0] for _ in range(runs))


# --- parameters ------------------------------------------------------------------------


def test_parameters_default_to_one_endpoint() -> None:
    assert PickerParameters().max_num_of_endpoints == 1


@pytest.mark.parametrize("value", [0, -1, -100])
def test_non_positive_max_num_of_endpoints_becomes_one(value: int) -> None:
    assert PickerParameters(max_num_of_endpoints=value).max_num_of_endpoints == 1


@pytest.mark.parametrize("value", ["2", 1.5, True, None])
def test_non_integer_max_num_of_endpoints_is_refused(value: object) -> None:
    with pytest.raises(ValueError, match=r"^maxNumOfEndpoints: "):
        PickerParameters(max_num_of_endpoints=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("type_name", PICKER_TYPES)
def test_every_picker_takes_picker_parameters(type_name: str) -> None:
    assert _registry().spec(type_name).parameters is PickerParameters


@pytest.mark.parametrize("type_name", PICKER_TYPES)
def test_zero_max_num_returns_one_endpoint(type_name: str) -> None:
    picker = _picker(type_name, max_num=0)
    assert len(_pick(picker, _scored(a=1.0, b=2.0, c=3.0))) == 1


@pytest.mark.parametrize("type_name", PICKER_TYPES)
def test_no_candidates_gives_no_endpoints(type_name: str) -> None:
    assert _pick(_picker(type_name), []) == []
    assert _pick(_picker(type_name, max_num=3), []) == []


@pytest.mark.parametrize("type_name", PICKER_TYPES)
def test_more_wanted_than_available_returns_each_once(type_name: str) -> None:
    picked = _pick(_picker(type_name, max_num=10), _scored(a=0.0, b=1.0, c=2.0))
    assert sorted(picked) == ["a", "b", "c"]


@pytest.mark.parametrize("type_name", PICKER_TYPES)
def test_same_seed_same_choices(type_name: str) -> None:
    scored = _scored(a=1.0, b=1.0, c=1.0, d=1.0)
    first = [_pick(p, scored) for p in [_picker(type_name, seed=7, max_num=2)] for _ in range(20)]
    again = [_pick(p, scored) for p in [_picker(type_name, seed=7, max_num=2)] for _ in range(20)]
    assert first == again


@pytest.mark.parametrize("type_name", PICKER_TYPES)
def test_picker_does_not_mutate_its_input(type_name: str) -> None:
    scored = _scored(a=1.0, b=3.0, c=2.0)
    before = list(scored)
    _pick(_picker(type_name, max_num=3), scored)
    assert scored == before


# --- max-score-picker -----------------------------------------------------------------


def test_max_score_picks_the_highest_score() -> None:
    picker = _picker("max-score-picker")
    for _ in range(20):
        assert _pick(picker, _scored(a=0.5, b=2.5, c=1.0)) == ["b"]


def test_max_score_breaks_ties_at_random() -> None:
    picker = _picker("max-score-picker", seed=3)
    counts = _first_picks(picker, _scored(a=2.0, b=5.0, c=5.0, d=5.0, e=1.0), 300)
    assert set(counts) == {"b", "c", "d"}
    assert min(counts.values()) > 60  # roughly a third each


def test_max_score_returns_an_ordered_fallback_list() -> None:
    picker = _picker("max-score-picker", max_num=3)
    assert _pick(picker, _scored(a=0.1, b=0.9, c=0.5, d=0.7)) == ["b", "d", "c"]


def test_max_score_fallback_list_shuffles_ties_but_keeps_score_order() -> None:
    picker = _picker("max-score-picker", seed=11, max_num=3)
    seen = set()
    for _ in range(200):
        picked = _pick(picker, _scored(a=3.0, b=2.0, c=2.0, d=2.0, e=0.0))
        assert picked[0] == "a"
        assert set(picked[1:]) <= {"b", "c", "d"}
        seen.add(tuple(picked[1:]))
    assert len(seen) == 6  # every ordering of two of the three tied endpoints


# --- random-picker --------------------------------------------------------------------


def test_random_ignores_scores_and_reaches_everyone() -> None:
    picker = _picker("random-picker", seed=5)
    counts = _first_picks(picker, _scored(a=0.0, b=100.0, c=0.0, d=1.0), 400)
    assert set(counts) == {"a", "b", "c", "d"}
    assert min(counts.values()) > 60  # about 100 each


def test_random_returns_distinct_endpoints() -> None:
    picker = _picker("random-picker", seed=2, max_num=3)
    orders = set()
    for _ in range(100):
        picked = _pick(picker, _scored(a=1.0, b=1.0, c=1.0, d=1.0))
        assert len(picked) == 3
        assert len(set(picked)) == 3
        orders.add(tuple(picked))
    assert len(orders) > 10


# --- weighted-random-picker -----------------------------------------------------------


def test_weighted_random_first_pick_follows_scores() -> None:
    picker = _picker("weighted-random-picker", seed=42)
    runs = 6000
    counts = _first_picks(picker, _scored(a=1.0, b=2.0, c=3.0), runs)
    # Expected shares 1/6, 2/6, 3/6; allow a few percentage points of noise.
    assert counts["a"] / runs == pytest.approx(1 / 6, abs=0.03)
    assert counts["b"] / runs == pytest.approx(2 / 6, abs=0.03)
    assert counts["c"] / runs == pytest.approx(3 / 6, abs=0.03)


def test_weighted_random_never_picks_zero_score_first_when_others_are_positive() -> None:
    picker = _picker("weighted-random-picker", seed=1)
    counts = _first_picks(picker, _scored(a=0.0, b=0.5, c=-1.0, d=0.5), 300)
    assert set(counts) == {"b", "d"}


def test_weighted_random_without_positive_scores_behaves_as_random() -> None:
    picker = _picker("weighted-random-picker", seed=9)
    counts = _first_picks(picker, _scored(a=0.0, b=0.0, c=-2.0), 300)
    assert set(counts) == {"a", "b", "c"}
    assert min(counts.values()) > 60


def test_weighted_random_fallback_list_puts_unscored_last() -> None:
    picker = _picker("weighted-random-picker", seed=4, max_num=4)
    tails = set()
    for _ in range(100):
        picked = _pick(picker, _scored(z1=0.0, a=1.0, z2=0.0, b=1.0))
        assert set(picked[:2]) == {"a", "b"}
        assert set(picked[2:]) == {"z1", "z2"}
        tails.add(tuple(picked[2:]))
    assert len(tails) == 2  # the zero-scored tail is in random order


def test_weighted_random_fallback_list_is_distinct_and_prefers_high_scores() -> None:
    picker = _picker("weighted-random-picker", seed=8, max_num=2)
    runs = 3000
    firsts: Counter[str] = Counter()
    for _ in range(runs):
        picked = _pick(picker, _scored(a=1.0, b=1.0, c=8.0))
        assert len(set(picked)) == 2
        firsts[picked[0]] += 1
    assert firsts["c"] / runs == pytest.approx(0.8, abs=0.04)
