"""Flow controllers of several processes sharing their flows on a ``LoadBoard``: the counts
they publish, priority and max-min fairness over the pool, a process that dies, and the cap
on published flows. Each "process" is a controller whose saturation is the pool's requests
in flight over a fixed capacity (the capacity-based saturation the app wires)."""

from __future__ import annotations

import asyncio
import itertools

from domain.flowcontrol import (
    BandConfig,
    FlowControlConfig,
    FlowController,
    FlowKey,
    FlowRequest,
    FlowResult,
    QueueOutcome,
)
from domain.flowcontrol.plugins.max_min_fairness import MaxMinFairnessPolicy
from domain.flowcontrol.pool import MAX_PUBLISHED_FLOWS, OVERFLOW_KEY, flow_key
from domain.plugins.base import EmptyParameters, TypedName
from domain.sharedstate import BoardMember, LoadBoard
from ports.shared_state import FlowCounts
from tests.unit.flowcontrol.harness import FakeClock, FakeTimers, settle

MAX_MIN = "max-min-fairness-policy"


class Node:
    """One process: a controller publishing to ``board`` as member ``name``."""

    def __init__(
        self,
        name: str,
        board: LoadBoard,
        clock: FakeClock,
        timers: FakeTimers,
        capacity: int,
        *,
        fairness: str = "global-strict-fairness-policy",
    ) -> None:
        self.member: BoardMember = board.member(name)
        self.capacity = capacity
        self.controller = FlowController(
            FlowControlConfig(default_priority_band=BandConfig(fairness_policy_ref=fairness)),
            saturation=lambda: self.controller.pool_in_flight() / self.capacity,
            plugins={MAX_MIN: MaxMinFairnessPolicy(TypedName(MAX_MIN, MAX_MIN), EmptyParameters())},
            clock=clock,
            timers=timers,
            pool=self.member,
        )
        self.controller.start()
        self.clock = clock
        self._ids = itertools.count()

    async def submit(self, flow: str, priority: int = 0) -> asyncio.Task[FlowResult]:
        request = FlowRequest(
            request_id=f"r{next(self._ids)}",
            flow_key=FlowKey(flow, priority),
            received_at=self.clock(),
        )
        task = asyncio.create_task(self.controller.enqueue_and_wait(request))
        await settle()
        return task


class Pool:
    def __init__(self, capacity: int, *, fairness: str = "global-strict-fairness-policy") -> None:
        self.clock = FakeClock()
        self.timers = FakeTimers(self.clock)
        self.board = LoadBoard(clock=self.clock)
        self.a = Node("a", self.board, self.clock, self.timers, capacity, fairness=fairness)
        self.b = Node("b", self.board, self.clock, self.timers, capacity, fairness=fairness)

    async def run(self) -> None:
        """Runs what the controllers scheduled (notify cycles) and lets tasks finish."""
        for _ in range(4):
            self.timers.run_soon()
            await settle()


def dispatched(task: asyncio.Task[FlowResult]) -> bool:
    return task.done() and task.result().outcome is QueueOutcome.DISPATCHED


async def test_each_flow_counts_are_published_and_released() -> None:
    pool = Pool(capacity=2)
    first, second = await pool.a.submit("t"), await pool.a.submit("t")
    third = await pool.a.submit("t")
    assert dispatched(first)
    assert dispatched(second)
    assert not third.done()
    seen = pool.b.member.flows()
    assert seen.bands == {0: {"t": FlowCounts(in_flight=2, waiting=1)}}
    assert pool.b.controller.pool_in_flight() == 2
    pool.a.controller.release(FlowKey("t", 0))
    await pool.run()
    assert dispatched(third)
    assert pool.b.member.flows().bands == {0: {"t": FlowCounts(in_flight=2, waiting=0)}}
    pool.a.controller.release(FlowKey("t", 0))
    pool.a.controller.release(FlowKey("t", 0))
    pool.a.controller.release(FlowKey("t", 0))  # one too many: ignored
    assert pool.b.member.flows().bands == {}
    assert pool.a.controller.stats().in_flight == 0


async def test_capacity_is_the_pools_not_each_processes() -> None:
    pool = Pool(capacity=2)
    assert dispatched(await pool.a.submit("t"))
    assert dispatched(await pool.b.submit("t"))
    late = await pool.b.submit("t")
    assert not late.done()  # one in flight on each: the pool's two slots are taken
    pool.a.controller.release(FlowKey("t", 0))
    await pool.run()  # a's release reaches b through the board
    assert dispatched(late)


