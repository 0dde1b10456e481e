"""The prefix producer, scorer and affinity filter, end to end on candidates."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from app.config import load_config
from app.plugins import build_registry
from domain.datalayer.attributes import (
    IN_FLIGHT_LOAD,
    PREFIX_CACHE_MATCH_INFO,
    InFlightLoad,
    PrefixCacheMatchInfo,
)
from domain.datastore.store import Datastore
from domain.plugins.base import PluginRegistry, parameter_names
from domain.plugins.handle import Handle
from domain.prefixcache import InMemoryPrefixIndex, StdlibBlockHasher
from domain.requestcontrol.interfaces import DataProducer, PlacementClaimer, PreRequest
from domain.requestcontrol.plugins import prefix_producer
from domain.requestcontrol.plugins.prefix_producer import (
    ApproxPrefixCacheProducer,
    PrefixCacheParameters,
)
from domain.scheduling.interfaces import AFFINITY, Filter, Scorer
from domain.scheduling.plugins import prefix_affinity_filter, prefix_cache_scorer
from domain.scheduling.plugins.prefix_affinity_filter import PrefixAffinityFilterParameters
from domain.scheduling.types import Candidate, InferenceRequest, ProfileRunResult, SchedulingResult
from domain.sharedstate import ResilientPrefixIndex
from ports.endpoints import EndpointEvent, EndpointEventKind
from ports.metric_catalogue import PREFIX_INDEXER_HIT_BYTES, PREFIX_INDEXER_HIT_RATIO
from ports.prefix_index import PrefixIndex
from tests.fakes.observer import RecordingObserver
from tests.support.scheduling import candidate, cycle, inference_request, plugin_handle

BLOCK_CHARS = 16 * 4  # default blockSizeTokens x 4 characters per token
PROMPT = "".join(chr(ord("a") + i % 26) * BLOCK_CHARS for i in range(10))  # 10 blocks
_request_ids = iter(range(1_000_000))


def _registry() -> PluginRegistry:
    registry = PluginRegistry()
    prefix_producer.register(registry)
    prefix_cache_scorer.register(registry)
    prefix_affinity_filter.register(registry)
    return registry


def _handle(index: PrefixIndex | None = None, seed: int = 0) -> Handle:
    return plugin_handle(
        seed,
        hasher=StdlibBlockHasher(),
        prefix_index=index or InMemoryPrefixIndex(),
        datastore=Datastore(),
    )


def _producer(handle: Handle, **params: Any) -> ApproxPrefixCacheProducer:
    plugin = _registry().create(
        prefix_producer.TYPE, "prefix", PrefixCacheParameters(**params), handle
    )
    assert isinstance(plugin, ApproxPrefixCacheProducer)
    return plugin


def _endpoints(handle: Handle, *names: str, **metrics: Any) -> list[Candidate]:
    """Candidates for ``names``, also present in the handle's datastore."""
    found = [candidate(name, **metrics) for name in names]
    for c in found:
        handle.datastore.apply(EndpointEvent(kind=EndpointEventKind.ADD_OR_UPDATE, endpoint=c.info))
    return found


def _fresh(candidates: Sequence[Candidate]) -> list[Candidate]:
    """New per-request snapshots of the same endpoints."""
    return [Candidate(c.endpoint) for c in candidates]


def _request(prompt: str | None = PROMPT, model: str = "m", **body: Any) -> InferenceRequest:
    payload = None if prompt is None else {"model": model, "prompt": prompt, **body}
    return inference_request(payload, request_id=f"r{next(_request_ids)}")


def _infos(candidates: Sequence[Candidate]) -> dict[str, object]:
    return {c.name: c.attributes.get(PREFIX_CACHE_MATCH_INFO) for c in candidates}


def _result(primary: Candidate, prefill: Candidate | None = None) -> SchedulingResult:
    results: dict[str, ProfileRunResult | None] = {"decode": ProfileRunResult((primary,))}
    if prefill is not None:
        results["prefill"] = ProfileRunResult((prefill,))
    return SchedulingResult(profile_results=results, primary_profile_name="decode")


