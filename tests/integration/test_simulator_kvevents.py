"""The simulator publishes vLLM's KV-cache events on ZMQ: stored, removed, cleared, replay."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec
import pytest
import zmq
import zmq.asyncio

from tests.simulator import ModelServerSimulator, SimulatorConfig
from tests.simulator.kvcache import block_hashes
from tests.simulator.kvevents import END_OF_REPLAY, external_hash
from tests.simulator.tokens import PromptTokens

BLOCK = 16
CHARS_PER_BLOCK = BLOCK * 4


@pytest.fixture
async def sim() -> AsyncIterator[ModelServerSimulator]:
    config = SimulatorConfig(kv_events=True, block_size=BLOCK, num_gpu_blocks=8)
    async with ModelServerSimulator(config, host="127.0.0.5", port=0) as server:
        yield server


class Subscriber:
    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str) -> None:
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)

    async def next(self) -> tuple[bytes, int, list[Any]]:
        topic, seq, payload = await asyncio.wait_for(self.sock.recv_multipart(), 5)
        return topic, int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload)


async def connected(sim: ModelServerSimulator, sub: Subscriber) -> int:
    """Publish empty batches until one arrives (a SUB misses what precedes its connection)."""
    publisher = sim.kv_events
    assert publisher is not None
    deadline = asyncio.get_running_loop().time() + 5
    while True:
        seq = publisher.publish([])
        try:
            _, got, _ = await asyncio.wait_for(sub.next(), 0.05)
        except TimeoutError:
            assert asyncio.get_running_loop().time() < deadline, "the SUB never connected"
            continue
        # drain the other probes
        while got < seq:
            _, got, _ = await sub.next()
        return seq


async def complete(url: str, prompt: str) -> None:
    async with aiohttp.ClientSession() as session:
        body = {"model": SimulatorConfig().model_name, "prompt": prompt, "max_tokens": 1}
        async with session.post(f"{url}/v1/completions", json=body) as response:
            assert response.status == 200, await response.text()


async def test_stored_removed_cleared_and_replay(sim: ModelServerSimulator) -> None:
    publisher = sim.kv_events
    assert publisher is not None
    ctx = zmq.asyncio.Context()
    sub = Subscriber(ctx, publisher.endpoint)
    try:
        last = await connected(sim, sub)
        prompt = "".join(chr(ord("a") + i) * CHARS_PER_BLOCK for i in range(4))
        await complete(sim.url, prompt)
        topic, seq, batch = await sub.next()
        assert topic == f"kv@127.0.0.5@{sim.config.model_name}".encode()
        assert seq == last + 1
        ts, events, rank = batch
        assert isinstance(ts, float)
        assert rank == 0
        [stored] = events
        expected = [
            external_hash(h)
            for h in block_hashes(
                sim.config.model_name, PromptTokens.from_text(prompt).full_blocks(BLOCK)
            )
        ]
        assert stored[0] == "BlockStored"
        assert stored[1] == expected
        assert stored[2] is None  # parent: a first block
        assert len(stored[3]) == 4 * BLOCK  # token ids
        assert stored[4:7] == [BLOCK, None, "GPU"]

        # a different 6-block prompt in an 8-block cache evicts the least recently freed
        other = "".join(chr(ord("k") + i) * CHARS_PER_BLOCK for i in range(6))
        await complete(sim.url, other)
        _, seq2, (_, events2, _) = await sub.next()
        assert seq2 == seq + 1
        kinds = [event[0] for event in events2]
        assert kinds == ["BlockRemoved", "BlockStored"]
        removed = events2[0]
        assert set(removed[1]) <= set(expected)
        assert removed[1]
        assert removed[2] == "GPU"

        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{sim.url}/reset_prefix_cache") as response,
        ):
            assert response.status == 200
        _, seq3, (_, events3, _) = await sub.next()
        assert seq3 == seq2 + 1
        assert events3 == [["AllBlocksCleared"]]

        # the replay socket returns the buffered batches from a sequence number on
        assert publisher.replay_endpoint is not None
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(publisher.replay_endpoint)
        await dealer.send_multipart((b"", seq.to_bytes(8, "big")))
        replayed: list[int] = []
        while True:
            _, seq_bytes, payload = await asyncio.wait_for(dealer.recv_multipart(), 5)
            if seq_bytes == END_OF_REPLAY:
                assert payload == b""
                break
            replayed.append(int.from_bytes(seq_bytes, "big"))
        assert replayed == [seq, seq2, seq3]
        dealer.close()
    finally:
        sub.sock.close()
        ctx.term()
