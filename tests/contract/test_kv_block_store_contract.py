"""The ``KVBlockStore`` contract, run on every implementation: the in-memory one
(``domain.sharedstate.kv_blocks``), Redis on one server and on a 3-master cluster; then
``SharedKVBlockIndex`` on each: several processes following the same events share one
copy, a new one starts warm, and a store that is down never reaches the routing path."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from adapters.redis import RedisClient, RedisKVBlockStore, connect
from domain.prefixcache.kv_block_index import InMemoryKVBlockIndex
from domain.sharedstate.degraded import DegradedGauge
from domain.sharedstate.kv_blocks import InMemoryKVBlockStore
from domain.sharedstate.shared_kv_index import SharedKVBlockIndex
from ports.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVBlockStore
from ports.metric_catalogue import SHARED_STATE_DEGRADED, SHARED_STATE_WRITES
from ports.shared_state import SharedStateError
from tests.contract.conftest import BACKENDS, CONTRACT_TIMEOUT, backend_client
from tests.fakes.observer import RecordingObserver
from tests.support.redis import RedisServer

CAP = 100


def stored(*hashes: int, medium: str | None = None, parent: int | None = None) -> BlockStored:
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        block_size=16,
        medium=medium,
    )


def removed(*hashes: int, medium: str | None = None) -> BlockRemoved:
    return BlockRemoved(block_hashes=hashes, medium=medium)


class _Stores:
    """Stores on one backend: ``make()`` is one more EPP process's view of the same store."""

    def __init__(self, client: RedisClient | None, prefix: str) -> None:
        self.client = client
        self.prefix = prefix
        self._memory = InMemoryKVBlockStore()

    def make(self, prefix: str | None = None) -> KVBlockStore:
        if self.client is None:
            return self._memory if prefix is None else InMemoryKVBlockStore()
        return RedisKVBlockStore(self.client, key_prefix=prefix or self.prefix, chunk=7)


@pytest.fixture(params=BACKENDS)
async def stores(request: pytest.FixtureRequest, key_prefix: str) -> AsyncIterator[_Stores]:
    client = backend_client(request)
    yield _Stores(client, key_prefix)
    if client is not None:
        await client.aclose()


# --- the store ---


async def test_an_unknown_endpoint_has_no_blocks(stores: _Stores) -> None:
    assert await stores.make().blocks("ns/nobody", CAP) == []


async def test_events_apply_in_order_with_tiers(stores: _Stores) -> None:
    store = stores.make()
    await store.apply("ns/a", [stored(1, 2, 3), stored(2, medium="CPU"), removed(3)], CAP)
    await store.apply("ns/a", [removed(2), stored(4, parent=1)], CAP)
    # 2 lost its GPU copy, kept its CPU one; 3 is gone; never-stored removals are no-ops
    await store.apply("ns/a", [removed(99), removed(1, medium="CPU")], CAP)
    assert await stores.make().blocks("ns/a", CAP) == [(1, ("GPU",)), (2, ("CPU",)), (4, ("GPU",))]


async def test_a_block_stored_again_becomes_the_newest(stores: _Stores) -> None:
    store = stores.make()
    await store.apply("ns/a", [stored(1, 2, 3)], CAP)
    await store.apply("ns/a", [stored(1)], CAP)
    assert [h for h, _ in await store.blocks("ns/a", CAP)] == [2, 3, 1]
    assert [h for h, _ in await store.blocks("ns/a", 2)] == [3, 1]  # the newest two


async def test_the_cap_drops_the_oldest(stores: _Stores) -> None:
    store = stores.make()
    await store.apply("ns/a", [stored(*range(1, 21))], 8)
    assert [h for h, _ in await store.blocks("ns/a", CAP)] == list(range(13, 21))


async def test_all_blocks_cleared_empties_one_endpoint(stores: _Stores) -> None:
    store = stores.make()
    await store.apply("ns/a", [stored(1, 2)], CAP)
    await store.apply("ns/b", [stored(1, 2)], CAP)
    await store.apply("ns/a", [AllBlocksCleared(), stored(5)], CAP)
    assert await store.blocks("ns/a", CAP) == [(5, ("GPU",))]
    assert len(await store.blocks("ns/b", CAP)) == 2


async def test_replace_rewrites_a_copy_in_any_size(stores: _Stores) -> None:
    store = stores.make()
    await store.apply("ns/a", [stored(1, 2)], CAP)
    blocks = [(h, ("GPU",) if h % 3 else ("GPU", "CPU")) for h in range(10, 40)]
    await store.replace("ns/a", blocks, CAP)
    assert await store.blocks("ns/a", CAP) == blocks
    await store.replace("ns/a", blocks, 5)
    assert await store.blocks("ns/a", CAP) == blocks[-5:]
    await store.replace("ns/a", [], CAP)
    assert await store.blocks("ns/a", CAP) == []