async def _route(
    producer: ApproxPrefixCacheProducer,
    candidates: Sequence[Candidate],
    request: InferenceRequest,
    chosen: int = 0,
) -> dict[str, object]:
    """Runs the producer for ``request`` and sends it to ``candidates[chosen]``."""
    snapshot = _fresh(candidates)
    await producer.prepare_request_data(request, snapshot)
    await producer.pre_request(request, _result(snapshot[chosen]))
    return _infos(snapshot)


# --- producer ---------------------------------------------------------------------------


def test_producer_declares_its_data_and_extension_points() -> None:
    producer = _producer(_handle())
    assert isinstance(producer, DataProducer)
    assert isinstance(producer, PreRequest)
    assert list(producer.produces()) == [PREFIX_CACHE_MATCH_INFO]
    assert list(producer.consumes()) == []
    assert str(producer.typed_name) == "prefix/approx-prefix-cache-producer"


def test_producer_is_the_default_producer_of_the_match_info() -> None:
    registry = _registry()
    assert registry.default_producer_for(PREFIX_CACHE_MATCH_INFO) == prefix_producer.TYPE
    plugin = registry.create(prefix_producer.TYPE, "auto", None, _handle())
    assert isinstance(plugin, ApproxPrefixCacheProducer)
    assert plugin.parameters == PrefixCacheParameters()


async def test_first_request_matches_nothing_then_the_same_prompt_matches_fully() -> None:
    handle = _handle()
    producer = _producer(handle)
    pods = _endpoints(handle, "a", "b", "c")
    first = await _route(producer, pods, _request(), chosen=1)
    assert set(first.values()) == {PrefixCacheMatchInfo(0, 10, 16)}

    again = _fresh(pods)
    await producer.prepare_request_data(_request(), again)
    assert _infos(again) == {
        "a": PrefixCacheMatchInfo(0, 10, 16),
        "b": PrefixCacheMatchInfo(10, 10, 16),
        "c": PrefixCacheMatchInfo(0, 10, 16),
    }


async def test_a_new_prefix_matched_by_two_processes_at_once_goes_where_it_was_claimed() -> None:
    shared = InMemoryPrefixIndex()  # the store both processes share
    first_handle, second_handle = _handle(shared), _handle(shared, seed=1)
    first, second = _producer(first_handle), _producer(second_handle)
    assert isinstance(first, PlacementClaimer)
    pods_first = _fresh(_endpoints(first_handle, "a", "b"))
    pods_second = _fresh(_endpoints(second_handle, "a", "b"))
    one, two = _request(), _request()
    # Both match before either records: the prefix is new to both.
    await first.prepare_request_data(one, pods_first)
    await second.prepare_request_data(two, pods_second)
    assert {_infos(pods_first)["a"], _infos(pods_second)["b"]} == {PrefixCacheMatchInfo(0, 10, 16)}
    # The first picks "a" and claims it; the second picked "b" and is told "a".
    assert await first.claim_placement(one, _result(pods_first[0])) is None
    moved = await second.claim_placement(two, _result(pods_second[1]))
    assert moved is pods_second[0]
    await first.pre_request(one, _result(pods_first[0]))
    await second.pre_request(two, _result(moved, None))
    assert shared.match_sync(shared_chain(first, one)) == {"a": 10}


async def test_a_claim_for_an_endpoint_that_is_not_a_candidate_keeps_the_pick() -> None:
    shared = InMemoryPrefixIndex()
    first_handle, second_handle = _handle(shared), _handle(shared, seed=1)
    first, second = _producer(first_handle), _producer(second_handle)
    pods_first = _fresh(_endpoints(first_handle, "a", "b"))
    pods_second = _fresh(_endpoints(second_handle, "b", "c"))  # "a" is not a candidate
    one, two = _request(), _request()
    await first.prepare_request_data(one, pods_first)
    await second.prepare_request_data(two, pods_second)
    assert await first.claim_placement(one, _result(pods_first[0])) is None
    assert await second.claim_placement(two, _result(pods_second[1])) is None
    await second.pre_request(two, _result(pods_second[1]))
    assert shared.match_sync(shared_chain(first, one)) == {"a": 10, "c": 10}


