"""Property tests: random arrivals, cancellations, saturation changes, notifies and time,
driven deterministically on a fake clock, against the controller's invariants."""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from domain.flowcontrol import (
    BandConfig,
    FlowControlConfig,
    FlowResult,
    PriorityBandConfig,
    QueueOutcome,
)
from domain.flowcontrol.plugins.edf_ordering import EdfOrderingPolicy
from domain.flowcontrol.plugins.round_robin_fairness import RoundRobinFairnessPolicy
from domain.flowcontrol.plugins.static_usage_limit import (
    StaticUsageLimitParameters,
    StaticUsageLimitPolicy,
)
from domain.plugins.base import EmptyParameters, TypedName
from ports import metric_catalogue as catalogue
from tests.unit.flowcontrol.harness import Harness, Record, settle

PRIORITIES = (-1, 0, 1, 2)
INTERVAL = 0.001


@dataclass(frozen=True)
class Setup:
    max_requests: int
    max_bytes: int
    band_one_max_requests: int
    default_ttl: float
    displacement: bool
    threshold: float
    edf: bool
    round_robin: bool
    saturation: float


setups = st.builds(
    Setup,
    max_requests=st.sampled_from([0, 3, 8]),
    max_bytes=st.sampled_from([0, 60, 200]),
    band_one_max_requests=st.sampled_from([0, 2]),
    default_ttl=st.sampled_from([0.0, 0.004, 0.03]),
    displacement=st.booleans(),
    threshold=st.sampled_from([1.0, 1.5]),
    edf=st.booleans(),
    round_robin=st.booleans(),
    saturation=st.sampled_from([0.0, 1.0, 2.0]),
)


@st.composite
def operation(draw: st.DrawFn) -> tuple[object, ...]:
    """One step; arrivals are the most frequent."""
    roll = draw(st.integers(min_value=0, max_value=99))
    if roll < 40:
        return (
            "arrive",
            draw(st.sampled_from(PRIORITIES)),
            draw(st.sampled_from([0, 1, 5, 10, 20, 25, 40])),
            draw(st.sampled_from([0.0, 0.002, 0.01, 0.05])),
            draw(st.sampled_from(["a", "b", "c"])),
        )
    if roll < 50:
        return ("cancel", draw(st.integers(min_value=0, max_value=1000)))
    if roll < 66:
        return ("saturation", draw(st.sampled_from([0.0, 0.5, 0.99, 1.0, 1.2, 2.0])))
    if roll < 80:
        return ("notify",)
    return ("advance", draw(st.sampled_from([0.0005, 0.001, 0.0025, 0.007, 0.02])))


operations = st.lists(operation(), min_size=20, max_size=80)


def build(setup: Setup) -> Harness:
    band_one = PriorityBandConfig(
        priority=1,
        max_requests=setup.band_one_max_requests,
        ordering_policy_ref="edf" if setup.edf else "fcfs-ordering-policy",
        fairness_policy_ref="rr" if setup.round_robin else "global-strict-fairness-policy",
    )
    config = FlowControlConfig(
        max_requests=setup.max_requests,
        max_bytes=setup.max_bytes,
        default_request_ttl=setup.default_ttl,
        default_priority_band=BandConfig(
            fairness_policy_ref="rr" if setup.round_robin else "global-strict-fairness-policy"
        ),
        priority_bands=(band_one,),
        usage_limit_policy_plugin_ref="limit",
        displacement=setup.displacement,
        dispatch_interval=INTERVAL,
        max_dispatch_per_cycle=3,
    )
    plugins: dict[str, object] = {
        "edf": EdfOrderingPolicy(TypedName("edf-ordering-policy", "edf"), EmptyParameters()),
        "rr": RoundRobinFairnessPolicy(
            TypedName("round-robin-fairness-policy", "rr"), EmptyParameters()
        ),
        "limit": StaticUsageLimitPolicy(
            TypedName("static-usage-limit-policy", "limit"),
            StaticUsageLimitParameters(threshold=setup.threshold),
        ),
    }
    return Harness(config, saturation=setup.saturation, plugins=plugins)


@dataclass
class Arrival:
    task: asyncio.Task[FlowResult]
    priority: int
    received_at: float
    deadline: float | None
    cancelled: bool = False


