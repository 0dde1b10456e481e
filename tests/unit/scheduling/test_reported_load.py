"""Load a server reports but the EPP did not send: ``reportedRequestTokens`` of
``token-load-scorer`` and ``prefix-cache-affinity-filter``, and the filter's
``excludeSaturated`` and ``leaveByReportedQueue``."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from app.config import ConfigError, load_config
from app.plugins import build_registry
from domain.datalayer.attributes import (
    IN_FLIGHT_LOAD,
    LATENCY_PREDICTION_INFO,
    PREFIX_CACHE_MATCH_INFO,
    InFlightLoad,
    LatencyPredictionInfo,
    PrefixCacheMatchInfo,
)
from domain.datastore.endpoint import EndpointMetrics
from domain.datastore.store import Datastore
from domain.plugins.base import PluginRegistry
from domain.requestcontrol.director import Director
from domain.scheduling.interfaces import Filter, Scorer
from domain.scheduling.plugins import prefix_affinity_filter, token_load_scorer
from domain.scheduling.plugins.prefix_affinity_filter import PrefixAffinityFilterParameters
from domain.scheduling.plugins.token_load_scorer import TokenLoadScorerParameters
from domain.scheduling.types import Candidate, InferenceRequest
from ports.endpoints import EndpointAddress, EndpointEvent, EndpointEventKind, EndpointInfo
from ports.requests import InboundRequest
from tests.bench.profiles import (
    predicted_band_blend_config,
    predicted_break_config,
    predicted_leave_config,
    reported_load_config,
)
from tests.support.director import configured_director
from tests.support.scheduling import candidate, cycle, inference_request, plugin_handle


def _registry() -> PluginRegistry:
    registry = PluginRegistry()
    prefix_affinity_filter.register(registry)
    token_load_scorer.register(registry)
    return registry


def _scorer(reported: int) -> Scorer:
    plugin = _registry().create(
        token_load_scorer.TYPE,
        "t",
        TokenLoadScorerParameters(queue_threshold_tokens=100_000, reported_request_tokens=reported),
        plugin_handle(),
    )
    assert isinstance(plugin, Scorer)
    return plugin


def _filter(**params: Any) -> Filter:
    params.setdefault("peak_prefill_throughput", 1000.0)  # 1 token = 1 ms
    plugin = _registry().create(
        prefix_affinity_filter.TYPE, "f", PrefixAffinityFilterParameters(**params), plugin_handle()
    )
    assert isinstance(plugin, Filter)
    return plugin


def _endpoint(
    name: str, *, matched: int = 0, own: int = 0, waiting: int = 0, running: int = 0
) -> Candidate:
    """An endpoint holding ``matched`` of 10 blocks of 100 tokens, with ``own`` requests of
    100 tokens in flight from the EPP and a scrape reporting ``waiting`` and ``running``."""
    c = candidate(name)
    c.metrics = EndpointMetrics(waiting_queue_size=waiting, running_requests_size=running)
    c.attributes[PREFIX_CACHE_MATCH_INFO] = PrefixCacheMatchInfo(matched, 10, 100)
    c.attributes[IN_FLIGHT_LOAD] = InFlightLoad(own, own * 100)
    return c


def _prompt(tokens: int = 1000) -> InferenceRequest:
    request = inference_request({"model": "m", "prompt": "x"})
    request.request_size_bytes = tokens * 4
    return request


# --- token-load-scorer ------------------------------------------------------------------------


def test_requests_reported_beyond_the_own_count_as_tokens() -> None:
    # own 2 in flight (200 tokens); the server reports 2 + 5: 5 more of 1,000 tokens each
    loaded = _endpoint("loaded", own=2, waiting=5, running=2)
    request = _prompt()
    [score] = _scorer(1000).score(cycle(request), request, [loaded])
    assert score == pytest.approx(1 - (1000 + 200 + 5 * 1000) / 100_000)


def test_a_server_reporting_only_the_own_requests_scores_as_without_the_parameter() -> None:
    # the scrape lags: fewer reported than in flight counts nothing either
    endpoints = [
        _endpoint("same", own=3, waiting=1, running=2),
        _endpoint("lagging", own=3, waiting=0, running=1),
        _endpoint("no-metrics", own=3),
    ]
    endpoints[2].metrics = None
    request = _prompt()
    with_it = _scorer(1000).score(cycle(request), request, endpoints)
    without = _scorer(0).score(cycle(request), request, endpoints)
    assert list(with_it) == list(without)


def test_without_the_parameter_reported_load_is_not_seen() -> None:
    free, loaded = _endpoint("free"), _endpoint("loaded", waiting=20, running=4)
    request = _prompt()
    assert len(set(_scorer(0).score(cycle(request), request, [free, loaded]))) == 1


# --- prefix-cache-affinity-filter -------------------------------------------------------------


def _kept(f: Filter, candidates: list[Candidate]) -> list[str]:
    request = _prompt()
    return [c.name for c in f.filter(cycle(request), request, candidates)]


def test_reported_load_opens_the_gate_of_a_sticky_endpoint_loaded_from_outside() -> None:
    # 10 reported beyond the own: 10,000 tokens = 10 s ahead at 1,000 tokens/s
    warm = _endpoint("warm", matched=10, waiting=9, running=1)
    cold = _endpoint("cold")
    assert _kept(_filter(max_TTFT_penalty_ms=5000), [warm, cold]) == ["warm"]
    opened = _filter(max_TTFT_penalty_ms=5000, reported_request_tokens=1000)
    assert _kept(opened, [warm, cold]) == ["warm", "cold"]


def test_exclude_saturated_passes_no_endpoint_beyond_the_penalty_from_the_fastest() -> None:
    warm = _endpoint("warm", matched=10, own=80)  # 8,000 tokens ahead
    cold, other = _endpoint("cold"), _endpoint("other", own=1)  # 1,000 and 1,100 ahead
    busy = _endpoint("busy", own=70)  # 8,000 ahead
    f = _filter(max_TTFT_penalty_ms=5000, exclude_saturated=True)
    assert _kept(f, [warm, cold, other, busy]) == ["cold", "other"]
    # within the penalty: sticky as before
    assert _kept(f, [_endpoint("warm", matched=10, own=30), cold]) == ["warm"]
    # a new prefix (nothing sticky) does not go to a saturated endpoint either
    assert _kept(f, [cold, other, busy]) == ["cold", "other"]
    # without the parameter the open gate passes everyone
    assert _kept(_filter(max_TTFT_penalty_ms=5000), [warm, cold, busy]) == ["warm", "cold", "busy"]


def _predicted(c: Candidate, ttft_ms: float) -> Candidate:
    c.attributes[LATENCY_PREDICTION_INFO] = LatencyPredictionInfo(
        ttft_ms, 0.0, -ttft_ms, 0.0, False, True, 0, "endpoint"
    )
    return c


def test_exclude_saturated_on_predictions() -> None:
    f = _filter(ttft_source="latencyPredictor", max_TTFT_penalty_ms=1000, exclude_saturated=True)
    cold, slow = _predicted(_endpoint("cold"), 1000), _predicted(_endpoint("slow"), 2500)
    warm = _predicted(_endpoint("warm", matched=10), 2500)
    assert _kept(f, [warm, cold, slow]) == ["cold"]
    assert _kept(f, [_predicted(_endpoint("warm", matched=10), 1900), cold, slow]) == ["warm"]
    assert _kept(f, [cold, slow]) == ["cold"]
    # a candidate without a prediction is never the fastest; none with one: stickiness alone
    assert _kept(f, [cold, _endpoint("unknown")]) == ["cold"]
    assert _kept(f, [_endpoint("a", matched=10), _endpoint("b")]) == ["a"]
    assert _kept(f, [_endpoint("a"), _endpoint("b")]) == ["a", "b"]


def _placed(f: Filter, candidates: list[Candidate]) -> str:
    """The endpoint the filter then ``token-load-scorer`` (own in-flight tokens only) pick."""
    request = _prompt()
    passed = list(f.filter(cycle(request), request, candidates))
    scores = _scorer(0).score(cycle(request), request, passed)
    return max(zip(scores, passed, strict=True), key=lambda pair: pair[0])[1].name


def _band_servers(*, warm_ttft: float) -> list[Candidate]:
    """A server holding the prompt (predicted ``warm_ttft`` ms), and two others within
    the band: ``light`` with few tokens in flight from this EPP but 8 requests waiting in
    its own queue (load the EPP did not send), ``queued`` with more tokens in flight from
    this EPP and 1 waiting."""
    return [
        _predicted(_endpoint("warm", matched=10, own=4, waiting=3), warm_ttft),
        _predicted(_endpoint("light", own=1, waiting=8), 1000),
        _predicted(_endpoint("queued", own=3, waiting=1), 1500),
    ]


def test_leave_by_reported_queue_moves_a_saturated_prefix_to_the_shorter_queue() -> None:
    leave = _filter(
        ttft_source="latencyPredictor",
        max_TTFT_penalty_ms=1000,
        exclude_saturated=True,
        leave_by_reported_queue=True,
    )
    band = _filter(ttft_source="latencyPredictor", max_TTFT_penalty_ms=1000, exclude_saturated=True)
    # the warm server is predicted 3 s, 2 s beyond the fastest: the prefix leaves it, for
    # the server whose own queue is shortest, not the one with the fewest tokens from here
    assert _kept(leave, _band_servers(warm_ttft=3000)) == ["queued"]
    assert _placed(leave, _band_servers(warm_ttft=3000)) == "queued"
    assert _placed(band, _band_servers(warm_ttft=3000)) == "light"
    # within the band the prefix stays on its warm server
    assert _kept(leave, _band_servers(warm_ttft=1800)) == ["warm"]
    # a brand-new prefix (no server holds it) is placed by token load, as without it
    new = _band_servers(warm_ttft=3000)[1:]
    assert _kept(leave, new) == ["light", "queued"]
    assert _placed(leave, new) == "light" == _placed(band, new)


def test_leave_by_reported_queue_when_the_gate_opens_and_without_metrics() -> None:
    # prefill-throughput gate, no excludeSaturated: the open gate passes the shortest
    # queues of all the candidates (the saturated sticky one included, were its shortest)
    f = _filter(max_TTFT_penalty_ms=5000, leave_by_reported_queue=True)
    warm = _endpoint("warm", matched=10, own=80, waiting=4)  # 8,000 tokens ahead
    a, b = _endpoint("a", waiting=2), _endpoint("b", own=1, waiting=2)
    assert _kept(f, [warm, a, b, _endpoint("c", waiting=5)]) == ["a", "b"]
    # a candidate without metrics passes only when none has any
    unknown = _endpoint("unknown")
    unknown.metrics = None
    assert _kept(f, [warm, unknown, a]) == ["a"]
    blind = [_endpoint("warm", matched=10, own=80), _endpoint("x"), _endpoint("y")]
    for c in blind:
        c.metrics = None
    assert _kept(f, blind) == ["warm", "x", "y"]


def test_queued_sticky_penalty_narrows_the_band_only_for_a_longer_queue() -> None:
    f = _filter(
        ttft_source="latencyPredictor",
        max_TTFT_penalty_ms=1000,
        exclude_saturated=True,
        queued_sticky_penalty_ms=300,
    )
    # predicted 600 ms above the fastest: within the band, beyond the narrow one
    warm = _predicted(_endpoint("warm", matched=10, waiting=3), 1600)
    fast = _predicted(_endpoint("fast", waiting=1), 1000)
    assert _kept(f, [warm, fast]) == ["fast"]
    # the same prediction with the shortest queue: sticky
    short = _predicted(_endpoint("warm", matched=10, waiting=1), 1600)
    assert _kept(f, [short, fast]) == ["warm"]
    # within the narrow band even with a longer queue: sticky
    close = _predicted(_endpoint("warm", matched=10, waiting=3), 1200)
    assert _kept(f, [close, fast]) == ["warm"]
    # unset: the whole band for everyone
    band = _filter(ttft_source="latencyPredictor", max_TTFT_penalty_ms=1000, exclude_saturated=True)
    assert _kept(band, [warm, fast]) == ["warm"]


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (
            "{type: token-load-scorer, parameters: {reportedRequestTokens: -1}}",
            "plugins[0].parameters.reportedRequestTokens: must be an integer >= 0",
        ),
        (
            "{type: prefix-cache-affinity-filter, parameters: {reportedRequestTokens: 1.5}}",
            "plugins[0].parameters.reportedRequestTokens",
        ),
        (
            "{type: prefix-cache-affinity-filter, parameters: {excludeSaturated: 1}}",
            "plugins[0].parameters.excludeSaturated",
        ),
        (
            "{type: prefix-cache-affinity-filter, parameters: {leaveByReportedQueue: yes-ish}}",
            "plugins[0].parameters.leaveByReportedQueue",
        ),
        (
            "{type: prefix-cache-affinity-filter, parameters: {maxTTFTPenaltyMs: 1000,"
            " queuedStickyPenaltyMs: 2000}}",
            "plugins[0].parameters.queuedStickyPenaltyMs: must be a number within [0, max",
        ),
    ],
)
def test_bad_parameters_stop_start_up_naming_the_entry(entry: str, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(f"plugins:\n- {entry}\n", registry=build_registry(), handle=plugin_handle())
    assert message in str(caught.value)


# --- as a user sees it: two servers, one busy with traffic the EPP did not send ---------------

FREE, BUSY = "10.3.0.1", "10.3.0.2"


def _two_servers() -> Datastore:
    """Two servers of 1,000 KV blocks: ``BUSY`` reports 20 waiting, 4 running and its KV
    cache 95% used, ``FREE`` nothing."""
    store = Datastore()
    for ip in (FREE, BUSY):
        store.apply(
            EndpointEvent(
                kind=EndpointEventKind.ADD_OR_UPDATE,
                endpoint=EndpointInfo(name=ip, address=EndpointAddress(ip=ip, port=8000)),
            )
        )
    for endpoint in store.endpoints():
        busy = endpoint.name == BUSY
        endpoint.metrics = EndpointMetrics(
            waiting_queue_size=20 if busy else 0,
            running_requests_size=4 if busy else 0,
            kv_cache_usage_percent=0.95 if busy else 0.0,
            cache_block_size=16,
            cache_num_blocks=1000,
        )
    store.mark_synced()
    return store


async def _routed(director: Director, n: int) -> Counter[str]:
    """``n`` requests one after the other, each a prompt of its own, none in flight when
    the next is routed."""
    chosen: Counter[str] = Counter()
    for i in range(n):
        body = b'{"model": "m", "prompt": "question %d: %s"}' % (i, b"word " * (50 + i))
        exchange = director.open(
            InboundRequest(
                request_id=f"r-{i}",
                headers={":path": "/v1/completions", ":method": "POST", "x-request-id": f"r-{i}"},
                body=body,
            )
        )
        try:
            decision = await exchange.route()
            assert decision.error is None, decision.error
            chosen[decision.endpoints[0].ip] += 1
        finally:
            await exchange.close()
    return chosen


@pytest.mark.parametrize(
    "config",
    [
        reported_load_config(),
        predicted_break_config(),
        predicted_band_blend_config(),
        predicted_leave_config(),
        predicted_leave_config(leave=False, queued_penalty_ms=300),
    ],
    ids=["reported", "predicted", "predicted-blend", "predicted-leave", "predicted-queued"],
)
async def test_new_prompts_settle_on_the_server_that_is_free(config: str) -> None:
    director = configured_director(_two_servers(), config)
    assert await _routed(director, 12) == Counter({FREE: 12})