async def test_a_held_prefix_claims_nothing() -> None:
    handle = _handle()
    producer = _producer(handle)
    pods = _endpoints(handle, "a", "b")
    await _route(producer, pods, _request())  # "a" holds it
    request = _request()
    snapshot = _fresh(pods)
    await producer.prepare_request_data(request, snapshot)
    assert await producer.claim_placement(request, _result(snapshot[1])) is None
    await producer.pre_request(request, _result(snapshot[1]))
    assert handle.prefix_index.size() == 20  # both hold it now: the pick was kept


def shared_chain(producer: ApproxPrefixCacheProducer, request: InferenceRequest) -> list[int]:
    hashes = request.state.get(producer.typed_name.name, prefix_producer.BLOCK_HASHES)
    assert hashes
    return hashes


async def test_a_shared_prefix_matches_partially() -> None:
    handle = _handle()
    producer = _producer(handle)
    pods = _endpoints(handle, "a", "b")
    await _route(producer, pods, _request())
    shared = PROMPT[: 4 * BLOCK_CHARS] + "Z" * (6 * BLOCK_CHARS + 10)  # 4 blocks shared, 11 total
    snapshot = _fresh(pods)
    await producer.prepare_request_data(_request(shared), snapshot)
    assert _infos(snapshot) == {
        "a": PrefixCacheMatchInfo(4, 11, 16),
        "b": PrefixCacheMatchInfo(0, 11, 16),
    }


async def test_chat_requests_match_on_their_messages() -> None:
    handle = _handle()
    producer = _producer(handle)
    pods = _endpoints(handle, "a", "b")
    system = {"role": "system", "content": "You are a careful assistant. " * 20}
    first = inference_request(
        {"model": "m", "messages": [system, {"role": "user", "content": "hi"}]},
        path="/v1/chat/completions",
    )
    await _route(producer, pods, first, chosen=1)
    follow_up = inference_request(
        {"model": "m", "messages": [system, {"role": "user", "content": "something else"}]},
        path="/v1/chat/completions",
        request_id="chat-2",
    )
    snapshot = _fresh(pods)
    await producer.prepare_request_data(follow_up, snapshot)
    info = snapshot[1].attributes[PREFIX_CACHE_MATCH_INFO]
    assert isinstance(info, PrefixCacheMatchInfo)
    assert 0 < info.match_blocks < info.total_blocks
    assert snapshot[0].attributes[PREFIX_CACHE_MATCH_INFO] == PrefixCacheMatchInfo(
        0, info.total_blocks, 16
    )


async def test_the_model_and_cache_salt_separate_prefixes() -> None:
    handle = _handle()
    producer = _producer(handle)
    pods = _endpoints(handle, "a")
    await _route(producer, pods, _request(model="m1"))
    for request in (_request(model="m2"), _request(model="m1", cache_salt="tenant-2")):
        snapshot = _fresh(pods)
        await producer.prepare_request_data(request, snapshot)
        assert _infos(snapshot) == {"a": PrefixCacheMatchInfo(0, 10, 16)}


@pytest.mark.parametrize("prompt", [None, "x", "x" * (BLOCK_CHARS - 1)])
async def test_no_body_or_a_short_prompt_scores_zero_and_indexes_nothing(
    prompt: str | None,
) -> None:
    index = InMemoryPrefixIndex()
    handle = _handle(index)
    producer = _producer(handle)
    pods = _endpoints(handle, "a", "b")
    infos = await _route(producer, pods, _request(prompt))
    assert infos == dict.fromkeys(["a", "b"], PrefixCacheMatchInfo(0, 0, 16))
    assert index.size() == 0


async def test_auto_tune_takes_the_block_size_from_the_first_candidate() -> None:
    handle = _handle()
    producer = _producer(handle)
    pods = _endpoints(handle, "a", cache_block_size=8) + _endpoints(handle, "b")
    infos = await _route(producer, pods, _request())
    assert infos["a"] == PrefixCacheMatchInfo(0, 20, 8)  # 640 chars / (8 x 4)

    fixed = _producer(_handle(), auto_tune=False, block_size_tokens=32)
    assert (await _route(fixed, pods, _request()))["a"] == PrefixCacheMatchInfo(0, 5, 32)


