"""The controller on the real asyncio loop and clock (``LoopTimers``), with tiny TTLs and
deadline-bounded waits."""

from __future__ import annotations

import asyncio
import time

import pytest

from domain.flowcontrol import (
    FlowControlConfig,
    FlowController,
    FlowKey,
    FlowRequest,
    FlowResult,
    QueueOutcome,
)

WAIT = 5.0  # upper bound on any wait below; the tests finish in milliseconds


class Pool:
    def __init__(self, saturation: float) -> None:
        self.saturation = saturation

    def __call__(self) -> float:
        return self.saturation


def request(priority: int = 0, ttl: float = 0.0, flow: str = "f") -> FlowRequest:
    return FlowRequest(
        request_id="r",
        flow_key=FlowKey(flow, priority),
        byte_size=10,
        received_at=time.monotonic(),
        ttl=ttl,
    )


async def started(pool: Pool, config: FlowControlConfig | None = None) -> FlowController:
    controller = FlowController(config or FlowControlConfig(), saturation=pool)
    controller.start()
    return controller


async def waiting(controller: FlowController, count: int) -> None:
    deadline = time.monotonic() + WAIT
    while controller.stats().queued_requests != count:
        assert time.monotonic() < deadline, "requests never queued"
        await asyncio.sleep(0)


async def test_real_ttl_expires_close_to_the_deadline() -> None:
    pool = Pool(1.0)
    controller = await started(pool)
    ttl = 0.02
    began = time.monotonic()
    result = await asyncio.wait_for(controller.enqueue_and_wait(request(ttl=ttl)), WAIT)
    elapsed = time.monotonic() - began
    assert result.outcome is QueueOutcome.EVICTED_TTL
    # The TTL runs from the request's receipt (after ``began``), the queue time from the
    # enqueue (later still): not evicted before the TTL, and soon after it.
    assert ttl <= elapsed
    assert 0 < result.queue_time <= elapsed
    assert result.queue_time < ttl + 0.5  # generous for loaded CI machines
    assert controller.stats().queued_requests == 0
    await controller.stop()


async def test_real_notify_dispatches_waiting_requests() -> None:
    pool = Pool(1.0)
    controller = await started(pool, FlowControlConfig(max_dispatch_interval=3600.0))
    tasks = [asyncio.create_task(controller.enqueue_and_wait(request())) for _ in range(5)]
    await waiting(controller, 5)
    pool.saturation = 0.1
    controller.notify()
    results = await asyncio.wait_for(asyncio.gather(*tasks), WAIT)
    assert [r.outcome for r in results] == [QueueOutcome.DISPATCHED] * 5
    await controller.stop()


async def test_real_fallback_tick_notices_a_saturation_drop_without_notify() -> None:
    pool = Pool(1.0)
    controller = await started(pool, FlowControlConfig(max_dispatch_interval=0.01))
    task = asyncio.create_task(controller.enqueue_and_wait(request()))
    await waiting(controller, 1)
    pool.saturation = 0.0
    result = await asyncio.wait_for(task, WAIT)
    assert result.outcome is QueueOutcome.DISPATCHED
    await controller.stop()


async def test_real_timeout_of_the_caller_cleans_up() -> None:
    pool = Pool(1.0)
    controller = await started(pool, FlowControlConfig(default_request_ttl=60.0))
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(controller.enqueue_and_wait(request()), 0.01)
    stats = controller.stats()
    assert stats.queued_requests == 0
    assert stats.queued_bytes == 0
    assert stats.tracked_deadlines == 0
    await controller.stop()


async def test_real_stop_releases_every_waiter() -> None:
    pool = Pool(2.0)
    controller = await started(pool)
    tasks = [
        asyncio.create_task(controller.enqueue_and_wait(request(priority=p))) for p in (1, 0, -1)
    ]
    await waiting(controller, 3)
    await controller.stop()
    results: list[FlowResult] = await asyncio.wait_for(asyncio.gather(*tasks), WAIT)
    assert {r.outcome for r in results} == {QueueOutcome.REJECTED_OTHER}
