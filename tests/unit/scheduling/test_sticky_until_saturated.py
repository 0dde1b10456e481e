""" "Sticky until saturated": the TTFT gate of ``prefix-cache-affinity-filter``, the
look-ahead of ``token-load-scorer``, and the uncached tokens the in-flight producer books."""

from __future__ import annotations

from collections.abc import Sequence
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
from domain.plugins.base import PluginRegistry
from domain.requestcontrol.plugins import inflight_load
from domain.requestcontrol.plugins.inflight_load import InFlightLoadParameters
from domain.scheduling.interfaces import Filter, Scorer
from domain.scheduling.plugins import prefix_affinity_filter, token_load_scorer
from domain.scheduling.plugins.prefix_affinity_filter import PrefixAffinityFilterParameters
from domain.scheduling.types import Candidate, InferenceRequest, ProfileRunResult, SchedulingResult
from tests.bench.profiles import sticky_config
from tests.support.scheduling import candidate, cycle, inference_request, plugin_handle

PEAK = 1000.0  # tokens per second: 1 token = 1 ms of estimated TTFT


def _registry() -> PluginRegistry:
    registry = PluginRegistry()
    prefix_affinity_filter.register(registry)
    token_load_scorer.register(registry)
    inflight_load.register(registry)
    return registry


def _filter(**params: Any) -> Filter:
    params.setdefault("peak_prefill_throughput", PEAK)
    plugin = _registry().create(
        prefix_affinity_filter.TYPE,
        "f",
        PrefixAffinityFilterParameters(**params),
        plugin_handle(),
    )
    assert isinstance(plugin, Filter)
    return plugin


def _endpoint(name: str, matched: int, in_flight: int | None) -> Candidate:
    """An endpoint holding ``matched`` of 10 blocks of 100 tokens, with ``in_flight``
    tokens in flight (None: no load known)."""
    c = candidate(name)
    c.attributes[PREFIX_CACHE_MATCH_INFO] = PrefixCacheMatchInfo(matched, 10, 100)
    if in_flight is not None:
        c.attributes[IN_FLIGHT_LOAD] = InFlightLoad(1 if in_flight else 0, in_flight)
    return c


def _prompt(tokens: int) -> InferenceRequest:
    """A request of ``tokens`` estimated input tokens (size / 4)."""
    request = inference_request({"model": "m", "prompt": "x"})
    request.request_size_bytes = tokens * 4
    return request


def _kept(f: Filter, request: InferenceRequest, candidates: Sequence[Candidate]) -> list[str]:
    return [c.name for c in f.filter(cycle(request), request, candidates)]


# --- the TTFT gate ------------------------------------------------------------------------


def test_defaults_are_the_reference_values() -> None:
    params = PrefixAffinityFilterParameters()
    assert params.affinity_threshold == 0.80
    assert params.exploration_probability == 0.0
    assert params.max_TTFT_penalty_ms == 18000.0
    assert params.peak_prefill_throughput == 15928.0
    assert params.ttft_source == "prefillThroughput"


def test_sticks_while_the_sticky_endpoint_is_within_the_penalty() -> None:
    # warm: 1,000-token prompt fully cached, 2,400 in flight -> 2,400 ms
    # cold: nothing cached, idle -> 1,000 ms. Difference 1,400 ms <= 1,500.
    warm, cold = _endpoint("warm", 10, 2400), _endpoint("cold", 0, 0)
    assert _kept(_filter(max_TTFT_penalty_ms=1500), _prompt(1000), [warm, cold]) == ["warm"]


def test_breaks_stickiness_when_the_sticky_endpoint_is_saturated() -> None:
    warm, cold = _endpoint("warm", 10, 2600), _endpoint("cold", 0, 0)
    # 2,600 - 1,000 = 1,600 ms > 1,500: everyone passes, the scorers decide.
    assert _kept(_filter(max_TTFT_penalty_ms=1500), _prompt(1000), [warm, cold]) == [
        "warm",
        "cold",
    ]


def test_the_best_of_each_side_is_compared() -> None:
    busy_warm, idle_warm = _endpoint("busy-warm", 10, 50_000), _endpoint("idle-warm", 9, 0)
    busy_cold = _endpoint("busy-cold", 0, 40_000)
    # idle-warm: 100 uncached tokens -> 100 ms; best cold 41,000 ms: stay sticky.
    kept = _kept(_filter(), _prompt(1000), [busy_warm, busy_cold, idle_warm])
    assert kept == ["busy-warm", "idle-warm"]


def test_the_penalty_scales_with_the_peak_prefill_throughput() -> None:
    warm, cold = _endpoint("warm", 10, 30_000), _endpoint("cold", 0, 0)
    # 29,000 tokens more: 29 s at 1,000 tok/s (> 18 s), 1.8 s at 15,928 tok/s.
    assert _kept(_filter(), _prompt(1000), [warm, cold]) == ["warm", "cold"]
    fast = _filter(peak_prefill_throughput=15928.0)
    assert _kept(fast, _prompt(1000), [warm, cold]) == ["warm"]


def test_a_zero_penalty_always_sticks() -> None:
    warm, cold = _endpoint("warm", 10, 10**9), _endpoint("cold", 0, 0)
    assert _kept(_filter(max_TTFT_penalty_ms=0), _prompt(1000), [warm, cold]) == ["warm"]


def test_without_a_load_signal_the_gate_keeps_everyone() -> None:
    warm, cold = _endpoint("warm", 10, None), _endpoint("cold", 0, None)
    assert _kept(_filter(), _prompt(1000), [warm, cold]) == ["warm", "cold"]