async def test_auto_tune_takes_each_endpoint_capacity_from_its_metrics() -> None:
    index = InMemoryPrefixIndex()
    handle = _handle(index)
    producer = _producer(handle)
    pods = _endpoints(handle, "a", cache_num_blocks=3)
    await _route(producer, pods, _request())
    assert index.size() == 3  # only the newest three of the ten blocks

    index = InMemoryPrefixIndex()
    handle = _handle(index)
    producer = _producer(handle, auto_tune=False, lru_capacity_per_server=4)
    pods = _endpoints(handle, "a", cache_num_blocks=3)
    await _route(producer, pods, _request())
    assert index.size() == 4


async def test_without_metrics_the_configured_capacity_applies() -> None:
    index = InMemoryPrefixIndex()
    handle = _handle(index)
    producer = _producer(handle, lru_capacity_per_server=6)
    await _route(producer, _endpoints(handle, "a"), _request())
    assert index.size() == 6


async def test_the_prefill_endpoint_is_indexed_too() -> None:
    handle = _handle()
    producer = _producer(handle)
    pods = _endpoints(handle, "decoder", "prefiller", "other")
    request = _request()
    snapshot = _fresh(pods)
    await producer.prepare_request_data(request, snapshot)
    await producer.pre_request(request, _result(snapshot[0], prefill=snapshot[1]))
    again = _fresh(pods)
    await producer.prepare_request_data(_request(), again)
    assert _infos(again) == {
        "decoder": PrefixCacheMatchInfo(10, 10, 16),
        "prefiller": PrefixCacheMatchInfo(10, 10, 16),
        "other": PrefixCacheMatchInfo(0, 10, 16),
    }


async def test_block_limits_cut_the_prompt() -> None:
    handle = _handle()
    pods = _endpoints(handle, "a")
    by_blocks = _producer(handle, max_prefix_blocks_to_match=3)
    assert (await _route(by_blocks, pods, _request()))["a"] == PrefixCacheMatchInfo(0, 3, 16)
    by_tokens = _producer(_handle(), max_prefix_blocks_to_match=3, max_prefix_tokens_to_match=80)
    assert (await _route(by_tokens, pods, _request()))["a"] == PrefixCacheMatchInfo(0, 5, 16)


async def test_a_deleted_endpoint_is_removed_from_the_index() -> None:
    index = InMemoryPrefixIndex()
    handle = _handle(index)
    producer = _producer(handle)
    pods = _endpoints(handle, "a", "b")
    await _route(producer, pods, _request(), chosen=0)
    await _route(producer, pods, _request(PROMPT[::-1]), chosen=1)
    assert index.size() == 20
    handle.datastore.apply(EndpointEvent(kind=EndpointEventKind.DELETE, endpoint=pods[0].info))
    assert index.size() == 10
    assert await index.match(await _hashes(producer, _request())) == {}


async def test_an_endpoint_deleted_after_scheduling_is_not_indexed() -> None:
    index = InMemoryPrefixIndex()
    handle = _handle(index)
    producer = _producer(handle)
    pods = _endpoints(handle, "a")
    request = _request()
    snapshot = _fresh(pods)
    await producer.prepare_request_data(request, snapshot)
    handle.datastore.apply(EndpointEvent(kind=EndpointEventKind.DELETE, endpoint=pods[0].info))
    await producer.pre_request(request, _result(snapshot[0]))
    assert index.size() == 0


class _AsyncOnlyIndex:
    """A PrefixIndex with only the async port methods (like a shared, remote one)."""

    def __init__(self) -> None:
        self.inner = InMemoryPrefixIndex()
        self.removed = asyncio.Event()

    async def match(self, hashes: Sequence[int]) -> Mapping[str, int]:
        return await self.inner.match(hashes)

    async def add(self, hashes: Sequence[int], endpoint: str, capacity: int) -> None:
        await self.inner.add(hashes, endpoint, capacity)

    async def remove_endpoint(self, endpoint: str) -> None:
        await self.inner.remove_endpoint(endpoint)
        self.removed.set()

    def size(self) -> int:
        return self.inner.size()


async def test_deletion_reaches_an_async_only_index() -> None:
    index = _AsyncOnlyIndex()
    handle = _handle(index)
    producer = _producer(handle)
    pods = _endpoints(handle, "a")
    await _route(producer, pods, _request())
    assert index.size() == 10
    handle.datastore.apply(EndpointEvent(kind=EndpointEventKind.DELETE, endpoint=pods[0].info))
    await asyncio.wait_for(index.removed.wait(), timeout=2.0)
    assert index.size() == 0