async def test_64_bit_and_negative_hashes_round_trip(stores: _Stores) -> None:
    store = stores.make()
    hashes = (2**64 - 1, -(2**63), 0, 2**200 + 7)
    await store.apply("ns/a", [stored(*hashes)], CAP)
    assert [h for h, _ in await store.blocks("ns/a", CAP)] == list(hashes)


async def test_one_writer_lease_per_endpoint(stores: _Stores) -> None:
    one, two = stores.make(), stores.make()
    assert await one.claim("ns/a", "p1", 30) is True  # newly taken: write the copy
    assert await two.claim("ns/a", "p2", 30) is None  # held by another
    assert await two.claim("ns/b", "p2", 30) is True  # leases are per endpoint
    await one.apply("ns/a", [stored(1)], CAP)
    assert await one.claim("ns/a", "p1", 30) is False  # renewed, the copy is there


async def test_a_lapsed_lease_is_taken_over(stores: _Stores) -> None:
    one, two = stores.make(), stores.make()
    assert await one.claim("ns/a", "p1", 0.2) is True
    await one.apply("ns/a", [stored(1)], CAP)
    deadline = time.monotonic() + 5
    while (claimed := await two.claim("ns/a", "p2", 30)) is None:
        assert time.monotonic() < deadline, "the lease never lapsed"
        await asyncio.sleep(0.02)
    assert claimed is True  # a new owner rewrites the copy from its own index
    assert await one.claim("ns/a", "p1", 30) is None


async def test_a_lost_copy_makes_the_owner_rewrite_it(stores: _Stores) -> None:
    store = stores.make()
    assert await store.claim("ns/a", "p1", 30) is True
    await store.apply("ns/a", [stored(1)], CAP)
    assert await store.claim("ns/a", "p1", 30) is False
    await store.apply("ns/a", [AllBlocksCleared()], CAP)  # as after a restart, empty
    assert await store.claim("ns/a", "p1", 30) is True


async def test_forget_drops_the_copy_and_the_lease(stores: _Stores) -> None:
    store = stores.make()
    await store.claim("ns/a", "p1", 30)
    await store.apply("ns/a", [stored(1)], CAP)
    await store.forget("ns/a")
    assert await store.blocks("ns/a", CAP) == []
    assert await stores.make().claim("ns/a", "p2", 30) is True


async def test_a_released_lease_is_free_at_once_and_the_copy_stays_current(
    stores: _Stores,
) -> None:
    one, two = stores.make(), stores.make()
    assert await one.current("ns/a") is False  # nobody ever wrote it
    assert await one.claim("ns/a", "p1", 30) is True
    await one.apply("ns/a", [stored(1)], CAP)
    assert await two.current("ns/a") is True
    await two.release("ns/a", "p1-not", 30)  # not its lease: left alone
    assert await two.claim("ns/a", "p2", 30) is None
    await one.release("ns/a", "p1", 30)
    assert await two.current("ns/a") is True  # kept up to date until a successor claims
    assert await two.claim("ns/a", "p2", 30) is True  # at once, and p2 rewrites the copy
    assert await one.claim("ns/a", "p1", 30) is None


async def test_a_lapsed_or_released_lease_makes_the_copy_stale(stores: _Stores) -> None:
    store = stores.make()
    assert await store.claim("ns/a", "p1", 0.2) is True
    await store.apply("ns/a", [stored(1)], CAP)
    await _until(lambda: _not(store.current("ns/a")), "the lease to lapse")
    assert await store.claim("ns/b", "p1", 30) is True
    await store.release("ns/b", "p1", 0.2)
    await _until(lambda: _not(store.current("ns/b")), "the released lease to lapse")
    assert await store.blocks("ns/a", CAP) == [(1, ("GPU",))]  # still there, but stale


async def _not(call: Awaitable[bool]) -> bool:
    return not await call


async def test_pools_with_other_prefixes_do_not_share(stores: _Stores) -> None:
    await stores.make().apply("ns/a", [stored(1)], CAP)
    assert await stores.make(stores.prefix + "-other").blocks("ns/a", CAP) == []


# --- SharedKVBlockIndex: processes sharing one store ---


