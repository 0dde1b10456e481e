"""The in-tree scorers, each formula with concrete numbers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from domain.datalayer.attributes import IN_FLIGHT_LOAD, InFlightLoad
from domain.plugins.base import PluginRegistry
from domain.scheduling.interfaces import AFFINITY, DISTRIBUTION, Scorer
from domain.scheduling.plugins import (
    kv_cache_scorer,
    lora_affinity_scorer,
    queue_scorer,
    running_requests_scorer,
    token_load_scorer,
)
from domain.scheduling.plugins.token_load_scorer import TokenLoadScorerParameters
from domain.scheduling.types import Candidate, InferenceRequest
from tests.support.scheduling import candidate, cycle, inference_request, plugin_handle

MODULES = (
    queue_scorer,
    running_requests_scorer,
    kv_cache_scorer,
    lora_affinity_scorer,
    token_load_scorer,
)


def _scorer(type_name: str, parameters: Any = None) -> Scorer:
    registry = PluginRegistry()
    for module in MODULES:
        module.register(registry)
    plugin = registry.create(type_name, type_name, parameters, plugin_handle())
    assert isinstance(plugin, Scorer)
    return plugin


def _score(
    scorer: Scorer, candidates: Sequence[Candidate], request: InferenceRequest | None = None
) -> list[float]:
    request = request or inference_request({"model": "base", "prompt": "hi"})
    return list(scorer.score(cycle(request), request, candidates))


@pytest.mark.parametrize(
    ("type_name", "category"),
    [
        ("queue-scorer", DISTRIBUTION),
        ("running-requests-size-scorer", DISTRIBUTION),
        ("kv-cache-utilization-scorer", DISTRIBUTION),
        ("lora-affinity-scorer", AFFINITY),
        ("token-load-scorer", DISTRIBUTION),
    ],
)
def test_category(type_name: str, category: str) -> None:
    scorer = _scorer(type_name)
    assert scorer.category == category
    assert scorer.typed_name.type == type_name


@pytest.mark.parametrize(
    "type_name",
    [
        "queue-scorer",
        "running-requests-size-scorer",
        "kv-cache-utilization-scorer",
        "lora-affinity-scorer",
        "token-load-scorer",
    ],
)
def test_no_candidates_no_scores(type_name: str) -> None:
    assert _score(_scorer(type_name), []) == []


# --- queue-scorer / running-requests-size-scorer --------------------------------------

METRIC_OF = {
    "queue-scorer": "waiting_queue_size",
    "running-requests-size-scorer": "running_requests_size",
}


@pytest.mark.parametrize("type_name", list(METRIC_OF))
def test_min_max_formula(type_name: str) -> None:
    field = METRIC_OF[type_name]
    candidates = [candidate(n, **{field: v}) for n, v in (("a", 2), ("b", 10), ("c", 4), ("d", 6))]
    # (max - q) / (max - min) with max 10, min 2
    assert _score(_scorer(type_name), candidates) == pytest.approx([1.0, 0.0, 0.75, 0.5])


@pytest.mark.parametrize("type_name", list(METRIC_OF))
def test_min_max_all_equal_scores_one(type_name: str) -> None:
    field = METRIC_OF[type_name]
    candidates = [candidate(n, **{field: 7}) for n in ("a", "b", "c")]
    assert _score(_scorer(type_name), candidates) == [1.0, 1.0, 1.0]
    assert _score(_scorer(type_name), candidates[:1]) == [1.0]


@pytest.mark.parametrize("type_name", list(METRIC_OF))
def test_min_max_without_metrics_scores_zero_and_is_left_out(type_name: str) -> None:
    field = METRIC_OF[type_name]
    candidates = [candidate("unknown"), candidate("a", **{field: 4}), candidate("b", **{field: 8})]
    assert _score(_scorer(type_name), candidates) == pytest.approx([0.0, 1.0, 0.0])
    # the unknown endpoint does not count as an empty queue
    assert _score(_scorer(type_name), [candidates[0], candidates[2]]) == [0.0, 1.0]
    assert _score(_scorer(type_name), [candidate("x"), candidate("y")]) == [0.0, 0.0]


def test_queue_scorer_reads_the_waiting_queue_not_running() -> None:
    candidates = [
        candidate("a", waiting_queue_size=0, running_requests_size=50),
        candidate("b", waiting_queue_size=10, running_requests_size=0),
    ]
    assert _score(_scorer("queue-scorer"), candidates) == [1.0, 0.0]
    assert _score(_scorer("running-requests-size-scorer"), candidates) == [0.0, 1.0]


# --- kv-cache-utilization-scorer ------------------------------------------------------


def test_kv_cache_scores_free_fraction() -> None:
    candidates = [
        candidate("a", kv_cache_usage_percent=0.0),
        candidate("b", kv_cache_usage_percent=0.25),
        candidate("c", kv_cache_usage_percent=1.0),
        candidate("d"),
    ]
    assert _score(_scorer("kv-cache-utilization-scorer"), candidates) == pytest.approx(
        [1.0, 0.75, 0.0, 0.0]
    )


# --- lora-affinity-scorer -------------------------------------------------------------


@pytest.mark.parametrize(
    ("active", "waiting", "max_active", "expected"),
    [
        ({"sql-lora"}, set(), 4, 1.0),  # active
        ({"sql-lora", "x", "y", "z"}, {"w"}, 2, 1.0),  # active wins even when full
        ({"x"}, {"y"}, 4, 0.8),  # free slot: 1 + 1 < 4
        ({"x"}, {"sql-lora"}, 4, 0.8),  # free slot beats "waiting"
        ({"x", "y"}, {"sql-lora"}, 3, 0.6),  # full (2 + 1 == 3), but waiting
        ({"x", "y"}, {"z"}, 3, 0.0),  # full and not there
        (set(), set(), 0, 0.0),  # no adapter slots reported
    ],
)
def test_lora_affinity(
    active: set[str], waiting: set[str], max_active: int, expected: float
) -> None:
    c = candidate(
        "a",
        active_models=frozenset(active),
        waiting_models=frozenset(waiting),
        max_active_models=max_active,
    )
    request = inference_request({"model": "sql-lora", "prompt": "hi"})
    assert _score(_scorer("lora-affinity-scorer"), [c], request) == [expected]


def test_lora_affinity_uses_the_target_model_after_rewrite() -> None:
    c = candidate("a", active_models=frozenset({"rewritten"}), max_active_models=1)
    request = inference_request({"model": "incoming", "prompt": "hi"})
    request.target_model = "rewritten"
    assert _score(_scorer("lora-affinity-scorer"), [c], request) == [1.0]


def test_lora_affinity_without_metrics_scores_zero() -> None:
    assert _score(_scorer("lora-affinity-scorer"), [candidate("a")]) == [0.0]


# --- token-load-scorer ----------------------------------------------------------------


def _loaded(name: str, tokens: int | None) -> Candidate:
    c = candidate(name)
    if tokens is not None:
        c.attributes[IN_FLIGHT_LOAD] = InFlightLoad(requests=1, tokens=tokens)
    return c


#: A request without a body brings no prompt tokens: only the in-flight load counts.
_NO_PROMPT = inference_request(None)


def test_token_load_default_threshold() -> None:
    assert TokenLoadScorerParameters().queue_threshold_tokens == 4_194_304
    scorer = _scorer("token-load-scorer")
    scores = _score(scorer, [_loaded("a", 1_048_576), _loaded("b", 4_194_304)], _NO_PROMPT)
    assert scores == pytest.approx([0.75, 0.0])


def test_token_load_formula() -> None:
    scorer = _scorer("token-load-scorer", TokenLoadScorerParameters(queue_threshold_tokens=1000))
    candidates = [
        _loaded("idle", 0),
        _loaded("quarter", 250),
        _loaded("full", 1000),
        _loaded("over", 5000),
        _loaded("unknown", None),
    ]
    assert _score(scorer, candidates, _NO_PROMPT) == pytest.approx([1.0, 0.75, 0.0, 0.0, 1.0])


def test_token_load_consumes_in_flight_load() -> None:
    scorer = _scorer("token-load-scorer")
    assert list(scorer.consumes()) == [IN_FLIGHT_LOAD]  # type: ignore[attr-defined]


@pytest.mark.parametrize("value", [0, -5])
def test_token_load_threshold_must_be_positive(value: int) -> None:
    with pytest.raises(ValueError, match=r"^queueThresholdTokens: must be > 0"):
        TokenLoadScorerParameters(queue_threshold_tokens=value)


@pytest.mark.parametrize("value", ["100", 1.5, True])
def test_token_load_threshold_must_be_an_integer(value: object) -> None:
    with pytest.raises(ValueError, match=r"^queueThresholdTokens: must be an integer"):
        TokenLoadScorerParameters(queue_threshold_tokens=value)  # type: ignore[arg-type]