async def test_hit_metrics() -> None:
    handle = _handle()
    handle.observer = observer = RecordingObserver()
    producer = _producer(handle)
    pods = _endpoints(handle, "a", "b")
    await _route(producer, pods, _request())
    await _route(producer, pods, _request())
    await _route(producer, pods, _request(PROMPT[: 4 * BLOCK_CHARS] + "Z" * 64))
    await _route(producer, pods, _request("short"))  # no blocks: not observed
    # Per request, the best match among the candidates: 0 of 10, 10 of 10, 4 of 5 blocks.
    assert observer.observations(PREFIX_INDEXER_HIT_RATIO) == [0, 1, 4 / 5]
    assert observer.observations(PREFIX_INDEXER_HIT_BYTES) == [
        0,
        10 * BLOCK_CHARS,
        4 * BLOCK_CHARS,
    ]


async def _hashes(producer: ApproxPrefixCacheProducer, request: InferenceRequest) -> list[int]:
    await producer.prepare_request_data(request, [])
    hashes = request.state.get("prefix", prefix_producer.BLOCK_HASHES)
    assert hashes
    return hashes


# --- parameters -------------------------------------------------------------------------


def test_parameters_use_the_reference_keys() -> None:
    assert set(parameter_names(PrefixCacheParameters)) == {
        "autoTune",
        "blockSizeTokens",
        "blockSize",
        "maxPrefixBlocksToMatch",
        "maxPrefixTokensToMatch",
        "lruCapacityPerServer",
    }
    assert set(parameter_names(PrefixAffinityFilterParameters)) == {
        "affinityThreshold",
        "explorationProbability",
        "maxTTFTPenaltyMs",
        "maxTokensInFlightPenalty",
        "peakPrefillThroughput",
        "ttftSource",
        "prefixMatchInfoProducerName",
        "inFlightLoadProducerName",
        # ours: load a server reports beyond the EPP's own, and leaving saturated endpoints
        "reportedRequestTokens",
        "excludeSaturated",
        "leaveByReportedQueue",
        "queuedStickyPenaltyMs",
    }


def test_parameter_defaults() -> None:
    params = PrefixCacheParameters()
    assert params.auto_tune is True
    assert params.tokens_per_block == 16
    assert params.max_blocks(16) == 256
    assert params.lru_capacity_per_server == 31250
    assert PrefixCacheParameters(max_prefix_tokens_to_match=1000).max_blocks(16) == 62
    assert PrefixCacheParameters(max_prefix_tokens_to_match=8).max_blocks(16) == 1


@pytest.mark.parametrize(
    ("params", "key"),
    [
        ({"block_size": 64}, "blockSize"),
        ({"block_size": 0, "block_size_tokens": 16}, "blockSize"),
        ({"block_size_tokens": 0}, "blockSizeTokens"),
        ({"block_size_tokens": -4}, "blockSizeTokens"),
        ({"max_prefix_blocks_to_match": 0}, "maxPrefixBlocksToMatch"),
        ({"lru_capacity_per_server": 0}, "lruCapacityPerServer"),
    ],
)
def test_invalid_producer_parameters(params: dict[str, Any], key: str) -> None:
    with pytest.raises(ValueError, match=f"^{key}:"):
        PrefixCacheParameters(**params)


def test_the_deprecated_block_size_is_accepted_with_block_size_tokens() -> None:
    params = PrefixCacheParameters(block_size=64, block_size_tokens=8)
    assert params.tokens_per_block == 8


@pytest.mark.parametrize(
    ("params", "key"),
    [
        ({"affinity_threshold": 1.5}, "affinityThreshold"),
        ({"affinity_threshold": -0.1}, "affinityThreshold"),
        ({"exploration_probability": 2.0}, "explorationProbability"),
        ({"max_TTFT_penalty_ms": -1.0}, "maxTTFTPenaltyMs"),
        ({"max_TTFT_penalty_ms": float("nan")}, "maxTTFTPenaltyMs"),
        ({"peak_prefill_throughput": 0.0}, "peakPrefillThroughput"),
        ({"peak_prefill_throughput": float("inf")}, "peakPrefillThroughput"),
        ({"ttft_source": "queueDepth"}, "ttftSource"),
        ({"ttft_source": "guess"}, "ttftSource"),
    ],
)
def test_invalid_filter_parameters(params: dict[str, Any], key: str) -> None:
    with pytest.raises(ValueError, match=f"^{key}:"):
        PrefixAffinityFilterParameters(**params)


