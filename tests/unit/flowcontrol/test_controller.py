"""FlowController behaviour on a fake clock: dispatch, priority, capacity, TTL,
cancellation, displacement, stop, metrics and garbage collection."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from domain.flowcontrol import (
    BandConfig,
    BandView,
    FlowControlConfig,
    FlowController,
    FlowControlReason,
    FlowKey,
    FlowQueue,
    FlowResult,
    PriorityBandConfig,
    QueueItem,
    QueueOutcome,
    RequestEvictedError,
    RequestRejectedError,
)
from domain.flowcontrol import metrics as m
from domain.flowcontrol.plugins.edf_ordering import EdfOrderingPolicy
from domain.flowcontrol.plugins.round_robin_fairness import RoundRobinFairnessPolicy
from domain.flowcontrol.plugins.static_usage_limit import (
    StaticUsageLimitParameters,
    StaticUsageLimitPolicy,
)
from domain.plugins.base import EmptyParameters, TypedName
from ports import metric_catalogue as catalogue
from tests.unit.flowcontrol.harness import Harness, settle

Tasks = list[asyncio.Task[FlowResult]]


def done(tasks: Tasks) -> list[bool]:
    return [t.done() for t in tasks]


def outcomes(tasks: Tasks) -> list[QueueOutcome | None]:
    return [t.result().outcome if t.done() else None for t in tasks]


def assert_empty(h: Harness) -> None:
    """Nothing queued anywhere: counts, bytes, deadlines, flow queues, gauge series."""
    stats = h.controller.stats()
    assert stats.queued_requests == 0
    assert stats.queued_bytes == 0
    assert stats.tracked_deadlines == 0
    for band in stats.bands:
        assert band.queued_requests == 0
        assert band.queued_bytes == 0
        assert band.active_flows == 0
    for internal in h.controller._order:
        assert internal.oldest is None
        assert internal.newest is None
        assert all(len(flow.queue) == 0 for flow in internal.flows.values())
    assert h.controller._series == {}
    gauges = h.observer.last_gauges(catalogue.FLOW_CONTROL_QUEUE_SIZE)
    assert all(value == 0 for value in gauges.values())


class BandCeilings:
    """A usage-limit policy with a fixed ceiling per priority (default 1.0)."""

    def __init__(self, ceilings: Mapping[int, float]) -> None:
        self.typed_name = TypedName("band-ceilings", "band-ceilings")
        self.ceilings = dict(ceilings)

    def compute_limit(self, saturation: float, priorities: Sequence[int]) -> Sequence[float]:
        return [self.ceilings.get(p, 1.0) for p in priorities]


# -- fast path and basic dispatch ------------------------------------------------------------


async def test_unsaturated_enqueue_dispatches_without_suspending() -> None:
    h = Harness(saturation=0.2)
    coroutine = h.controller.enqueue_and_wait(h.request(size=100))
    with pytest.raises(StopIteration) as finished:
        coroutine.send(None)  # runs to completion without ever awaiting
    result: FlowResult = finished.value.value
    assert result.outcome is QueueOutcome.DISPATCHED
    assert result.error is None
    assert result.queue_time == 0.0
    assert_empty(h)
    assert h.timers.pending() <= 1  # at most the GC sweep


async def test_not_running_rejects_other() -> None:
    h = Harness()
    await h.controller.stop()
    result = await h.controller.enqueue_and_wait(h.request())
    assert result.outcome is QueueOutcome.REJECTED_OTHER
    assert isinstance(result.error, RequestRejectedError)
    assert str(result.error) == "request rejected pre-queue: flow controller is not running"


async def test_saturated_request_waits_until_notify() -> None:
    h = Harness(saturation=1.0)
    task = await h.submit(h.request())
    assert not task.done()
    assert h.controller.stats().queued_requests == 1
    await h.notify()  # still saturated: nothing moves
    assert not task.done()
    h.saturation = 0.5
    await h.notify()
    result = task.result()
    assert result.outcome is QueueOutcome.DISPATCHED
    assert_empty(h)


async def test_notify_is_coalesced_and_a_no_op_when_empty() -> None:
    h = Harness(FlowControlConfig(max_dispatch_per_cycle=16), saturation=1.0)
    h.controller.notify()
    assert h.controller._notify_handle is None  # nothing queued: nothing scheduled
    tasks = await h.submit_many([h.request() for _ in range(3)])
    h.saturation = 0.0
    reads = h.saturation_reads
    h.controller.notify()
    h.controller.notify()
    h.controller.notify()
    h.timers.run_soon()
    await settle()
    assert all(done(tasks))
    # one cycle: one saturation read per dispatch, not per notify
    assert h.saturation_reads - reads == 3


async def test_notify_dispatches_at_most_max_per_cycle_rereading_saturation() -> None:
    h = Harness(FlowControlConfig(max_dispatch_per_cycle=4), saturation=1.0)
    tasks = await h.submit_many([h.request() for _ in range(10)])
    h.saturation = 0.0
    reads = h.saturation_reads
    await h.notify()
    assert sum(done(tasks)) == 4
    assert h.saturation_reads - reads == 4
    await h.notify()
    assert sum(done(tasks)) == 8


async def test_saturation_rising_mid_cycle_stops_the_burst() -> None:
    h = Harness(FlowControlConfig(max_dispatch_per_cycle=10), saturation=1.0)
    tasks = await h.submit_many([h.request() for _ in range(6)])
    readings = iter([0.2, 0.6, 1.0])
    h.controller._saturation_fn = lambda: next(readings, 1.0)
    await h.notify()
    assert sum(done(tasks)) == 2


async def test_fallback_tick_dispatches_one_per_interval_only_while_queued() -> None:
    h = Harness(saturation=1.0)
    tasks = await h.submit_many([h.request() for _ in range(3)])
    assert h.timers.next_at() is not None
    h.saturation = 0.0  # no notify: only the tick notices
    await h.tick()
    assert sum(done(tasks)) == 1
    await h.tick()
    assert sum(done(tasks)) == 2
    await h.tick()
    assert all(done(tasks))
    assert h.controller._tick_handle is None  # nothing queued: no tick armed
    assert h.timers.pending() <= 1  # at most the GC sweep


async def test_blocked_ticks_back_off_and_a_dispatch_resets_them() -> None:
    config = FlowControlConfig(dispatch_interval=0.001, max_dispatch_interval=0.008)
    h = Harness(config, saturation=1.0)
    tasks = await h.submit_many([h.request() for _ in range(2)])
    gaps = []
    for _ in range(6):
        before = h.clock.now
        next_at = h.timers.next_at()
        assert next_at is not None
        await h.advance(next_at - before)
        gaps.append(round(h.timers.next_at() - h.clock.now, 6))  # type: ignore[operator]
    assert gaps == [0.002, 0.004, 0.008, 0.008, 0.008, 0.008]
    h.saturation = 0.0
    await h.advance(0.008)
    assert sum(done(tasks)) == 1
    assert h.timers.next_at() == pytest.approx(h.clock.now + 0.001)  # back to the base pace


async def test_enqueue_runs_one_cycle_that_serves_the_best_waiting_request() -> None:
    h = Harness(saturation=1.0)
    old = await h.submit(h.request(flow="a"))
    h.saturation = 0.0
    new = await h.submit(h.request(flow="b"))
    # the cycle the new arrival runs dispatches the oldest request (FCFS across flows)
    assert old.done()
    assert old.result().outcome is QueueOutcome.DISPATCHED
    assert not new.done()
    await h.tick()
    assert new.result().outcome is QueueOutcome.DISPATCHED


# -- priority ------------------------------------------------------------------------------


async def test_strict_priority_highest_band_first() -> None:
    h = Harness(saturation=1.0)
    low = await h.submit(h.request(priority=-5))
    mid = await h.submit(h.request(priority=0))
    high = await h.submit(h.request(priority=10))
    h.saturation = 0.0
    order: list[str] = []
    for _ in range(3):
        await h.tick()
        for name, task in (("high", high), ("mid", mid), ("low", low)):
            if task.done() and name not in order:
                order.append(name)
    assert order == ["high", "mid", "low"]


async def test_no_priority_inversion_when_the_top_band_is_blocked() -> None:
    # The lower band would be allowed by its own ceiling, but a higher band is waiting.
    policy = BandCeilings({10: 0.5, 0: 0.9})
    h = Harness(
        FlowControlConfig(usage_limit_policy_plugin_ref="band-ceilings", max_dispatch_per_cycle=16),
        saturation=1.0,
        plugins={"band-ceilings": policy},
    )
    high = await h.submit(h.request(priority=10))
    low = await h.submit(h.request(priority=0))
    h.saturation = 0.7  # below 0's ceiling, above 10's
    for _ in range(3):
        await h.notify()
        await h.tick()
    assert not high.done()
    assert not low.done()
    h.saturation = 0.4
    await h.notify()
    assert high.result().outcome is QueueOutcome.DISPATCHED
    assert low.result().outcome is QueueOutcome.DISPATCHED


async def test_lower_band_goes_once_the_higher_band_is_empty() -> None:
    policy = BandCeilings({10: 0.5, 0: 0.9})
    h = Harness(
        FlowControlConfig(usage_limit_policy_plugin_ref="band-ceilings"),
        saturation=1.0,
        plugins={"band-ceilings": policy},
    )
    low = await h.submit(h.request(priority=0))
    h.saturation = 0.7
    await h.notify()
    assert low.result().outcome is QueueOutcome.DISPATCHED


async def test_sheddable_never_dispatched_onto_a_saturated_pool() -> None:
    h = Harness(
        FlowControlConfig(usage_limit_policy_plugin_ref="lenient"),
        saturation=1.2,
        plugins={
            "lenient": StaticUsageLimitPolicy(
                TypedName("static-usage-limit-policy", "lenient"),
                StaticUsageLimitParameters(threshold=5.0),
            )
        },
    )
    # fast path: nothing queued, below the ceiling, but sheddable and saturated
    sheddable = await h.submit(h.request(priority=-1))
    assert not sheddable.done()
    critical = await h.submit(h.request(priority=0))
    assert critical.result().outcome is QueueOutcome.DISPATCHED
    await h.notify()
    await h.tick()
    assert not sheddable.done()
    h.saturation = 0.99
    await h.notify()
    assert sheddable.result().outcome is QueueOutcome.DISPATCHED


async def test_sheddable_dispatches_when_pool_not_saturated() -> None:
    h = Harness(saturation=0.9)
    result = await h.controller.enqueue_and_wait(h.request(priority=-3))
    assert result.outcome is QueueOutcome.DISPATCHED


# -- fairness and ordering inside the controller ------------------------------------------


async def test_global_strict_fcfs_across_flows_within_a_band() -> None:
    h = Harness(saturation=1.0)
    tasks = await h.submit_many([h.request(flow=f) for f in ("b", "a", "b", "c")])
    h.saturation = 0.0
    finished: list[int] = []
    for _ in range(4):
        await h.tick()
        finished.extend(i for i, t in enumerate(tasks) if t.done() and i not in finished)
    assert finished == [0, 1, 2, 3]


async def test_round_robin_band_alternates_flows() -> None:
    band = BandConfig(fairness_policy_ref="rr")
    h = Harness(
        FlowControlConfig(default_priority_band=band),
        saturation=1.0,
        plugins={
            "rr": RoundRobinFairnessPolicy(
                TypedName("round-robin-fairness-policy", "rr"), EmptyParameters()
            )
        },
    )
    tasks = await h.submit_many([h.request(flow=f) for f in ("a", "a", "a", "b", "b")])
    h.saturation = 0.0
    finished: list[int] = []
    for _ in range(5):
        await h.tick()
        finished.extend(i for i, t in enumerate(tasks) if t.done() and i not in finished)
    assert finished == [0, 3, 1, 4, 2]


async def test_edf_band_uses_a_heap_and_serves_the_earliest_deadline() -> None:
    band = PriorityBandConfig(priority=0, ordering_policy_ref="edf")
    h = Harness(
        FlowControlConfig(priority_bands=(band,)),
        saturation=1.0,
        plugins={
            "edf": EdfOrderingPolicy(TypedName("edf-ordering-policy", "edf"), EmptyParameters())
        },
    )
    late = await h.submit(h.request(ttl=60.0))
    never = await h.submit(h.request())
    soon = await h.submit(h.request(ttl=5.0))
    assert type(h.controller._bands[0].flows["flow"].queue).__name__ == "MaxMinHeap"
    h.saturation = 0.0
    await h.tick()
    assert soon.done()
    assert not late.done()
    assert not never.done()
    await h.tick()
    assert late.done()
    assert not never.done()


# -- capacity --------------------------------------------------------------------------------


async def test_global_request_capacity() -> None:
    h = Harness(FlowControlConfig(max_requests=2, displacement=False), saturation=1.0)
    tasks = await h.submit_many([h.request() for _ in range(3)])
    rejected = tasks[2].result()
    assert rejected.outcome is QueueOutcome.REJECTED_CAPACITY
    assert str(rejected.error) == "request rejected pre-queue: queue at capacity"
    assert h.controller.stats().queued_requests == 2


async def test_global_byte_capacity() -> None:
    h = Harness(FlowControlConfig(max_bytes=100), saturation=1.0)
    first = await h.submit(h.request(size=60))
    second = await h.submit(h.request(size=41))
    third = await h.submit(h.request(size=40))
    assert not first.done()
    assert second.result().outcome is QueueOutcome.REJECTED_CAPACITY
    assert not third.done()
    assert h.controller.stats().queued_bytes == 100


async def test_band_capacities() -> None:
    bands = (
        PriorityBandConfig(priority=1, max_requests=1),
        PriorityBandConfig(priority=2, max_bytes=10),
    )
    h = Harness(FlowControlConfig(priority_bands=bands), saturation=1.0)
    a = await h.submit(h.request(priority=1))
    b = await h.submit(h.request(priority=1))
    c = await h.submit(h.request(priority=2, size=8))
    d = await h.submit(h.request(priority=2, size=3))
    e = await h.submit(h.request(priority=2, size=2))
    assert outcomes([a, b, c, d, e]) == [
        None,
        QueueOutcome.REJECTED_CAPACITY,
        None,
        QueueOutcome.REJECTED_CAPACITY,
        None,
    ]


async def test_default_band_template_caps_bands_made_on_demand() -> None:
    h = Harness(FlowControlConfig(default_priority_band=BandConfig(max_requests=1)), saturation=1.0)
    first = await h.submit(h.request(priority=7))
    second = await h.submit(h.request(priority=7))
    other_band = await h.submit(h.request(priority=8))
    assert outcomes([first, second, other_band]) == [None, QueueOutcome.REJECTED_CAPACITY, None]
    assert h.controller.stats().band(7) is not None


async def test_oversized_request_is_rejected_even_on_an_idle_system() -> None:
    h = Harness(FlowControlConfig(max_bytes=10), saturation=0.0)
    result = await h.controller.enqueue_and_wait(h.request(size=11))
    assert result.outcome is QueueOutcome.REJECTED_CAPACITY
    assert_empty(h)


# -- displacement ----------------------------------------------------------------------------


async def test_displacement_evicts_lowest_priority_newest_first() -> None:
    h = Harness(FlowControlConfig(max_requests=4), saturation=1.0)
    p0_old = await h.submit(h.request(priority=0, flow="x"))
    neg_old = await h.submit(h.request(priority=-1, flow="y"))
    neg_new = await h.submit(h.request(priority=-1, flow="z"))
    p0_new = await h.submit(h.request(priority=0, flow="x"))
    # full: a priority 5 request displaces the newest priority -1 request
    first = await h.submit(h.request(priority=5))
    assert neg_new.done()
    assert not neg_old.done()
    displaced = neg_new.result()
    assert displaced.outcome is QueueOutcome.EVICTED_OTHER
    assert isinstance(displaced.error, RequestEvictedError)
    assert displaced.error.reason is FlowControlReason.DISPLACED
    # next: the remaining -1, then the newest priority 0
    second = await h.submit(h.request(priority=5))
    third = await h.submit(h.request(priority=5))
    assert neg_old.done()
    assert p0_new.done()
    assert not p0_old.done()
    assert outcomes([first, second, third]) == [None, None, None]
    counts = [r.labels for r in h.observer.named(catalogue.FLOW_CONTROL_DISPLACED)]
    assert counts == [{"priority": "-1"}, {"priority": "-1"}, {"priority": "0"}]


async def test_displacement_never_evicts_equal_priority() -> None:
    h = Harness(FlowControlConfig(max_requests=2), saturation=1.0)
    queued = await h.submit_many([h.request(priority=3), h.request(priority=3)])
    same = await h.submit(h.request(priority=3))
    assert same.result().outcome is QueueOutcome.REJECTED_CAPACITY
    assert not any(done(queued))


async def test_displacement_evicts_enough_bytes_or_nothing() -> None:
    h = Harness(FlowControlConfig(max_bytes=100), saturation=1.0)
    keep = await h.submit(h.request(priority=9, size=50))
    small = await h.submit_many([h.request(priority=0, size=10) for _ in range(5)])
    # needs 90 bytes: only 50 are held by lower priorities -> nothing is evicted
    too_big = await h.submit(h.request(priority=9, size=90))
    assert too_big.result().outcome is QueueOutcome.REJECTED_CAPACITY
    assert not any(done(small))
    # needs 25 bytes: three of the five (newest first)
    fits = await h.submit(h.request(priority=9, size=25))
    assert done(small) == [False, False, True, True, True]
    assert not fits.done()
    assert not keep.done()
    assert h.controller.stats().queued_bytes == 50 + 20 + 25


async def test_displacement_does_not_relieve_a_full_band() -> None:
    bands = (PriorityBandConfig(priority=5, max_requests=1),)
    h = Harness(FlowControlConfig(priority_bands=bands, max_requests=10), saturation=1.0)
    low = await h.submit(h.request(priority=0))
    await h.submit(h.request(priority=5))
    blocked = await h.submit(h.request(priority=5))
    assert blocked.result().outcome is QueueOutcome.REJECTED_CAPACITY
    assert not low.done()


async def test_displacement_off_switch() -> None:
    h = Harness(FlowControlConfig(max_requests=1, displacement=False), saturation=1.0)
    low = await h.submit(h.request(priority=-1))
    high = await h.submit(h.request(priority=10))
    assert high.result().outcome is QueueOutcome.REJECTED_CAPACITY
    assert not low.done()
    assert h.observer.named(catalogue.FLOW_CONTROL_DISPLACED) == []


# -- TTL -----------------------------------------------------------------------------------


async def test_ttl_expiry_at_the_deadline_with_a_single_timer() -> None:
    h = Harness(FlowControlConfig(default_request_ttl=10.0), saturation=1.0)
    task = await h.submit(h.request())
    others = await h.submit_many([h.request(ttl=30.0) for _ in range(5)])
    ttl_timers = [t for t in h.timers._timers if not t[2].cancelled and t[0] == h.clock.now + 10]
    assert len(ttl_timers) == 1  # one timer for the earliest deadline, not one per request
    await h.advance(9.999)
    assert not task.done()
    await h.advance(0.001)
    result = task.result()
    assert result.outcome is QueueOutcome.EVICTED_TTL
    assert str(result.error) == "request evicted from queue: request TTL expired"
    assert result.queue_time == pytest.approx(10.0)
    assert not any(done(others))
    await h.advance(20.0)
    assert [t.result().outcome for t in others] == [QueueOutcome.EVICTED_TTL] * 5
    assert_empty(h)


async def test_ttl_runs_from_received_time() -> None:
    h = Harness(saturation=1.0)
    task = await h.submit(h.request(ttl=5.0, received_at=h.clock.now - 4.0))
    await h.advance(1.0)
    assert task.result().outcome is QueueOutcome.EVICTED_TTL


async def test_no_ttl_waits_until_dispatched() -> None:
    h = Harness(FlowControlConfig(max_dispatch_interval=60.0), saturation=1.0)
    task = await h.submit(h.request())
    assert h.controller.stats().tracked_deadlines == 0
    await h.advance(3600.0)
    assert not task.done()
    h.saturation = 0.0
    await h.notify()
    assert task.result().outcome is QueueOutcome.DISPATCHED


async def test_dispatch_cancels_the_ttl_timer_when_no_deadline_is_left() -> None:
    h = Harness(FlowControlConfig(default_request_ttl=30.0), saturation=1.0)
    task = await h.submit(h.request())
    h.saturation = 0.0
    await h.notify()
    assert task.result().outcome is QueueOutcome.DISPATCHED
    assert h.controller._ttl_handle is None
    assert_empty(h)


# -- cancellation ---------------------------------------------------------------------------


async def test_cancellation_removes_the_request_at_once() -> None:
    h = Harness(FlowControlConfig(default_request_ttl=60.0), saturation=1.0)
    task = await h.submit(h.request(size=500, flow="gone"))
    keep = await h.submit(h.request(size=7, flow="stays"))
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    stats = h.controller.stats()
    assert stats.queued_requests == 1
    assert stats.queued_bytes == 7
    assert stats.tracked_deadlines == 1
    finals = [r.labels["outcome"] for r in h.observer.named(catalogue.FLOW_CONTROL_QUEUE_DURATION)]
    assert finals == ["EvictedContextCancelled"]
    keep.cancel()
    with pytest.raises(asyncio.CancelledError):
        await keep
    assert_empty(h)
    assert h.controller._ttl_handle is None


async def test_a_cancelled_waiter_does_not_consume_a_dispatch() -> None:
    h = Harness(saturation=1.0)
    gone = await h.submit(h.request())
    waiting = await h.submit(h.request())
    gone.cancel()  # the task has not run its handler yet
    h.saturation = 0.0
    h.controller._run_cycle(1, from_tick=False)
    await settle()
    assert gone.cancelled()
    assert waiting.result().outcome is QueueOutcome.DISPATCHED
    finals = [r.labels["outcome"] for r in h.observer.named(catalogue.FLOW_CONTROL_QUEUE_DURATION)]
    assert finals == ["EvictedContextCancelled", "Dispatched"]
    assert_empty(h)


# -- stop -----------------------------------------------------------------------------------


async def test_stop_ends_every_queued_request() -> None:
    h = Harness(FlowControlConfig(default_request_ttl=30.0), saturation=1.0)
    tasks = await h.submit_many(
        [h.request(priority=p, flow=f) for p in (5, 0, -1) for f in ("a", "b")]
    )
    await h.controller.stop()
    await settle()
    for task in tasks:
        result = task.result()
        assert result.outcome is QueueOutcome.REJECTED_OTHER
        assert result.error is not None
        assert result.error.reason is FlowControlReason.NOT_RUNNING
    assert_empty(h)
    assert h.timers.pending() == 0
    assert h.controller.stats().bands == ()
    h.controller.start()  # restartable
    h.saturation = 0.0
    assert (await h.controller.enqueue_and_wait(h.request())).dispatched


# -- policy resolution and failures ----------------------------------------------------------


def test_unknown_or_wrong_kind_policy_refs_fail_at_construction() -> None:
    with pytest.raises(
        ValueError, match=r'defaultPriorityBand\.orderingPolicyRef: no plugin named "x"'
    ):
        FlowController(
            FlowControlConfig(default_priority_band=BandConfig(ordering_policy_ref="x")),
            saturation=lambda: 0.0,
        )
    edf = EdfOrderingPolicy(TypedName("edf-ordering-policy", "edf"), EmptyParameters())
    with pytest.raises(ValueError, match=r'priorityBands\[0\].fairnessPolicyRef: plugin "edf"'):
        FlowController(
            FlowControlConfig(
                priority_bands=(PriorityBandConfig(priority=1, fairness_policy_ref="edf"),)
            ),
            saturation=lambda: 0.0,
            plugins={"edf": edf},
        )
    with pytest.raises(ValueError, match="usageLimitPolicyPluginRef"):
        FlowController(
            FlowControlConfig(usage_limit_policy_plugin_ref="nope"), saturation=lambda: 0.0
        )


async def test_saturation_failure_counts_as_saturated(caplog: pytest.LogCaptureFixture) -> None:
    h = Harness()

    def broken() -> float:
        raise RuntimeError("metrics gone")

    h.controller._saturation_fn = broken
    with caplog.at_level(logging.ERROR):
        task = await h.submit(h.request())
    assert not task.done()
    assert "saturation unavailable" in caplog.text
    h.controller._saturation_fn = lambda: 0.0
    await h.notify()
    assert task.result().outcome is QueueOutcome.DISPATCHED


class ExplodingOrdering:
    requires_priority_queue = False

    def __init__(self) -> None:
        self.typed_name = TypedName("boom", "boom")

    def order_key(self, item: QueueItem) -> tuple[float, float]:
        raise RuntimeError("boom")


class PicksNothing:
    def __init__(self) -> None:
        self.typed_name = TypedName("none", "none")

    def new_state(self) -> Any:
        return None

    def pick_flow(self, state: Any, band: BandView) -> FlowQueue | None:
        return None


async def test_policy_failures_are_request_outcomes_not_exceptions() -> None:
    band = BandConfig(ordering_policy_ref="boom")
    h = Harness(
        FlowControlConfig(default_priority_band=band),
        saturation=1.0,
        plugins={"boom": ExplodingOrdering()},
    )
    result = await h.controller.enqueue_and_wait(h.request())
    assert result.outcome is QueueOutcome.REJECTED_OTHER
    assert result.error is not None
    assert result.error.reason is FlowControlReason.INTERNAL
    assert_empty(h)


async def test_a_fairness_policy_that_picks_nothing_stalls_only_its_band() -> None:
    bands = (PriorityBandConfig(priority=1, fairness_policy_ref="none"),)
    h = Harness(
        FlowControlConfig(priority_bands=bands, default_request_ttl=1.0),
        saturation=1.0,
        plugins={"none": PicksNothing()},
    )
    task = await h.submit(h.request(priority=1))
    h.saturation = 0.0
    await h.notify()
    assert not task.done()
    await h.advance(1.0)
    assert task.result().outcome is QueueOutcome.EVICTED_TTL


# -- metrics --------------------------------------------------------------------------------


async def test_metrics_through_the_observer() -> None:
    h = Harness(saturation=1.0, pool_name="pool-a")
    task = await h.submit(h.request(priority=2, flow="tenant", size=30, model="llama"))
    size = h.observer.last_gauges(catalogue.FLOW_CONTROL_QUEUE_SIZE)
    labels = (
        ("fairness_id", "tenant"),
        ("inference_pool", "pool-a"),
        ("model_name", "llama"),
        ("priority", "2"),
        ("target_model_name", "llama"),
    )
    assert size == {labels: 1}
    assert h.observer.last_gauges(catalogue.FLOW_CONTROL_QUEUE_BYTES) == {labels: 30}
    assert h.observer.last_gauges(catalogue.FLOW_CONTROL_POOL_SATURATION) == {
        (("inference_pool", "pool-a"),): 1.0
    }
    h.saturation = 0.25
    await h.advance(0.5)  # ticks: the pool saturation gauge follows, the request goes
    assert task.result().outcome is QueueOutcome.DISPATCHED
    assert h.observer.last_gauges(catalogue.FLOW_CONTROL_QUEUE_SIZE) == {labels: 0}
    assert h.observer.last_gauges(catalogue.FLOW_CONTROL_QUEUE_BYTES) == {labels: 0}
    assert h.observer.last_gauges(catalogue.FLOW_CONTROL_POOL_SATURATION) == {
        (("inference_pool", "pool-a"),): 0.25
    }
    (final,) = h.observer.named(catalogue.FLOW_CONTROL_QUEUE_DURATION)
    assert final.labels == {
        "fairness_id": "tenant",
        "priority": "2",
        "outcome": "Dispatched",
        "inference_pool": "pool-a",
        "model_name": "llama",
        "target_model_name": "llama",
    }
    assert final.value == pytest.approx(task.result().queue_time)
    (enqueue,) = h.observer.named(catalogue.FLOW_CONTROL_ENQUEUE_DURATION)
    assert enqueue.labels == {
        "fairness_id": "tenant",
        "priority": "2",
        "outcome": "NotYetFinalized",
    }
    assert h.observer.named(catalogue.FLOW_CONTROL_DISPATCH_CYCLE_DURATION)


async def test_fast_path_and_rejections_are_measured_too() -> None:
    h = Harness(FlowControlConfig(max_bytes=5))
    await h.controller.enqueue_and_wait(h.request(size=1))
    await h.controller.enqueue_and_wait(h.request(size=6))
    finals = [r.labels["outcome"] for r in h.observer.named(catalogue.FLOW_CONTROL_QUEUE_DURATION)]
    enqueues = [
        r.labels["outcome"] for r in h.observer.named(catalogue.FLOW_CONTROL_ENQUEUE_DURATION)
    ]
    assert finals == ["Dispatched", "RejectedCapacity"]
    assert enqueues == ["Dispatched", "RejectedCapacity"]


async def test_fairness_label_is_bounded() -> None:
    h = Harness(fairness_label_limit=2)
    for flow in ("a", "b", "c", "d", "a"):
        await h.controller.enqueue_and_wait(h.request(flow=flow))
    ids = [r.labels["fairness_id"] for r in h.observer.named(catalogue.FLOW_CONTROL_QUEUE_DURATION)]
    assert ids == ["a", "b", m.OVERFLOW_LABEL, m.OVERFLOW_LABEL, "a"]


# -- garbage collection ------------------------------------------------------------------------


async def test_idle_flows_and_on_demand_bands_are_collected() -> None:
    configured = PriorityBandConfig(priority=100)
    h = Harness(FlowControlConfig(priority_bands=(configured,)), saturation=1.0)
    task = await h.submit(h.request(priority=3, flow="f1"))
    h.saturation = 0.0
    await h.notify()
    assert task.done()
    band = h.controller.stats().band(3)
    assert band is not None
    assert band.flows == 1
    await h.advance(1000.0)
    assert h.controller.stats().band(3).flows == 1  # type: ignore[union-attr]  # in flight
    h.controller.release(FlowKey("f1", 3))  # the request ended
    await h.advance(299.0)
    assert h.controller.stats().band(3).flows == 1  # type: ignore[union-attr]
    await h.advance(300.0)  # flow idle > 5 min (sweep every 150 s)
    band = h.controller.stats().band(3)
    assert band is not None
    assert band.flows == 0
    await h.advance(600.0)  # band idle > 10 min
    assert h.controller.stats().band(3) is None
    assert h.controller.stats().band(100) is not None  # configured bands stay
    assert h.timers.pending() == 0  # nothing left to collect: no sweep armed


async def test_busy_flows_are_not_collected() -> None:
    h = Harness(FlowControlConfig(max_dispatch_interval=60.0), saturation=1.0)
    task = await h.submit(h.request(flow="busy"))
    await h.advance(2000.0)
    assert not task.done()
    assert h.controller.stats().band(0).flows == 1  # type: ignore[union-attr]


async def test_by_default_one_notify_dispatches_one_request() -> None:
    # Saturation read from scraped metrics does not move until the next scrape: a notify
    # must not empty the queue onto the pool on one stale reading.
    h = Harness(saturation=1.0)
    tasks = await h.submit_many([h.request() for _ in range(5)])
    h.saturation = 0.0
    await h.notify()
    assert sum(done(tasks)) == 1
