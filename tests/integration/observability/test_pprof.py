"""``--enable-pprof``: the profiling pages on the metrics port show where a live process is."""

from __future__ import annotations

import asyncio
import hashlib
import threading
from collections.abc import AsyncIterator

import aiohttp
import pytest

from adapters.prometheus.exporter import MetricsServer, PrometheusObserver
from app.profiling import Profiler, pprof_pages


@pytest.fixture
async def port() -> AsyncIterator[int]:
    server = MetricsServer(
        PrometheusObserver().registry,
        host="127.0.0.1",
        port=0,
        pages=pprof_pages(Profiler(hz=200)),
    )
    await server.start()
    try:
        yield server.bound_port
    finally:
        await server.stop()


async def _get(port: int, path: str) -> tuple[int, str]:
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{port}{path}") as response,
    ):
        return response.status, await response.text()


async def _parked_in_a_recognisable_place(event: asyncio.Event) -> None:
    await event.wait()


def _burn_cpu_in_a_recognisable_place(stop: threading.Event) -> None:
    while not stop.is_set():
        hashlib.sha256(b"x" * 4096).digest()


async def test_the_index_and_the_task_stacks(port: int) -> None:
    status, index = await _get(port, "/debug/pprof/")
    assert status == 200
    assert "profile?seconds=N" in index
    event = asyncio.Event()
    task = asyncio.create_task(_parked_in_a_recognisable_place(event), name="parked-task")
    await asyncio.sleep(0)
    try:
        status, text = await _get(port, "/debug/pprof/tasks")
    finally:
        event.set()
        await task
    assert status == 200
    assert "task parked-task" in text
    assert "_parked_in_a_recognisable_place" in text


async def test_thread_stacks_and_a_sampled_cpu_profile(port: int) -> None:
    stop = threading.Event()
    burner = threading.Thread(target=_burn_cpu_in_a_recognisable_place, args=(stop,), name="burner")
    burner.start()
    try:
        status, threads = await _get(port, "/debug/pprof/goroutine")
        assert status == 200
        assert "thread burner" in threads
        assert "_burn_cpu_in_a_recognisable_place" in threads
        profile, second = await asyncio.gather(
            _get(port, "/debug/pprof/profile?seconds=0.5"),
            _get_later(port, "/debug/pprof/profile?seconds=0.5"),
        )
    finally:
        stop.set()
        burner.join()
    status, text = profile
    assert status == 200
    lines = text.splitlines()
    assert lines[0].startswith("# sampled CPU profile: 0.5s")
    hot = [line for line in lines[1:] if line.startswith("burner;")]
    assert hot, lines[:5]
    assert "_burn_cpu_in_a_recognisable_place" in hot[0]
    assert int(hot[0].rsplit(" ", 1)[1]) > 10  # at 200 Hz over 0.5 s
    assert second[0] == 409  # one profile at a time


async def _get_later(port: int, path: str) -> tuple[int, str]:
    await asyncio.sleep(0.1)
    return await _get(port, path)


@pytest.mark.parametrize("seconds", ["0", "-1", "61", "x"])
async def test_a_profile_length_out_of_bounds_is_refused(port: int, seconds: str) -> None:
    status, text = await _get(port, f"/debug/pprof/profile?seconds={seconds}")
    assert status == 400
    assert "seconds" in text