# --- scorer -----------------------------------------------------------------------------


def _with_info(name: str, info: PrefixCacheMatchInfo | None) -> Candidate:
    c = candidate(name)
    if info is not None:
        c.attributes[PREFIX_CACHE_MATCH_INFO] = info
    return c


def test_scorer_scores_the_matched_fraction() -> None:
    params = PrefixCacheParameters(block_size_tokens=5, lru_capacity_per_server=100)
    scorer = _registry().create(prefix_cache_scorer.TYPE, "s", params, _handle())
    assert isinstance(scorer, Scorer)
    assert scorer.category == AFFINITY
    assert list(scorer.consumes()) == [PREFIX_CACHE_MATCH_INFO]  # type: ignore[attr-defined]
    candidates = [
        _with_info("half", PrefixCacheMatchInfo(5, 10, 16)),
        _with_info("full", PrefixCacheMatchInfo(10, 10, 16)),
        _with_info("none", PrefixCacheMatchInfo(0, 10, 16)),
        _with_info("no-blocks", PrefixCacheMatchInfo(0, 0, 16)),
        _with_info("missing", None),
    ]
    request = _request()
    assert list(scorer.score(cycle(request), request, candidates)) == [0.5, 1.0, 0.0, 0.0, 0.0]


def test_scorer_parameters_become_the_producer_parameters() -> None:
    loaded = load_config(
        """
        plugins:
        - type: prefix-cache-scorer
          parameters: {blockSizeTokens: 5, maxPrefixBlocksToMatch: 100}
        """,
        registry=build_registry(),
        handle=_handle(),
    )
    (producer,) = [p for p in loaded.data_producers if p.typed_name.type == prefix_producer.TYPE]
    assert isinstance(producer, prefix_producer.ApproxPrefixCacheProducer)
    assert producer.parameters == PrefixCacheParameters(
        block_size_tokens=5, max_prefix_blocks_to_match=100
    )


async def test_scorer_prefers_the_endpoint_that_was_sent_the_prefix() -> None:
    handle = _handle()
    producer = _producer(handle)
    scorer = _registry().create(prefix_cache_scorer.TYPE, "s", None, handle)
    assert isinstance(scorer, Scorer)
    pods = _endpoints(handle, "a", "b")
    await _route(producer, pods, _request(), chosen=1)
    request = _request()
    snapshot = _fresh(pods)
    await producer.prepare_request_data(request, snapshot)
    assert list(scorer.score(cycle(request), request, snapshot)) == [0.0, 1.0]


# --- affinity filter --------------------------------------------------------------------


def _filter(seed: int = 0, **params: Any) -> Filter:
    """The filter; without the TTFT gate (``maxTTFTPenaltyMs: 0``) unless one is given,
    since these candidates carry no in-flight load."""
    params.setdefault("max_TTFT_penalty_ms", 0.0)
    plugin = _registry().create(
        prefix_affinity_filter.TYPE,
        "f",
        PrefixAffinityFilterParameters(**params),
        _handle(seed=seed),
    )
    assert isinstance(plugin, Filter)
    return plugin


MIXED = [
    _with_info("sticky", PrefixCacheMatchInfo(9, 10, 16)),
    _with_info("edge", PrefixCacheMatchInfo(8, 10, 16)),
    _with_info("weak", PrefixCacheMatchInfo(5, 10, 16)),
    _with_info("missing", None),
]


def _names(candidates: Sequence[Candidate]) -> list[str]:
    return [c.name for c in candidates]


def test_filter_keeps_only_sticky_endpoints() -> None:
    request = _request()
    kept = _filter(exploration_probability=0.0).filter(cycle(request), request, MIXED)
    assert _names(kept) == ["sticky", "edge"]
    assert _names(MIXED) == ["sticky", "edge", "weak", "missing"]  # input untouched
    assert list(_filter().consumes()) == [  # type: ignore[attr-defined]
        PREFIX_CACHE_MATCH_INFO,
        IN_FLIGHT_LOAD,
    ]


