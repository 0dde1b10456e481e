"""The EPP computes the same block keys as the server's events, for the same prompt or
chat conversation."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from pathlib import Path

import aiohttp
import pytest

from adapters.chattemplate import JinjaChatTemplate
from adapters.hftokenizers import HFTokenizer
from adapters.kvevents import KVEventSubscriptions
from adapters.xxhash import xxh3_128
from domain.datalayer.attributes import PREFIX_CACHE_MATCH_INFO, PrefixCacheMatchInfo
from domain.plugins.base import TypedName
from domain.prefixcache.engine_hash import EngineBlockHasher
from domain.prefixcache.kv_block_index import InMemoryKVBlockIndex
from domain.prefixcache.precise import LoraAdapterNames, PromptKeyer
from domain.requestcontrol.plugins.precise_prefix_producer import (
    TYPE,
    PrecisePrefixCacheParameters,
    PrecisePrefixCacheProducer,
    TokenProcessorConfig,
)
from ports.kv_events import BlockStored, KVEvent
from ports.tokenizer import TokenizerError
from tests.simulator import ModelServerSimulator, SimulatorConfig
from tests.support.scheduling import candidate, inference_request
from tests.support.tokenizer import write_tokenizer_json

BLOCK = 4
PROMPT = (
    "You are a helpful assistant. Summarize the following document about prefix caching "
    "and KV-cache events: routing decisions depend on which server holds the blocks."
)


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer_json(tmp_path_factory.mktemp("tok") / "tokenizer.json")


class Recorder(InMemoryKVBlockIndex):
    def __init__(self) -> None:
        super().__init__()
        self.stored: list[int] = []

    def apply(self, endpoint: str, events: object) -> None:
        assert isinstance(events, tuple)
        batch: tuple[KVEvent, ...] = events
        for event in batch:
            if isinstance(event, BlockStored):
                self.stored.extend(event.block_hashes)
        super().apply(endpoint, batch)


async def _stored_keys(
    config: SimulatorConfig,
    path: str,
    body: dict[str, object],
    count: int,
    adapters: LoraAdapterNames | None = None,
) -> tuple[list[int], Recorder]:
    """The block keys the simulator's events report after it served ``body`` (at least
    ``count``), and the index they fed (``adapters`` learning from them on the way)."""
    index = Recorder()
    async with ModelServerSimulator(config, name="s", host="127.0.0.8", port=0) as sim:
        publisher = sim.kv_events
        assert publisher is not None
        sink = index if adapters is None else adapters.watching(index)
        subscriptions = KVEventSubscriptions(sink=sink)
        subscriptions.add_address("s", publisher.endpoint, publisher.replay_endpoint)
        subscriber = subscriptions.subscriber("s")
        assert subscriber is not None
        try:
            deadline = time.monotonic() + 5
            while subscriber.batches == 0:
                assert time.monotonic() < deadline, "the subscriber never connected"
                publisher.publish([])
                await asyncio.sleep(0.02)
            async with (
                aiohttp.ClientSession() as session,
                session.post(f"{sim.url}{path}", json=body) as response,
            ):
                assert response.status == 200, await response.text()
            deadline = time.monotonic() + 5
            while len(index.stored) < count:
                assert time.monotonic() < deadline, "no stored event"
                await asyncio.sleep(0.01)
        finally:
            await subscriptions.close()
    return index.stored, index


def _sim_config(tokenizer_json: Path, algorithm: str = "sha256") -> SimulatorConfig:
    return SimulatorConfig(
        kv_events=True,
        block_size=BLOCK,
        num_gpu_blocks=256,
        tokenizer_path=str(tokenizer_json),
        prefix_caching_hash_algo=algorithm,
        hash_seed="42",
    )


@pytest.mark.parametrize("algorithm", ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"])
async def test_epp_keys_equal_the_servers_event_keys(tokenizer_json: Path, algorithm: str) -> None:
    config = _sim_config(tokenizer_json, algorithm)
    keyer = PromptKeyer(
        HFTokenizer.from_file(tokenizer_json),
        EngineBlockHasher(algorithm=algorithm, seed="42", xxh3_128=xxh3_128),
        block_size=BLOCK,
    )
    expected = keyer.keys(PROMPT)
    assert len(expected) >= 5
    body = {"model": config.model_name, "prompt": PROMPT, "max_tokens": 1}
    stored, index = await _stored_keys(config, "/v1/completions", body, len(expected))
    assert stored[: len(expected)] == expected
    assert index.match(expected, ["s"]) == {"s": len(expected)}
    # a LoRA adapter's name is an extra key: other keys
    assert set(keyer.keys(PROMPT, lora_name="ad")).isdisjoint(expected)


async def test_a_lora_requests_keys_equal_the_servers_event_keys(tokenizer_json: Path) -> None:
    """The server's events name the adapter; the producer learns it from them and keys the
    adapter's requests with its name, as the server hashed their blocks."""
    config = replace(_sim_config(tokenizer_json), lora_adapters=("sql",))
    tokens = TokenProcessorConfig(
        block_size_tokens=BLOCK, hash_seed="42", tokenizer_path=str(tokenizer_json)
    )
    keyer = PromptKeyer(
        HFTokenizer.from_file(tokenizer_json), EngineBlockHasher(seed="42"), block_size=BLOCK
    )
    adapters = LoraAdapterNames()
    body: dict[str, object] = {"model": "sql", "prompt": PROMPT, "max_tokens": 1}
    count = len(keyer.keys(PROMPT))
    stored, index = await _stored_keys(config, "/v1/completions", body, count, adapters)
    assert "sql" in adapters
    producer = PrecisePrefixCacheProducer(
        TypedName(TYPE, TYPE),
        PrecisePrefixCacheParameters(token_processor_config=tokens),
        keyer=keyer,
        index=index,
        adapters=adapters,
    )
    cands = [candidate("s")]
    await producer.prepare_request_data(inference_request(body), cands)
    assert cands[0].attributes[PREFIX_CACHE_MATCH_INFO] == PrefixCacheMatchInfo(count, count, BLOCK)
    assert stored[:count] == keyer.keys(PROMPT, lora_name="sql")
    # the base model's request does not match the adapter's blocks
    base = [candidate("s")]
    await producer.prepare_request_data(
        inference_request({**body, "model": config.model_name}), base
    )
    assert base[0].attributes[PREFIX_CACHE_MATCH_INFO] == PrefixCacheMatchInfo(0, count, BLOCK)


