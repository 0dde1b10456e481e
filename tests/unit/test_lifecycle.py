"""``app.lifecycle``: services start in order, stop in reverse, and a failed start unwinds."""

from __future__ import annotations

import asyncio
import logging

import pytest

from app.lifecycle import Lifecycle, Service, step, task


class Recorder:
    def __init__(self) -> None:
        self.events: list[str] = []

    def service(self, name: str, *, fail_start: bool = False, fail_stop: bool = False) -> Service:
        async def start() -> None:
            self.events.append(f"start {name}")
            if fail_start:
                raise OSError(f"{name}: cannot listen")

        async def stop() -> None:
            self.events.append(f"stop {name}")
            if fail_stop:
                raise RuntimeError(f"{name}: cannot stop")

        return step(name, start, stop)


async def test_services_start_in_order_and_stop_in_reverse() -> None:
    record = Recorder()
    lifecycle = Lifecycle([record.service(n) for n in ("metrics", "redis", "servers")])
    await lifecycle.start()
    assert lifecycle.started == ["metrics", "redis", "servers"]
    await lifecycle.stop()
    assert record.events == [
        "start metrics",
        "start redis",
        "start servers",
        "stop servers",
        "stop redis",
        "stop metrics",
    ]
    await lifecycle.stop()  # each service stops once
    assert len(record.events) == 6


async def test_a_failed_start_unwinds_what_started_and_raises() -> None:
    record = Recorder()
    lifecycle = Lifecycle(
        [
            record.service("metrics"),
            record.service("redis"),
            record.service("servers", fail_start=True),
            record.service("collectors"),
        ]
    )
    with pytest.raises(OSError, match="servers: cannot listen"):
        await lifecycle.start()
    assert record.events == [
        "start metrics",
        "start redis",
        "start servers",
        "stop redis",
        "stop metrics",
    ]
    assert lifecycle.started == []


async def test_a_failing_stop_is_logged_and_the_others_still_stop(
    caplog: pytest.LogCaptureFixture,
) -> None:
    record = Recorder()
    lifecycle = Lifecycle(
        [record.service("metrics"), record.service("redis", fail_stop=True), record.service("x")]
    )
    await lifecycle.start()
    with caplog.at_level(logging.ERROR, logger="app.lifecycle"):
        await lifecycle.stop()
    assert record.events[3:] == ["stop x", "stop redis", "stop metrics"]
    assert "redis: stopping failed" in caplog.text


async def test_one_service_may_stop_first_and_is_not_stopped_again() -> None:
    record = Recorder()
    lifecycle = Lifecycle([record.service(n) for n in ("servers", "leader-election", "tasks")])
    await lifecycle.start()
    await lifecycle.stop_one("leader-election")
    await lifecycle.stop()
    assert record.events[3:] == ["stop leader-election", "stop tasks", "stop servers"]


async def test_wait_returns_on_stop_and_raises_a_task_that_failed() -> None:
    ran = asyncio.Event()

    async def forever() -> None:
        ran.set()
        await asyncio.Event().wait()

    lifecycle = Lifecycle([task("forever", forever)])
    await lifecycle.start()
    stop = asyncio.Event()
    waiting = asyncio.create_task(lifecycle.wait(stop))
    await ran.wait()
    assert not waiting.done()
    stop.set()
    await waiting
    await lifecycle.stop()

    async def broken() -> None:
        raise ValueError("the endpoint source failed")

    failing = Lifecycle([task("forever", forever), task("source", broken)])
    await failing.start()
    with pytest.raises(ValueError, match="endpoint source failed"):
        await failing.wait(asyncio.Event())
    await failing.stop()