async def _until(
    condition: Callable[[], bool | Awaitable[bool]], what: str, within: float = 5.0
) -> None:
    deadline = time.monotonic() + within
    while True:
        result = condition()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def _process(
    store: KVBlockStore, owner: str, *, lease: float = 0.6, gauge: DegradedGauge | None = None
) -> SharedKVBlockIndex:
    return SharedKVBlockIndex(
        store,
        InMemoryKVBlockIndex(max_blocks_per_endpoint=CAP),
        owner=owner,
        cap=CAP,
        lease=lease,
        degraded_gauge=gauge,
    )


async def test_processes_share_one_copy_and_a_new_one_starts_warm(stores: _Stores) -> None:
    one, two = _process(stores.make(), "p1"), _process(stores.make(), "p2")
    one.start()
    two.start()
    try:
        # both follow the same stream; exactly one of them writes it
        for index in (one, two):
            index.apply("ns/a", [stored(1, 2, 3)])
        await _until(lambda: one.owns("ns/a") or two.owns("ns/a"), "a writer")
        assert not (one.owns("ns/a") and two.owns("ns/a"))
        for index in (one, two):
            index.apply("ns/a", [removed(3), stored(4, parent=2)])
        store = stores.make()

        async def written() -> bool:
            return [h for h, _ in await store.blocks("ns/a", CAP)] == [1, 2, 4]

        await _until(written, "the copy")
        # a process that starts now, with no event yet, routes on the copy
        three = _process(stores.make(), "p3")
        three.start()
        try:
            three.apply("ns/a", [stored(9, parent=4)])  # its first event: it follows ns/a
            await _until(lambda: three.match([1, 2, 4, 9], ["ns/a"]) == {"ns/a": 4}, "warm")
            assert not three.owns("ns/a")
        finally:
            await three.stop()
        # one that has not heard from the endpoint yet: it joined the pool
        four = _process(stores.make(), "p4")
        four.start()
        try:
            four.follow("ns/a")
            await _until(lambda: four.match([1, 2, 4], ["ns/a"]) == {"ns/a": 3}, "warm")
        finally:
            await four.stop()
    finally:
        await one.stop()
        await two.stop()


async def test_when_the_writer_dies_another_takes_over_and_rewrites(stores: _Stores) -> None:
    one, two = _process(stores.make(), "p1"), _process(stores.make(), "p2")
    one.start()
    one.apply("ns/a", [stored(1, 2)])
    await _until(lambda: one.owns("ns/a"), "p1 writing")
    two.start()
    two.apply("ns/a", [stored(1, 2)])
    await one.stop()  # dies: stops renewing
    two.apply("ns/a", [removed(2), stored(7, parent=1)])  # p1 never wrote these
    await _until(lambda: two.owns("ns/a"), "p2 taking over")
    store = stores.make()

    async def rewritten() -> bool:
        return [h for h, _ in await store.blocks("ns/a", CAP)] == [1, 7]

    await _until(rewritten, "the rewrite")
    await two.stop()


async def test_a_stopped_process_hands_its_leases_over_at_once(stores: _Stores) -> None:
    # a 6 s lease, renewed every 2 s: without the release, the other process could take
    # over only once the lease lapsed, at least 4 s after the stop
    one = _process(stores.make(), "p1", lease=6.0)
    two = _process(stores.make(), "p2", lease=6.0)
    one.start()
    one.follow("ns/a")
    await _until(lambda: one.owns("ns/a"), "p1 writing")
    two.start()
    two.follow("ns/a")
    await _until(lambda: two.warmed, "p2 warm")
    assert not two.owns("ns/a")
    await one.stop()
    stopped = time.monotonic()
    await _until(lambda: two.owns("ns/a"), "p2 taking over", within=3.5)
    assert time.monotonic() - stopped < 3.5
    await two.stop()


async def test_a_copy_without_a_writer_is_not_loaded(
    stores: _Stores, caplog: pytest.LogCaptureFixture
) -> None:
    store = stores.make()
    assert await store.claim("ns/a", "dead", 0.2) is True
    await store.apply("ns/a", [stored(1, 2)], CAP)
    fresh = _process(stores.make(), "p1")
    fresh.start()
    try:
        fresh.follow("ns/a")  # the writer is alive: its copy is loaded
        await _until(lambda: fresh.match([1, 2], ["ns/a"]) == {"ns/a": 2}, "warm")
    finally:
        await fresh.stop()
    # the writer dies (no release); once its lease lapsed, its copy misses what the
    # server evicted since, and a process that starts does not load it
    await _until(lambda: _not(store.current("ns/a")), "the lease to lapse")
    late = _process(stores.make(), "p2")
    caplog.set_level(logging.INFO, logger="domain.sharedstate.shared_kv_index")
    late.start()
    try:
        late.follow("ns/a")
        await _until(lambda: late.warmed, "the load to end")
        assert late.match([1, 2], ["ns/a"]) == {}
        assert "the shared copy of ns/a has no writer; not loaded" in caplog.text
        # then it writes the endpoint from its own events, from scratch
        await _until(lambda: late.owns("ns/a"), "p2 writing")
        await _until(lambda: _blocks_are(store, []), "the rewrite")
    finally:
        await late.stop()