@pytest.mark.parametrize("thinking", [None, False])
async def test_a_chat_requests_keys_equal_the_servers_event_keys(
    tokenizer_json: Path, thinking: bool | None
) -> None:
    """The producer renders the messages with the model's chat template, as the server
    does, and its keys are those of the server's stored blocks."""
    config = _sim_config(tokenizer_json)
    tokens = TokenProcessorConfig(
        block_size_tokens=BLOCK, hash_seed="42", tokenizer_path=str(tokenizer_json)
    )
    keyer = PromptKeyer(
        HFTokenizer.from_file(tokenizer_json),
        EngineBlockHasher(seed="42"),
        block_size=BLOCK,
        chat=JinjaChatTemplate.load(tokenizer_json),
    )
    producer = PrecisePrefixCacheProducer(
        TypedName(TYPE, TYPE),
        PrecisePrefixCacheParameters(token_processor_config=tokens),
        keyer=keyer,
        index=InMemoryKVBlockIndex(),
    )
    body: dict[str, object] = {
        "model": config.model_name,
        "max_tokens": 1,
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": PROMPT},
        ],
    }
    if thinking is not None:
        body["chat_template_kwargs"] = {"enable_thinking": thinking}
    cands = [candidate("s")]
    request = inference_request(body, path="/v1/chat/completions")
    await producer.prepare_request_data(request, cands)
    info = cands[0].attributes[PREFIX_CACHE_MATCH_INFO]
    assert isinstance(info, PrefixCacheMatchInfo)
    assert info.total_blocks >= 10
    stored, index = await _stored_keys(config, "/v1/chat/completions", body, info.total_blocks)
    # the index those events fed credits the server with every block of the request
    producer.index = index
    await producer.prepare_request_data(request, cands)
    assert cands[0].attributes[PREFIX_CACHE_MATCH_INFO] == PrefixCacheMatchInfo(
        info.total_blocks, info.total_blocks, BLOCK
    )
    # not the keys of the messages' text as a completions prompt
    assert set(keyer.keys(PROMPT)).isdisjoint(stored)


def test_tokenization_is_cached_per_prompt(tokenizer_json: Path) -> None:
    keyer = PromptKeyer(
        HFTokenizer.from_file(tokenizer_json), EngineBlockHasher(seed="0"), block_size=BLOCK
    )
    first = keyer.keys(PROMPT)
    assert keyer.keys(PROMPT) == first
    assert (keyer.hits, keyer.misses) == (1, 1)


def test_a_missing_tokenizer_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "tokenizer.json"
    with pytest.raises(TokenizerError, match=str(missing)):
        HFTokenizer.from_file(missing)
    broken = tmp_path / "tokenizer.json"
    broken.write_text("{not json")
    with pytest.raises(TokenizerError, match=str(broken)):
        HFTokenizer.from_file(tmp_path)