async def test_a_lower_band_waits_while_another_process_holds_a_higher_one() -> None:
    pool = Pool(capacity=1)
    assert dispatched(await pool.a.submit("batch", priority=-1))
    urgent = await pool.b.submit("web", priority=10)
    more_batch = await pool.a.submit("batch", priority=-1)
    await pool.run()
    assert not urgent.done()
    assert not more_batch.done()
    pool.a.capacity = pool.b.capacity = 2  # room for one more; a hears of it first
    pool.a.controller.notify()
    await pool.run()
    assert not more_batch.done()  # a leaves the room to b's higher band
    pool.b.controller.notify()
    await pool.run()
    assert dispatched(urgent)
    pool.b.controller.release(FlowKey("web", 10))
    await pool.run()
    assert dispatched(more_batch)


async def test_a_new_request_does_not_skip_a_queue_at_another_process() -> None:
    pool = Pool(capacity=1)
    assert dispatched(await pool.a.submit("x"))
    queued = await pool.b.submit("x")
    pool.a.controller.release(FlowKey("x", 0))
    newcomer = await pool.a.submit("x")  # before b's cycle ran: the room is b's
    assert not newcomer.done()
    await pool.run()
    assert dispatched(queued)
    assert not newcomer.done()


async def test_max_min_fairness_over_the_pool() -> None:
    # heavy waits at both processes, light only at b; a frees a slot: it goes to light.
    pool = Pool(capacity=4, fairness=MAX_MIN)
    for node in (pool.a, pool.b):
        for _ in range(2):
            assert dispatched(await node.submit("heavy"))
    heavy_a = [await pool.a.submit("heavy") for _ in range(3)]
    heavy_b = [await pool.b.submit("heavy") for _ in range(3)]
    light = await pool.b.submit("light")
    pool.a.controller.release(FlowKey("heavy", 0))
    await pool.run()
    assert not any(t.done() for t in heavy_a)  # a held its heavy requests back
    assert dispatched(light)
    assert not any(t.done() for t in heavy_b)
    # Now light has 1 in flight, heavy 3: the next slot goes to heavy, at either process.
    pool.b.controller.release(FlowKey("heavy", 0))
    await pool.run()
    assert sum(t.done() for t in heavy_a + heavy_b) == 1


async def test_a_process_that_dies_stops_holding_the_others_back() -> None:
    pool = Pool(capacity=1)
    assert dispatched(await pool.b.submit("batch", priority=-1))
    await pool.a.submit("web", priority=10)  # waits at a, which then dies
    batch = await pool.b.submit("batch", priority=-1)
    await pool.a.member._halt()  # a crash: a stops renewing, never withdraws
    pool.b.controller.release(FlowKey("batch", -1))
    await pool.run()
    assert not batch.done()  # a's high band still counts
    pool.timers.advance(pool.board.admission_lease + 0.1)  # b's fallback ticks run
    await pool.run()
    pool.timers.advance(0.1)
    await pool.run()
    assert dispatched(batch)


async def test_published_flows_are_capped_and_the_rest_summed() -> None:
    pool = Pool(capacity=1)
    assert dispatched(await pool.a.submit("first"))
    tenants = [f"tenant-{i}" for i in range(MAX_PUBLISHED_FLOWS + 50)]
    for tenant in tenants:
        await pool.a.submit(tenant)
    seen = pool.b.member.flows()
    named = {k for k in seen.bands[0] if k != OVERFLOW_KEY}
    assert len(named) == MAX_PUBLISHED_FLOWS
    assert seen.waiting[0] == len(tenants)  # the band's total stays exact
    assert seen.bands[0][OVERFLOW_KEY].waiting == len(tenants) + 1 - MAX_PUBLISHED_FLOWS


def test_long_or_odd_fairness_ids_get_a_digest_key() -> None:
    assert flow_key("tenant-a") == "tenant-a"
    long = "x" * 65
    assert flow_key(long).startswith("#")
    assert len(flow_key(long)) == 17
    assert flow_key(long) == flow_key(long)
    assert flow_key("#looks-like-a-digest") != "#looks-like-a-digest"
    assert flow_key("") not in ("", OVERFLOW_KEY)