async def scenario(setup: Setup, ops: list[tuple[object, ...]]) -> None:
    h = build(setup)
    controller = h.controller
    arrivals: list[Arrival] = []
    violations: list[str] = []

    def on_record(record: Record) -> None:
        if (
            record.metric is not catalogue.FLOW_CONTROL_QUEUE_DURATION
            or record.labels["outcome"] != "Dispatched"
        ):
            return
        priority = int(record.labels["priority"])
        saturation = h.saturation
        if not saturation < setup.threshold:
            violations.append(f"dispatched priority {priority} at saturation {saturation}")
        if priority < 0 and saturation >= 1.0:
            violations.append(f"sheddable dispatched onto a saturated pool ({saturation})")
        for band in controller.stats().bands:
            if band.priority > priority and band.queued_requests:
                violations.append(f"priority {priority} went while {band.priority} waited")

    h.observer.hook = on_record

    def check_state() -> None:
        stats = controller.stats()
        if setup.max_requests:
            assert stats.queued_requests <= setup.max_requests
        if setup.max_bytes:
            assert stats.queued_bytes <= setup.max_bytes
        one = stats.band(1)
        if one is not None and setup.band_one_max_requests:
            assert one.queued_requests <= setup.band_one_max_requests
        assert stats.queued_requests == sum(b.queued_requests for b in stats.bands)
        assert stats.queued_bytes == sum(b.queued_bytes for b in stats.bands)
        now = h.clock.now
        for arrival in arrivals:
            if not arrival.task.done() and arrival.deadline is not None:
                assert now <= arrival.deadline + INTERVAL, "queued past its TTL"
        assert not violations, violations

    for op in ops:
        kind = op[0]
        if kind == "arrive":
            _, priority, size, ttl, flow = op
            assert isinstance(priority, int)
            assert isinstance(size, int)
            assert isinstance(ttl, float)
            assert isinstance(flow, str)
            request = h.request(priority=priority, size=size, ttl=ttl, flow=flow)
            effective = ttl or setup.default_ttl
            task = await h.submit(request)
            arrivals.append(
                Arrival(
                    task,
                    priority,
                    request.received_at,
                    request.received_at + effective if effective else None,
                )
            )
        elif kind == "cancel":
            waiting = [a for a in arrivals if not a.task.done()]
            if waiting:
                victim = waiting[int(op[1]) % len(waiting)]  # type: ignore[call-overload]
                victim.cancelled = True
                victim.task.cancel()
                await settle()
        elif kind == "saturation":
            h.saturation = float(op[1])  # type: ignore[arg-type]
        elif kind == "notify":
            await h.notify()
        else:
            await h.advance(float(op[1]))  # type: ignore[arg-type]
        check_state()

    # Every waiting request still ends: let the pool drain, then stop.
    h.saturation = 0.0
    for _ in range(200):
        if not controller.stats().queued_requests:
            break
        await h.notify()
    assert controller.stats().queued_requests == 0
    await controller.stop()
    await settle()
    check_state()

    finals = Counter(
        r.labels["outcome"]
        for r in h.observer.records
        if r.metric is catalogue.FLOW_CONTROL_QUEUE_DURATION
    )
    expected: Counter[str] = Counter()
    for arrival in arrivals:
        assert arrival.task.done()
        if arrival.cancelled:
            assert arrival.task.cancelled()
            expected["EvictedContextCancelled"] += 1
            continue
        result = arrival.task.result()
        assert result.outcome is not QueueOutcome.NOT_YET_FINALIZED
        assert (result.error is None) == (result.outcome is QueueOutcome.DISPATCHED)
        expected[result.outcome.label] += 1
        if result.outcome is QueueOutcome.EVICTED_TTL:
            assert arrival.deadline is not None
            finished = arrival.received_at + result.queue_time
            assert arrival.deadline - 1e-9 <= finished <= arrival.deadline + INTERVAL
    assert finals == expected  # exactly one final outcome per request
    stats = controller.stats()
    assert stats.queued_requests == 0
    assert stats.queued_bytes == 0
    assert stats.tracked_deadlines == 0
    assert controller._series == {}
    assert h.timers.pending() == 0


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(setups, operations)
def test_random_traffic_keeps_every_invariant(setup: Setup, ops: list[tuple[object, ...]]) -> None:
    asyncio.run(scenario(setup, ops))
