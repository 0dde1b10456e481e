"""The ``SharedAdmission`` contract, run on every implementation: the in-memory board
(``domain.sharedstate.LoadBoard``), Redis on one server and Redis on a 3-master cluster. Two
or three instances play the processes of one pool; each publishes its flow-control counts
per flow and reads back the others' sums. Then the faults: a process that dies, Redis
flushed, Redis killed."""

from __future__ import annotations

import asyncio
import time

from redis.asyncio import Redis

from adapters.redis import RedisSharedLoad, connect
from adapters.redis.shared_load import ADMISSION_LEASE
from ports.shared_state import NO_POOL_FLOWS, FlowCounts, PoolFlows
from tests.contract.processes import LEASE, SEEN_WITHIN, Process, Processes, until
from tests.support.redis import RedisServer


async def admission(pool: Processes, *, lease: float = LEASE) -> Process:
    return await pool.process(lease=lease)


def counts(view: PoolFlows) -> dict[tuple[int, str], FlowCounts]:
    return {(p, f): c for p, flows in view.bands.items() for f, c in flows.items()}


async def test_another_process_sees_the_flows_one_publishes(pool: Processes) -> None:
    a, b = await admission(pool), await admission(pool)
    a.publish_flow(10, "tenant-a", FlowCounts(in_flight=2, waiting=5))
    a.publish_flow(0, "tenant-b", FlowCounts(in_flight=1, waiting=0))
    await until(lambda: len(counts(b.flows())) == 2, "b sees a's two flows")
    seen = b.flows()
    assert counts(seen) == {
        (10, "tenant-a"): FlowCounts(2, 5),
        (0, "tenant-b"): FlowCounts(1, 0),
    }
    assert seen.waiting == {10: 5}
    assert seen.in_flight == 3
    assert seen.top_waiting == 10
    assert not counts(a.flows())  # its own flows are not "others"
    assert b.flows().processes == 1  # a is live
    await until(lambda: a.flows().processes == 1, "a sees b live")


async def test_the_others_flows_are_summed(pool: Processes) -> None:
    a, b, c = await admission(pool), await admission(pool), await admission(pool)
    a.publish_flow(0, "t", FlowCounts(1, 2))
    b.publish_flow(0, "t", FlowCounts(3, 0))
    b.publish_flow(-1, "u", FlowCounts(0, 4))
    await until(
        lambda: counts(c.flows()) == {(0, "t"): FlowCounts(4, 2), (-1, "u"): FlowCounts(0, 4)},
        "c sees a + b",
    )
    assert c.flows().waiting == {0: 2, -1: 4}
    assert c.flows().top_waiting == 0


async def test_flow_counts_are_absolute_and_zero_removes(pool: Processes) -> None:
    a, b = await admission(pool), await admission(pool)
    a.publish_flow(0, "t", FlowCounts(4, 4))
    await until(lambda: counts(b.flows()) == {(0, "t"): FlowCounts(4, 4)}, "4 and 4")
    a.publish_flow(0, "t", FlowCounts(1, 0))
    a.publish_flow(0, "t", FlowCounts(1, 0))  # repeated: no harm
    await until(lambda: counts(b.flows()) == {(0, "t"): FlowCounts(1, 0)}, "1 and 0")
    a.publish_flow(0, "t", FlowCounts())
    await until(lambda: not counts(b.flows()), "nothing left")
    assert b.flows().in_flight == 0
    assert b.flows().top_waiting is None


async def test_flows_is_the_same_object_until_it_changes(pool: Processes) -> None:
    a, b = await admission(pool), await admission(pool)
    a.publish_flow(0, "t", FlowCounts(1, 1))
    await until(lambda: bool(counts(b.flows())), "b sees a")
    first = b.flows()
    await asyncio.sleep(0.1)  # a few refreshes that change nothing
    assert b.flows() is first


async def test_watchers_run_when_the_others_flows_change(pool: Processes) -> None:
    a, b = await admission(pool), await admission(pool)
    calls: list[PoolFlows] = []
    b.watch(lambda: calls.append(b.flows()))
    a.publish_flow(5, "t", FlowCounts(0, 3))
    await until(lambda: any(c.top_waiting == 5 for c in calls), "b's watcher told of a's queue")
    told = len(calls)
    a.publish_flow(5, "t", FlowCounts(1, 2))
    await until(lambda: len(calls) > told, "told again on a change")


