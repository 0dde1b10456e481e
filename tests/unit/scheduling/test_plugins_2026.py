"""utilization-filter, no-hit-lru-scorer, endpoint-attribute-filter/-scorer and
header-profile-handler: behaviour, and their configs (good and bad) through the loader."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from app.config import ConfigError, load_config
from app.plugins import build_registry
from domain.datalayer.attributes import (
    IN_FLIGHT_LOAD,
    PREFIX_CACHE_MATCH_INFO,
    InFlightLoad,
    PrefixCacheMatchInfo,
)
from domain.plugins.base import Plugin
from domain.scheduling.interfaces import Filter, ProfileHandler, Scorer
from domain.scheduling.scheduler import SchedulingFailedError
from domain.scheduling.types import Candidate, ProfileRunResult, SchedulingResult
from ports.endpoints import EndpointEvent, EndpointEventKind
from tests.support.scheduling import candidate, cycle, endpoint, inference_request, plugin_handle

REQUEST = inference_request({"model": "m", "prompt": "hello"})


def _plugin(type_name: str, parameters: Mapping[str, Any] | None = None, **handle: Any) -> Plugin:
    """One plugin of ``type_name`` built through the config loader."""
    entry: dict[str, Any] = {"type": type_name, "name": "p"}
    if parameters is not None:
        entry["parameters"] = dict(parameters)
    loaded = load_config(
        json.dumps({"plugins": [entry, {"type": "max-score-picker"}]}),
        registry=build_registry(),
        handle=plugin_handle(**handle),
    )
    return loaded.plugins["p"]


def _bad(type_name: str, parameters: Mapping[str, Any]) -> str:
    with pytest.raises(ConfigError) as caught:
        _plugin(type_name, parameters)
    return str(caught.value)


def _names(candidates: Sequence[Candidate]) -> list[str]:
    return [c.name for c in candidates]


def _filter(plugin: Plugin, candidates: Sequence[Candidate]) -> list[str]:
    assert isinstance(plugin, Filter)
    return _names(plugin.filter(cycle(REQUEST), REQUEST, candidates))


# --- utilization-filter -------------------------------------------------------------------


def _busy(name: str, active: int = 0, **metrics: Any) -> Candidate:
    c = candidate(name, **metrics)
    if active:
        c.attributes[IN_FLIGHT_LOAD] = InFlightLoad(active, active * 100)
    return c


def test_utilization_keeps_endpoints_within_every_cap() -> None:
    plugin = _plugin(
        "utilization-filter",
        {
            "conditions": [
                {"metric": "running-requests", "maxValue": 40},
                {"metric": "waiting-queue", "maxValue": 0},
                {"metric": "kv-cache-utilization", "maxValue": 0.8},
                {"metric": "active-requests", "maxValue": 3},
            ]
        },
    )
    candidates = [
        _busy("ok", 3, running_requests_size=40, kv_cache_usage_percent=0.8),
        _busy("queued", waiting_queue_size=1),
        _busy("running", running_requests_size=41),
        _busy("kv", kv_cache_usage_percent=0.81),
        _busy("in-flight", 4),
        _busy("no-metrics"),  # missing values count as 0
    ]
    assert _filter(plugin, candidates) == ["ok", "no-metrics"]
    assert list(plugin.consumes()) == [IN_FLIGHT_LOAD]  # type: ignore[attr-defined]


def test_utilization_fallback_on_empty() -> None:
    conditions = [{"metric": "waiting-queue", "maxValue": 0}]
    full = [_busy("a", waiting_queue_size=2), _busy("b", waiting_queue_size=5)]
    assert _filter(_plugin("utilization-filter", {"conditions": conditions}), full) == []
    fallback = _plugin("utilization-filter", {"conditions": conditions, "fallbackOnEmpty": True})
    assert _filter(fallback, full) == ["a", "b"]
    assert list(fallback.consumes()) == []  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({}, "plugins[0].parameters.conditions: required field is missing"),
        ({"conditions": []}, "plugins[0].parameters.conditions: at least one condition"),
        (
            {"conditions": [{"metric": "gpu", "maxValue": 1}]},
            "plugins[0].parameters.conditions[0].metric: must be one of",
        ),
        (
            {"conditions": [{"metric": "waiting-queue", "maxValue": -1}]},
            "plugins[0].parameters.conditions[0].maxValue: must be >= 0",
        ),
        (
            {"conditions": [{"metric": "kv-cache-utilization", "maxValue": 1.2}]},
            "plugins[0].parameters.conditions[0].maxValue: a KV-cache fraction must be <= 1",
        ),
    ],
)
def test_utilization_bad_config(parameters: dict[str, Any], message: str) -> None:
    assert message in _bad("utilization-filter", parameters)


# --- no-hit-lru-scorer --------------------------------------------------------------------


def _cold(*names: str) -> list[Candidate]:
    return [candidate(n) for n in names]


async def _route(scorer: Plugin, candidates: Sequence[Candidate], chosen: int) -> list[float]:
    assert isinstance(scorer, Scorer)
    request = inference_request({"model": "m", "prompt": "x"}, request_id=f"r-{id(candidates)}")
    scores = list(scorer.score(cycle(request), request, candidates))
    result = SchedulingResult(
        profile_results={"default": ProfileRunResult((candidates[chosen],))},
        primary_profile_name="default",
    )
    await scorer.pre_request(request, result)  # type: ignore[attr-defined]
    return scores


async def test_no_hit_lru_spreads_cold_requests() -> None:
    scorer = _plugin("no-hit-lru-scorer")
    # Nobody used yet: candidate order, 1, 0.5, 0.
    assert await _route(scorer, _cold("a", "b", "c"), chosen=0) == [1.0, 0.5, 0.0]
    # a took the last cold request: b and c (never used) first, a last.
    assert await _route(scorer, _cold("a", "b", "c"), chosen=2) == [0.0, 1.0, 0.5]
    # then c: b (never used) 1, a (older) 0.5, c (newest) 0.
    assert await _route(scorer, _cold("a", "b", "c"), chosen=1) == [0.5, 1.0, 0.0]


async def test_no_hit_lru_is_neutral_on_a_hit_and_does_not_learn_from_it() -> None:
    scorer = _plugin("no-hit-lru-scorer")
    hot = _cold("a", "b")
    hot[1].attributes[PREFIX_CACHE_MATCH_INFO] = PrefixCacheMatchInfo(1, 4, 16)
    assert await _route(scorer, hot, chosen=0) == [0.5, 0.5]
    assert await _route(scorer, _cold("a", "b"), chosen=1) == [1.0, 0.0]


async def test_no_hit_lru_forgets_deleted_endpoints() -> None:
    handle = plugin_handle()
    live = endpoint("a")
    handle.datastore.apply(EndpointEvent(kind=EndpointEventKind.ADD_OR_UPDATE, endpoint=live.info))
    scorer = build_registry().create("no-hit-lru-scorer", "lru", None, handle)
    await _route(scorer, _cold("a", "b"), chosen=0)
    assert await _route(scorer, _cold("a", "b"), chosen=1) == [0.0, 1.0]
    handle.datastore.apply(EndpointEvent(kind=EndpointEventKind.DELETE, endpoint=live.info))
    assert await _route(scorer, _cold("a", "b"), chosen=1) == [1.0, 0.0]


def test_no_hit_lru_bad_config() -> None:
    assert "plugins[0].parameters.lruSize: must be > 0" in _bad("no-hit-lru-scorer", {"lruSize": 0})


# --- endpoint-attribute-filter / -scorer ----------------------------------------------------


def _valued(*values: float | None) -> list[Candidate]:
    out = []
    for i, v in enumerate(values):
        c = candidate(f"e{i}")
        if v is not None:
            c.attributes["gpu_util"] = v
        out.append(c)
    return out


def _attr_filter(algorithm: dict[str, Any], **extra: Any) -> Plugin:
    return _plugin(
        "endpoint-attribute-filter", {"attribute": "gpu_util", "algorithm": algorithm, **extra}
    )


def test_attribute_filter_threshold_and_missing_policy() -> None:
    algorithm = {"type": "threshold", "threshold": {"operator": "LessThan", "value": 0.5}}
    values = _valued(0.2, 0.7, None, 0.5)
    assert _filter(_attr_filter(algorithm), values) == ["e0", "e2"]
    assert _filter(_attr_filter(algorithm, onMissing="Fail"), values) == ["e0"]


def test_attribute_filter_range_top_k_percentile() -> None:
    values = _valued(10, 40, 20, 30, None)
    in_range = _attr_filter({"type": "range", "range": {"min": 20, "max": 30}})
    assert _filter(in_range, values) == ["e2", "e3", "e4"]
    top = _attr_filter({"type": "topK", "topK": {"k": 2}}, onMissing="Fail")
    assert _filter(top, values) == ["e1", "e3"]
    low = _attr_filter({"type": "topK", "topK": {"k": 1, "higherIsBetter": False}})
    assert _filter(low, values) == ["e0", "e4"]
    # nearest rank: ceil(0.5 * 4) = 2nd of [10, 20, 30, 40] = 20
    half = _attr_filter({"type": "percentile", "percentile": {"percentile": 50}}, onMissing="Fail")
    assert _filter(half, values) == ["e1", "e2", "e3"]


def test_attribute_filter_reads_model_server_metrics_by_field_name() -> None:
    plugin = _plugin(
        "endpoint-attribute-filter",
        {
            "attribute": "waiting_queue_size",
            "algorithm": {"type": "threshold", "threshold": {"operator": "Equal", "value": 0}},
            "fallbackOnEmpty": True,
        },
    )
    idle, queued = candidate("idle", waiting_queue_size=0), candidate("q", waiting_queue_size=3)
    assert _filter(plugin, [idle, queued]) == ["idle"]
    assert _filter(plugin, [queued]) == ["q"]  # fallbackOnEmpty


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"attribute": "x", "algorithm": {"type": "topK"}}, "algorithm.topK: required"),
        (
            {"attribute": "x", "algorithm": {"type": "topK", "topK": {"k": 0}}},
            "algorithm.topK.k: must be a positive integer",
        ),
        (
            {"attribute": "x", "algorithm": {"type": "range", "range": {"min": 2, "max": 1}}},
            "algorithm.range.min: must be <= max",
        ),
        (
            {
                "attribute": "x",
                "algorithm": {"type": "percentile", "percentile": {"percentile": 101}},
            },
            "algorithm.percentile.percentile: must be within [0, 100]",
        ),
        (
            {
                "attribute": "x",
                "algorithm": {"type": "threshold", "threshold": {"operator": "<", "value": 1}},
            },
            "algorithm.threshold.operator: must be one of",
        ),
        ({"attribute": "x", "algorithm": {"type": "best"}}, "algorithm.type: must be one of"),
        (
            {
                "attribute": "x",
                "onMissing": "Drop",
                "algorithm": {"type": "range", "range": {"min": 1, "max": 2}},
            },
            "parameters.onMissing: must be Pass or Fail",
        ),
    ],
)
def test_attribute_filter_bad_config(parameters: dict[str, Any], message: str) -> None:
    assert message in _bad("endpoint-attribute-filter", parameters)


def _attr_scorer(algorithm: dict[str, Any]) -> Scorer:
    plugin = _plugin(
        "endpoint-attribute-scorer", {"attributeKey": "gpu_util", "algorithm": algorithm}
    )
    assert isinstance(plugin, Scorer)
    return plugin


def test_attribute_scorer_adaptive_and_fixed_ranges() -> None:
    values = _valued(10, 30, 20, None)
    lower = _attr_scorer({"type": "linear_lower_is_better"})
    assert list(lower.score(cycle(REQUEST), REQUEST, values)) == [1.0, 0.0, 0.5, 0.0]
    higher = _attr_scorer(
        {"type": "linear_higher_is_better", "normalization": {"fixedRange": {"min": 0, "max": 40}}}
    )
    assert list(higher.score(cycle(REQUEST), REQUEST, values)) == [0.25, 0.75, 0.5, 0.0]
    same = _valued(5, 5, None)
    assert list(lower.score(cycle(REQUEST), REQUEST, same)) == [1.0, 1.0, 0.0]


def test_attribute_scorer_bad_config() -> None:
    fixed = {
        "type": "linear_lower_is_better",
        "normalization": {"fixedRange": {"min": 1, "max": 1}},
    }
    message = _bad("endpoint-attribute-scorer", {"attributeKey": "x", "algorithm": fixed})
    assert "algorithm.normalization.fixedRange.min: must be < max" in message


# --- header-profile-handler -----------------------------------------------------------------


def _handler(parameters: Mapping[str, Any] | None = None) -> ProfileHandler:
    plugin = _plugin("header-profile-handler", parameters)
    assert isinstance(plugin, ProfileHandler)
    return plugin


PROFILES = {"prefill": "P", "decode": "D", "encode": "E"}


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({"epp-profile": "prefill"}, ["prefill"]),
        ({}, ["decode"]),
        ({"epp-profile": "  "}, ["decode"]),
        ({"epp-profile": "nope"}, []),
    ],
)
def test_header_picks_one_profile(headers: dict[str, str], expected: list[str]) -> None:
    request = inference_request({"model": "m", "prompt": "x"}, headers=headers)
    assert list(_handler().pick_profiles(request, PROFILES, {})) == expected
    assert _handler().pick_profiles(request, PROFILES, {"decode": None}) == {}


def test_header_name_and_default_are_configurable() -> None:
    handler = _handler({"headerName": "X-Stage", "defaultProfile": "prefill"})
    staged = inference_request({"model": "m", "prompt": "x"}, headers={"x-stage": "encode"})
    assert list(handler.pick_profiles(staged, PROFILES, {})) == ["encode"]
    assert list(handler.pick_profiles(REQUEST, PROFILES, {})) == ["prefill"]
    assert list(handler.pick_profiles(staged, {"only": "O"}, {})) == ["only"]


def test_header_profile_result_is_primary_and_no_profile_fails() -> None:
    handler = _handler()
    run = ProfileRunResult((candidate("a"),))
    assert handler.process_results(REQUEST, {"prefill": run}).primary_profile_name == "prefill"
    with pytest.raises(SchedulingFailedError):
        handler.process_results(REQUEST, {})