def test_all_sticky_passes_without_asking_the_gate() -> None:
    a, b = _endpoint("a", 10, 10**9), _endpoint("b", 9, None)
    assert _kept(_filter(), _prompt(1000), [a, b]) == ["a", "b"]


def test_exploration_draws_from_the_injected_generator() -> None:
    warm, cold = _endpoint("warm", 10, 0), _endpoint("cold", 0, 0)
    plugin = _registry().create(
        prefix_affinity_filter.TYPE,
        "f",
        PrefixAffinityFilterParameters(exploration_probability=0.5),
        plugin_handle(seed=3),
    )
    assert isinstance(plugin, Filter)
    twin = plugin_handle(seed=3).rng
    request = _prompt(1000)
    for _ in range(50):
        expected = ["warm", "cold"] if twin.random() < 0.5 else ["warm"]
        assert _kept(plugin, request, [warm, cold]) == expected


# --- token-load-scorer look-ahead -----------------------------------------------------------


def _scorer(threshold: int = 10_000) -> Scorer:
    plugin = _registry().create(
        token_load_scorer.TYPE,
        "t",
        token_load_scorer.TokenLoadScorerParameters(queue_threshold_tokens=threshold),
        plugin_handle(),
    )
    assert isinstance(plugin, Scorer)
    return plugin


def test_look_ahead_adds_the_uncached_part_of_the_prompt() -> None:
    warm, cold = _endpoint("warm", 10, 0), _endpoint("cold", 0, 0)
    half, unknown = _endpoint("half", 5, 0), candidate("no-prefix-info")
    request = _prompt(1000)
    scores = _scorer().score(cycle(request), request, [warm, cold, half, unknown])
    assert list(scores) == pytest.approx([1.0, 0.9, 0.95, 0.9])


def test_a_warm_but_busy_endpoint_loses_to_an_idle_cold_one() -> None:
    warm, cold = _endpoint("warm", 10, 1500), _endpoint("cold", 0, 0)
    request = _prompt(1000)
    warm_score, cold_score = _scorer().score(cycle(request), request, [warm, cold])
    assert warm_score == pytest.approx(0.85)
    assert cold_score == pytest.approx(0.9)


# --- the in-flight producer books uncached tokens ---------------------------------------------


async def _booked(parameters: InFlightLoadParameters | None, matched: int) -> int:
    handle = plugin_handle()
    producer = _registry().create(inflight_load.TYPE, "load", parameters, handle)
    assert isinstance(producer, inflight_load.InFlightLoadProducer)
    target = _endpoint("a", matched, None)
    request = _prompt(1000)
    result = SchedulingResult(
        profile_results={"default": ProfileRunResult((target,))}, primary_profile_name="default"
    )
    await producer.pre_request(request, result)
    probe = candidate("a")
    await producer.prepare_request_data(_prompt(1), [probe])
    load = probe.attributes[IN_FLIGHT_LOAD]
    assert isinstance(load, InFlightLoad)
    return load.tokens


async def test_books_the_uncached_input_and_the_output_estimate() -> None:
    assert await _booked(None, 0) == 1000 + 1500
    assert await _booked(None, 6) == 400 + 1500  # 600 of 1,000 tokens cached


async def test_without_output_tokens_only_the_uncached_input_is_booked() -> None:
    params = InFlightLoadParameters(add_estimated_output_tokens=False)
    assert await _booked(params, 6) == 400
    assert await _booked(params, 10) == 0


# --- config through the loader ----------------------------------------------------------------


def test_the_sticky_profile_loads_with_the_new_api_group() -> None:
    loaded = load_config(sticky_config(), registry=build_registry(), handle=plugin_handle())
    profile = loaded.profiles["default"]
    assert [f.typed_name.type for f in profile.filters] == [prefix_affinity_filter.TYPE]
    assert [w.scorer.typed_name.type for w in profile.scorers] == [token_load_scorer.TYPE]
    assert profile.picker.typed_name.type == "max-score-picker"
    assert {p.typed_name.type for p in loaded.data_producers} == {
        "approx-prefix-cache-producer",
        "inflight-load-producer",
    }


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (
            "{type: prefix-cache-affinity-filter, parameters: {peakPrefillThroughput: 0}}",
            "plugins[0].parameters.peakPrefillThroughput: must be a finite number > 0",
        ),
        (
            "{type: prefix-cache-affinity-filter, parameters: {maxTTFTPenaltyMs: -5}}",
            "plugins[0].parameters.maxTTFTPenaltyMs: must be >= 0",
        ),
        (
            "{type: prefix-cache-affinity-filter, parameters: {ttftSource: queueDepth}}",
            "plugins[0].parameters.ttftSource: must be 'prefillThroughput' or 'latencyPredictor'",
        ),
        (
            "{type: prefix-cache-affinity-filter, parameters: {explorationProbability: 1.5}}",
            "plugins[0].parameters.explorationProbability: must be within [0, 1]",
        ),
        (
            "{type: token-load-scorer, parameters: {queueThresholdTokens: 0}}",
            "plugins[0].parameters.queueThresholdTokens: must be > 0",
        ),
        (
            "{type: inflight-load-producer, parameters: {addEstimatedOutputTokens: 1}}",
            "plugins[0].parameters.addEstimatedOutputTokens",
        ),
        (
            "{type: header-profile-handler, parameters: {headerName: ''}}",
            "plugins[0].parameters.headerName: must not be empty",
        ),
    ],
)
def test_out_of_range_parameters_stop_start_up_naming_the_entry(entry: str, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(f"plugins:\n- {entry}\n", registry=build_registry(), handle=plugin_handle())
    assert message in str(caught.value)