async def test_odd_flow_ids_round_trip(pool: Processes) -> None:
    a, b = await admission(pool), await admission(pool)
    odd = 'a tenant: with spaces, ünïcode and "quotes"'
    a.publish_flow(-3, odd, FlowCounts(1, 1))
    a.publish_flow(7, "", FlowCounts(2, 0))  # the overflow key
    await until(lambda: len(counts(b.flows())) == 2, "both flows")
    assert counts(b.flows()) == {(-3, odd): FlowCounts(1, 1), (7, ""): FlowCounts(2, 0)}


async def test_stop_withdraws_the_flows_at_once(pool: Processes) -> None:
    a, b = await admission(pool, lease=30.0), await admission(pool, lease=30.0)
    a.publish_flow(0, "t", FlowCounts(2, 2))
    await until(lambda: bool(counts(b.flows())), "b sees a")
    await a.stop()
    pool.started.remove(a)
    took = await until(lambda: b.flows() is NO_POOL_FLOWS, "a withdrawn")
    assert took < 5.0


async def test_a_dead_process_stops_counting_within_the_admission_lease(pool: Processes) -> None:
    # The load's lease is long; the flow counts' is a second (or the lease, if shorter).
    a, b = await admission(pool, lease=30.0), await admission(pool, lease=30.0)
    a.publish_flow(10, "t", FlowCounts(3, 3))
    await until(lambda: bool(counts(b.flows())), "b sees a")
    crashed_at = time.monotonic()
    await pool.crash(a)
    pool.started.remove(a)
    await until(
        lambda: not counts(b.flows()),
        "a's flows lapsed",
        within=ADMISSION_LEASE + SEEN_WITHIN,
    )
    assert time.monotonic() - crashed_at >= ADMISSION_LEASE - 0.25


async def test_a_redis_flush_heals_without_a_new_publish(
    redis_scratch_server: RedisServer, key_prefix: str
) -> None:
    client = connect(redis_scratch_server.url, socket_timeout=5.0)
    raw = Redis(host="127.0.0.1", port=redis_scratch_server.port)
    a = RedisSharedLoad(client, key_prefix=key_prefix, lease=10.0, staleness=0.02)
    b = RedisSharedLoad(client, key_prefix=key_prefix, lease=10.0, staleness=0.02)
    a_flows = f"{key_prefix}:load:{{{key_prefix}}}:a:{a.process_id}"
    try:
        await a.start()
        await b.start()
        a.publish_flow(0, "t", FlowCounts(2, 1))
        await until(lambda: counts(b.flows()) == {(0, "t"): FlowCounts(2, 1)}, "b sees a")
        await raw.flushall()
        assert not await raw.exists(a_flows)
        # a's next round trip finds its hash short and writes everything again.
        started = time.monotonic()
        while not await raw.exists(a_flows):
            assert time.monotonic() - started < SEEN_WITHIN, "a never rewrote its flows"
            await asyncio.sleep(0.005)
        await until(lambda: counts(b.flows()) == {(0, "t"): FlowCounts(2, 1)}, "b sees a again")
    finally:
        await a.stop()
        await b.stop()
        await client.aclose()
        await raw.aclose()


async def test_redis_down_the_copy_lapses_then_heals(
    redis_scratch_server: RedisServer, key_prefix: str
) -> None:
    server = redis_scratch_server
    client = connect(server.url, connect_timeout=0.2, socket_timeout=0.2)
    a = RedisSharedLoad(client, key_prefix=key_prefix, lease=10.0, staleness=0.02)
    b = RedisSharedLoad(client, key_prefix=key_prefix, lease=10.0, staleness=0.02)
    try:
        await a.start()
        await b.start()
        a.publish_flow(0, "t", FlowCounts(1, 1))
        await until(lambda: bool(counts(b.flows())), "b sees a")
        server.kill()
        # Fairness falls back to this process alone once the copy is a second old.
        await until(
            lambda: b.flows() is NO_POOL_FLOWS, "the copy lapses", within=ADMISSION_LEASE + 3
        )
        a.publish_flow(0, "t", FlowCounts(2, 2))  # changed while Redis is down
        server.start()
        await until(lambda: counts(b.flows()) == {(0, "t"): FlowCounts(2, 2)}, "healed", within=10)
    finally:
        await a.stop()
        await b.stop()
        await client.aclose()
