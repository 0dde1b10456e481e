"""The KV-event adapter against the simulator's real ZMQ publisher on loopback."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import aiohttp
import msgspec
import pytest
import zmq
import zmq.asyncio

from adapters.kvevents import KVEventSubscriber, KVEventSubscriptions, SubscriberConfig
from domain.prefixcache.kv_block_index import InMemoryKVBlockIndex
from ports.metric_catalogue import KV_EVENTS_ERRORS
from tests.fakes.observer import RecordingObserver
from tests.simulator import ModelServerSimulator, SimulatorConfig
from tests.simulator.kvcache import block_hashes
from tests.simulator.kvevents import KVEventPublisher, external_hash
from tests.simulator.tokens import PromptTokens

BLOCK = 16
ENDPOINT = "sim-0"


async def until(condition: Callable[[], object], what: str, within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def prompt(tag: str, blocks: int) -> str:
    return "".join(f"{tag}{i:03d}".ljust(BLOCK * 4, "x") for i in range(blocks))


def keys(text: str, model: str) -> list[int]:
    chain = block_hashes(model, PromptTokens.from_text(text).full_blocks(BLOCK))
    return [external_hash(h) for h in chain]


@pytest.fixture
async def sim() -> AsyncIterator[ModelServerSimulator]:
    config = SimulatorConfig(kv_events=True, block_size=BLOCK, num_gpu_blocks=64)
    async with ModelServerSimulator(config, name=ENDPOINT, host="127.0.0.6", port=0) as server:
        yield server


@pytest.fixture
async def followed(
    sim: ModelServerSimulator,
) -> AsyncIterator[tuple[InMemoryKVBlockIndex, KVEventSubscriber]]:
    index = InMemoryKVBlockIndex()
    subscriptions = KVEventSubscriptions(sink=index, config=SubscriberConfig(replay_timeout=2))
    publisher = sim.kv_events
    assert publisher is not None
    subscriptions.add_address(ENDPOINT, publisher.endpoint, publisher.replay_endpoint)
    subscriber = subscriptions.subscriber(ENDPOINT)
    assert subscriber is not None
    # a SUB socket misses what is published before it connects: probe until one arrives
    deadline = time.monotonic() + 5
    while subscriber.batches == 0:
        assert time.monotonic() < deadline, "the subscriber never connected"
        publisher.publish([])
        await asyncio.sleep(0.02)
    try:
        yield index, subscriber
    finally:
        await subscriptions.close()


async def complete(sim: ModelServerSimulator, text: str) -> None:
    async with aiohttp.ClientSession() as session:
        body = {"model": sim.config.model_name, "prompt": text, "max_tokens": 1}
        async with session.post(f"{sim.url}/v1/completions", json=body) as response:
            assert response.status == 200, await response.text()


async def test_index_follows_stored_evicted_and_cleared(
    sim: ModelServerSimulator, followed: tuple[InMemoryKVBlockIndex, KVEventSubscriber]
) -> None:
    index, _ = followed
    model = sim.config.model_name
    first = keys(prompt("a", 4), model)
    await complete(sim, prompt("a", 4))
    await until(lambda: index.match(first, [ENDPOINT]) == {ENDPOINT: 4}, "the stored blocks")
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{sim.url}/reset_prefix_cache") as response,
    ):
        assert response.status == 200
    await until(lambda: index.size() == 0, "the cleared cache")


async def test_gap_is_replayed(
    sim: ModelServerSimulator, followed: tuple[InMemoryKVBlockIndex, KVEventSubscriber]
) -> None:
    index, subscriber = followed
    publisher = sim.kv_events
    assert publisher is not None
    model = sim.config.model_name
    publisher.drop_next(1)  # the next batch never reaches the SUB, but stays replayable
    await complete(sim, prompt("b", 3))
    await complete(sim, prompt("c", 2))
    both = keys(prompt("b", 3), model), keys(prompt("c", 2), model)
    await until(
        lambda: all(index.match(k, [ENDPOINT]) == {ENDPOINT: len(k)} for k in both),
        "the replayed and the later blocks",
    )
    assert (subscriber.gaps, subscriber.replays, subscriber.resets) == (1, 1, 0)
    assert index.trusted(ENDPOINT)


async def test_gap_without_replay_drops_what_was_known(
    sim: ModelServerSimulator, followed: tuple[InMemoryKVBlockIndex, KVEventSubscriber]
) -> None:
    index, subscriber = followed
    publisher = sim.kv_events
    assert publisher is not None
    model = sim.config.model_name
    await complete(sim, prompt("d", 2))
    await until(lambda: index.size() == 2, "the first blocks")
    publisher.drop_next(1, replayable=False)
    await complete(sim, prompt("e", 2))
    await complete(sim, prompt("f", 2))
    later = keys(prompt("f", 2), model)
    await until(lambda: index.match(later, [ENDPOINT]) == {ENDPOINT: 2}, "the later blocks")
    # what preceded the gap is forgotten: never claim a block the server may have dropped
    assert index.match(keys(prompt("d", 2), model), [ENDPOINT]) == {}
    assert (subscriber.gaps, subscriber.resets) == (1, 1)


async def test_lost_publisher_is_distrusted_then_followed_after_restart() -> None:
    index = InMemoryKVBlockIndex()
    publisher = KVEventPublisher(endpoint="tcp://127.0.0.7:*", block_size=BLOCK)
    publisher.start()
    address = publisher.endpoint
    config = SubscriberConfig(reconnect_interval=0.02)
    subscriptions = KVEventSubscriptions(sink=index, config=config)
    subscriptions.add_address(ENDPOINT, address, None)
    old, new = b"\x01" * 32, b"\x02" * 32
    old_key, new_key = external_hash(old), external_hash(new)

    def arrived(block: bytes, key: int) -> Callable[[], bool]:
        def check() -> bool:
            if index.match([key], [ENDPOINT]):
                return True
            publisher.stored(block, None, [1] * BLOCK)  # resend until the SUB is connected
            return False

        return check

    try:
        await until(arrived(old, old_key), "the stored block")
        await publisher.stop()
        await until(lambda: not index.trusted(ENDPOINT), "the lost connection")
        assert index.match([old_key], [ENDPOINT]) == {}
        # a restarted engine: numbering from 0, its cache empty
        publisher = KVEventPublisher(endpoint=address, block_size=BLOCK)
        publisher.start()
        await until(arrived(new, new_key), "the restarted publisher's blocks")
        assert index.match([old_key], [ENDPOINT]) == {}
        assert index.trusted(ENDPOINT)
    finally:
        await subscriptions.close()
        await publisher.stop()


async def test_a_restarted_publisher_whose_numbering_continues_ours_is_not_trusted_blindly() -> (
    None
):
    """The restarted engine's first batch is lost while the subscriber reconnects, so the
    first one it receives carries the number the old stream would have sent next."""
    index = InMemoryKVBlockIndex()
    publisher = KVEventPublisher(endpoint="tcp://127.0.0.7:*", block_size=BLOCK)
    publisher.start()
    address = publisher.endpoint
    subscriptions = KVEventSubscriptions(
        sink=index, config=SubscriberConfig(reconnect_interval=0.02)
    )
    subscriptions.add_address(ENDPOINT, address, None)
    old, new = b"\x01" * 32, b"\x02" * 32
    old_key, new_key = external_hash(old), external_hash(new)
    try:

        def old_arrived() -> bool:
            if index.match([old_key], [ENDPOINT]):
                return True
            publisher.stored(old, None, [1] * BLOCK)  # resend until the SUB is connected
            return False

        await until(old_arrived, "the stored block")
        subscriber = subscriptions.subscriber(ENDPOINT)
        assert subscriber is not None
        received = subscriber.batches
        publisher.stored(old, None, [1] * BLOCK)  # connected now: the last one it receives
        await until(lambda: subscriber.batches == received + 1, "the last old batch")
        expected = publisher.next_sequence  # the number the old stream would send next
        await publisher.stop()
        await until(lambda: not index.trusted(ENDPOINT), "the lost connection")
        publisher = KVEventPublisher(endpoint=address, block_size=BLOCK)
        publisher.start()
        publisher.drop_next(expected, replayable=False)  # its first batches never arrive
        for _ in range(expected):
            publisher.stored(b"\x03" * 32, None, [1] * BLOCK)

        def new_arrived() -> bool:
            if index.match([new_key], [ENDPOINT]):
                return True
            publisher.stored(new, None, [1] * BLOCK)
            return False

        await until(new_arrived, "the restarted publisher's block")
        assert index.match([old_key], [ENDPOINT]) == {}  # before: the old block, trusted
        assert index.trusted(ENDPOINT)
    finally:
        await subscriptions.close()
        await publisher.stop()


async def test_garbage_from_a_publisher_is_counted_and_never_trusted() -> None:
    index = InMemoryKVBlockIndex()
    observer = RecordingObserver()
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind("tcp://127.0.0.9:*")
    address = pub.getsockopt_string(zmq.LAST_ENDPOINT)
    subscriptions = KVEventSubscriptions(sink=index, observer=observer)
    subscriptions.add_address(ENDPOINT, str(address), None)
    subscriber = subscriptions.subscriber(ENDPOINT)
    assert subscriber is not None
    seq = 0

    async def send(*frames: bytes) -> None:
        await pub.send_multipart(frames)

    def batch(*events: object) -> bytes:
        return msgspec.msgpack.encode([1.0, list(events), 0])

    try:
        # until connected: valid stored events
        def stored() -> bool:
            nonlocal seq
            if index.match([1], [ENDPOINT]):
                return True
            pub.send_multipart(
                (b"kv", seq.to_bytes(8, "big"), batch(["BlockStored", [1], None, [], 16]))
            )
            seq += 1
            return False

        await until(stored, "the first block")
        await send(b"kv", seq.to_bytes(8, "big"), b"\xc1 not msgpack")
        seq += 1
        await send(b"only one frame")
        await send(
            b"kv",
            seq.to_bytes(8, "big"),
            batch(["BlockMoved", [1]], ["BlockStored", "x"], ["BlockStored", [2], None, [], 16]),
        )
        seq += 1
        await until(lambda: index.match([2], [ENDPOINT]), "the valid event after the garbage")
        # the undecodable batch's changes are unknown: what was known before is dropped
        assert index.match([1], [ENDPOINT]) == {}
        assert subscriber.resets == 1
        # the undecodable payload, the one-frame message, the malformed event; the unknown kind
        assert observer.total(KV_EVENTS_ERRORS, reason="malformed") == 3
        assert observer.total(KV_EVENTS_ERRORS, reason="unknown_kind") == 1
    finally:
        await subscriptions.close()
        pub.close()
        ctx.term()