class _CountingClaims:
    """A ``KVBlockStore`` that counts the lease claims it passes on."""

    def __init__(self, store: KVBlockStore) -> None:
        self.store = store
        self.claims = 0

    async def claim(self, endpoint: str, owner: str, lease: float) -> bool | None:
        self.claims += 1
        return await self.store.claim(endpoint, owner, lease)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


async def test_an_owner_with_nothing_to_write_does_not_rewrite_at_every_claim(
    stores: _Stores,
) -> None:
    observer = RecordingObserver()
    store = _CountingClaims(stores.make())
    quiet = SharedKVBlockIndex(
        store,
        InMemoryKVBlockIndex(max_blocks_per_endpoint=CAP),
        owner="p1",
        cap=CAP,
        lease=0.3,  # a claim every 0.1 s: an empty copy makes each answer "rewrite"
        observer=observer,
    )
    quiet.start()
    try:
        quiet.follow("ns/quiet")  # no copy, no event: known as empty
        await _until(lambda: quiet.owns("ns/quiet"), "the lease")
        claims = store.claims
        await _until(lambda: store.claims >= claims + 5, "five more claims")
        writes = [r for r in observer.counters if r.metric is SHARED_STATE_WRITES]
        assert len(writes) == 1  # the copy written empty once
    finally:
        await quiet.stop()


async def _blocks_are(store: KVBlockStore, hashes: list[int]) -> bool:
    return [h for h, _ in await store.blocks("ns/a", CAP)] == hashes


async def test_a_store_that_is_down_never_reaches_routing(
    redis_scratch_server: RedisServer, key_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="domain.sharedstate.shared_kv_index")
    client = connect(redis_scratch_server.url, socket_timeout=CONTRACT_TIMEOUT)
    observer = RecordingObserver()
    store = RedisKVBlockStore(client, key_prefix=key_prefix)
    index = _process(store, "p1", gauge=DegradedGauge(observer))

    def gauge() -> list[float]:
        values = [r.value for r in observer.gauges if r.metric is SHARED_STATE_DEGRADED]
        return [v for i, v in enumerate(values) if i == 0 or values[i - 1] != v]

    index.start()
    index.apply("ns/a", [stored(1, 2)])
    await _until(lambda: index.owns("ns/a"), "the lease")
    redis_scratch_server.kill()
    index.apply("ns/a", [stored(3, parent=2)])
    await _until(lambda: index.failing, "the failure")
    assert gauge() == [0.0, 1.0]  # the degraded gauge, as the approximate index sets it
    # routing goes on from the process's own copy, events still apply
    index.apply("ns/a", [stored(4, parent=3)])
    assert index.match([1, 2, 3, 4], ["ns/a"]) == {"ns/a": 4}
    # the server is back, empty: the owner rewrites its copy
    redis_scratch_server.start()
    await _until(lambda: not index.failing, "the recovery")
    assert gauge() == [0.0, 1.0, 0.0]

    async def rewritten() -> bool:
        return [h for h, _ in await store.blocks("ns/a", CAP)] == [1, 2, 3, 4]

    await _until(rewritten, "the rewrite")
    await index.stop()
    await client.aclose()
    # one line each way, however many calls failed
    lines = [r.getMessage() for r in caplog.records]
    assert sum("the shared store failed" in line for line in lines) == 1, lines
    assert sum("the shared store answers again" in line for line in lines) == 1, lines


async def test_a_redis_that_is_down_raises_shared_state_error(
    redis_scratch_server: RedisServer, key_prefix: str
) -> None:
    client = connect(redis_scratch_server.url)
    store = RedisKVBlockStore(client, key_prefix=key_prefix)
    await store.apply("ns/a", [stored(1)], CAP)
    redis_scratch_server.kill()
    for call in (
        store.blocks("ns/a", CAP),
        store.apply("ns/a", [stored(2)], CAP),
        store.claim("ns/a", "p1", 1),
        store.forget("ns/a"),
        store.release("ns/a", "p1", 1),
        store.current("ns/a"),
    ):
        with pytest.raises(SharedStateError, match="redis kv"):
            await call
    await client.aclose()
