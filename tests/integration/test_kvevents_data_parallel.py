"""Data-parallel engines: each has its own KV cache and its own event stream.

The simulator's publishers stand in for the engines (DP ranks) of one model server: engine
``r`` publishes on the base port plus ``r`` and stamps its batches with its rank, as vLLM
does. A block one engine stored is not in another engine's cache: the EPP indexes each
engine on its own, credits an endpoint with its best engine's match and pins the request
to that engine (``x-data-parallel-rank``); an endpoint per engine (``<pod>-rank-<i>``)
follows its own engine's publisher.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Callable, Sequence

import pytest

from adapters.kvevents import KVEventSubscriptions
from domain.datalayer.attributes import PREFIX_CACHE_MATCH_INFO, PrefixCacheMatchInfo
from domain.plugins.base import TypedName
from domain.prefixcache.engine_hash import EngineBlockHasher
from domain.prefixcache.kv_block_index import InMemoryKVBlockIndex
from domain.prefixcache.precise import PromptKeyer
from domain.requestcontrol.plugins.precise_prefix_producer import (
    TYPE,
    KVEventsConfig,
    PrecisePrefixCacheParameters,
    PrecisePrefixCacheProducer,
    TokenProcessorConfig,
)
from domain.scheduling.types import ProfileRunResult, SchedulingResult
from ports.endpoints import EndpointAddress, EndpointInfo
from ports.kv_events import DATA_PARALLEL_RANK_HEADER, rank_key
from tests.simulator.kvevents import AllBlocksCleared, BlockRemoved, BlockStored, KVEventPublisher
from tests.support.scheduling import candidate, inference_request

IP = "127.0.0.61"
BLOCK = 4
PROMPT = "abcdefghijklmn"  # 3 full blocks


class CharTokenizer:
    def encode(self, text: str, *, add_special_tokens: bool = True) -> Sequence[int]:
        return [ord(c) for c in text]


def _two_free_ports() -> int:
    """A port ``p`` with ``p + 1`` free too, on ``IP``."""
    for _ in range(50):
        with socket.socket() as first:
            first.bind((IP, 0))
            port = int(first.getsockname()[1])
            with socket.socket() as second:
                try:
                    second.bind((IP, port + 1))
                except OSError:
                    continue
        return port
    raise AssertionError("no two consecutive free ports")


async def until(condition: Callable[[], object], what: str, poke: Callable[[], object]) -> None:
    deadline = time.monotonic() + 5
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        poke()  # a SUB socket misses what was published before it connected: publish again
        await asyncio.sleep(0.02)


def stored(keys: Sequence[int]) -> BlockStored:
    return BlockStored(
        block_hashes=list(keys),
        parent_block_hash=None,
        token_ids=[],
        block_size=BLOCK,
        lora_id=None,
        medium=None,
        lora_name=None,
    )


@pytest.fixture
async def engines() -> AsyncIterator[tuple[int, list[KVEventPublisher]]]:
    port = _two_free_ports()
    publishers = [
        KVEventPublisher(endpoint=f"tcp://{IP}:{port + rank}", data_parallel_rank=rank)
        for rank in (0, 1)
    ]
    for publisher in publishers:
        publisher.start()
    try:
        yield port, publishers
    finally:
        for publisher in publishers:
            await publisher.stop()


async def test_engines_behind_one_port_are_indexed_apart_and_the_best_is_pinned(
    engines: tuple[int, list[KVEventPublisher]],
) -> None:
    port, (rank0, rank1) = engines
    index = InMemoryKVBlockIndex()
    params = PrecisePrefixCacheParameters(
        token_processor_config=TokenProcessorConfig(
            block_size_tokens=BLOCK, hash_seed="1", tokenizer_path="unused"
        ),
        kv_events_config=KVEventsConfig(socket_port=port, data_parallel_size=2),
    )
    keyer = PromptKeyer(CharTokenizer(), EngineBlockHasher(seed="1"), block_size=BLOCK)
    producer = PrecisePrefixCacheProducer(TypedName(TYPE, TYPE), params, keyer=keyer, index=index)
    subscriptions = KVEventSubscriptions(sink=index, port=port, data_parallel_size=2)
    subscriptions.add(EndpointInfo(name="pod-a", address=EndpointAddress(ip=IP, port=8000)))
    keys = keyer.keys(PROMPT)
    assert len(keys) == 3

    async def route() -> tuple[PrefixCacheMatchInfo, list[tuple[str, str]] | None]:
        cands = [candidate("pod-a"), candidate("pod-b")]
        request = inference_request({"model": "m", "prompt": PROMPT})
        await producer.prepare_request_data(request, cands)
        result = SchedulingResult(
            profile_results={"default": ProfileRunResult((cands[0],))},
            primary_profile_name="default",
        )
        await producer.pre_request(request, result)
        info = cands[0].attributes[PREFIX_CACHE_MATCH_INFO]
        assert isinstance(info, PrefixCacheMatchInfo)
        return info, request.upstream_headers

    def engine_holds(rank: int, blocks: int) -> Callable[[], bool]:
        key = rank_key("pod-a", rank)
        return lambda: index.match(keys, [key]).get(key, 0) == blocks

    try:
        # engine 1 holds the whole prompt, engine 0 its first block
        await until(engine_holds(1, 3), "engine 1's blocks", lambda: rank1.publish([stored(keys)]))
        await until(
            engine_holds(0, 1), "engine 0's block", lambda: rank0.publish([stored(keys[:1])])
        )
        assert await route() == (
            PrefixCacheMatchInfo(3, 3, BLOCK),
            [(DATA_PARALLEL_RANK_HEADER, "1")],
        )
        # engine 1 evicts the last block: its 2 still beat engine 0's 1
        rank1.publish([BlockRemoved(block_hashes=[keys[2]], medium=None)])
        await until(engine_holds(1, 2), "the removal", lambda: None)
        assert await route() == (
            PrefixCacheMatchInfo(2, 3, BLOCK),
            [(DATA_PARALLEL_RANK_HEADER, "1")],
        )
        # engine 1 is reset: engine 0 is the best now; engine 0's own blocks never moved
        rank1.publish([AllBlocksCleared()])
        await until(engine_holds(1, 0), "the reset", lambda: None)
        assert await route() == (
            PrefixCacheMatchInfo(1, 3, BLOCK),
            [(DATA_PARALLEL_RANK_HEADER, "0")],
        )
        # an endpoint leaving the pool takes every engine with it
        subscriptions.remove("pod-a")
        assert index.size() == 0
        # no engine holds anything: no pin, the server balances its engines
        assert await route() == (PrefixCacheMatchInfo(0, 3, BLOCK), None)
    finally:
        await subscriptions.close()


async def test_an_endpoint_per_engine_follows_its_own_engines_publisher(
    engines: tuple[int, list[KVEventPublisher]],
) -> None:
    port, (rank0, rank1) = engines
    index = InMemoryKVBlockIndex()
    subscriptions = KVEventSubscriptions(sink=index, port=port)
    for rank in (0, 1):
        subscriptions.add(
            EndpointInfo(
                name=f"pod-a-rank-{rank}",
                address=EndpointAddress(ip=IP, port=8000 + rank),
                rank=rank,
            )
        )
    names = ["pod-a-rank-0", "pod-a-rank-1"]
    try:
        await until(
            lambda: index.match([7], names) == {"pod-a-rank-1": 1},
            "engine 1's block",
            lambda: rank1.publish([stored([7])]),
        )
        await until(
            lambda: index.match([9], names) == {"pod-a-rank-0": 1},
            "engine 0's block",
            lambda: rank0.publish([stored([9])]),
        )
        assert index.match([7], names) == {"pod-a-rank-1": 1}  # not on engine 0
    finally:
        await subscriptions.close()