def test_filter_threshold_is_configurable() -> None:
    request = _request()
    kept = _filter(affinity_threshold=0.5, exploration_probability=0.0).filter(
        cycle(request), request, MIXED
    )
    assert _names(kept) == ["sticky", "edge", "weak"]


def test_filter_keeps_everyone_when_nobody_is_sticky() -> None:
    request = _request()
    weak = MIXED[2:]
    assert _names(_filter(exploration_probability=0.0).filter(cycle(request), request, weak)) == [
        "weak",
        "missing",
    ]


def test_filter_explores_with_the_configured_probability() -> None:
    request = _request()
    always = _filter(exploration_probability=1.0)
    assert _names(always.filter(cycle(request), request, MIXED)) == _names(MIXED)

    seed, p = 11, 0.3
    explorer = _filter(seed=seed, exploration_probability=p)
    draws = random.Random(seed)
    outcomes = []
    for _ in range(200):
        expected = _names(MIXED) if draws.random() < p else ["sticky", "edge"]
        got = _names(explorer.filter(cycle(request), request, MIXED))
        assert got == expected
        outcomes.append(len(got) == len(MIXED))
    assert 30 < sum(outcomes) < 90  # about 30% of 200


async def test_new_prefixes_placed_at_once_by_two_processes_spread_over_near_endpoints() -> None:
    """Each process picked "a" for its new prefix, "b" passing the filters with an in-flight
    load at most ``NEAR_PROMPTS`` such prompts above: the second claim goes to "b", the
    endpoint fewer new prefixes went to lately. "c", above that, is never chosen."""
    store = InMemoryPrefixIndex()  # the store both processes share, behind its domain wrapper
    shared = ResilientPrefixIndex(store)
    first_handle, second_handle = _handle(shared), _handle(shared, seed=1)
    first, second = _producer(first_handle), _producer(second_handle)
    margin = prefix_producer.NEAR_PROMPTS * 10 * 16  # prompts of 10 blocks of 16 tokens

    def scheduled(pods: Sequence[Candidate], *loads: int) -> SchedulingResult:
        for pod, tokens in zip(pods, loads, strict=True):
            pod.attributes[IN_FLIGHT_LOAD] = InFlightLoad(requests=1, tokens=tokens)
        run = ProfileRunResult((pods[0],), alternates=tuple(pods[1:]))
        return SchedulingResult(profile_results={"decode": run}, primary_profile_name="decode")

    requests = [_request(), _request("z" + PROMPT[1:]), _request("y" + PROMPT[1:])]
    handles = [first_handle, second_handle, second_handle]
    producers = [first, second, second]
    pods = [_fresh(_endpoints(h, "a", "b", "c")) for h in handles]
    for producer, request, snapshot in zip(producers, requests, pods, strict=True):
        await producer.prepare_request_data(request, snapshot)  # all new prefixes
    near, far = 100 + margin, 100 + margin + 1
    assert await first.claim_placement(requests[0], scheduled(pods[0], 100, near, far)) is None
    moved = await second.claim_placement(requests[1], scheduled(pods[1], 100, near, far))
    assert moved is pods[1][1]
    assert store.match_sync(shared_chain(second, requests[1])) == {"b": 10}
    # "c" had no new prefix lately but is too far above the pick: the pick stands.
    result = scheduled(pods[2], 100, far, far)
    assert await second.claim_placement(requests[2], result) is None


async def test_one_process_with_its_own_index_keeps_its_pick_for_a_new_prefix() -> None:
    """Its load is exact and nothing decides beside it: no alternates, the pick stands."""
    handle = _handle()
    producer = _producer(handle)
    pods = _fresh(_endpoints(handle, "a", "b"))
    for request in (_request(), _request("z" + PROMPT[1:])):
        snapshot = _fresh(pods)
        await producer.prepare_request_data(request, snapshot)
        for pod in snapshot:
            pod.attributes[IN_FLIGHT_LOAD] = InFlightLoad(requests=1, tokens=100)
        run = ProfileRunResult((snapshot[0],), alternates=(snapshot[1],))
        result = SchedulingResult(profile_results={"decode": run}, primary_profile_name="decode")
        assert await producer.claim_placement(request, result) is None  # "a" both times
