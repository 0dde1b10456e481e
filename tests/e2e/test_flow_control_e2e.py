"""Flow control through a real Envoy, EPP and simulators: queueing, TTL, displacement.

The saturation signal is deterministic: the ``concurrency-detector`` counts the EPP's own
in-flight requests, with ``maxConcurrency`` 2 on each of 2 simulators, so 4 in-flight
requests saturate the pool the moment they are scheduled and capacity frees the moment
one ends. "Hogs" are streaming requests long enough to outlast a test; a test frees
capacity by cancelling them (the client goes away, Envoy resets the request).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import aiohttp
import orjson
import pytest

from tests.simulator import DEFAULT_MODEL
from tests.support.stack import Stack, StackOptions, trusted_header

pytestmark = pytest.mark.e2e

# Set by the test stack's trusted filter (Envoy strips a client's x-gateway-* headers).
OBJECTIVE_HEADER = trusted_header("x-gateway-inference-objective")
QUEUE_SIZE = "inference_extension_flow_control_queue_size"
DISPLACED = "inference_extension_flow_control_displaced_total"
QUEUE_DURATION_COUNT = "inference_extension_flow_control_request_queue_duration_seconds_count"

TTL = 3.0
CONFIG = f"""
featureGates: [flowControl]
plugins:
- type: concurrency-detector
  parameters: {{maxConcurrency: 2}}
- type: queue-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins: [{{pluginRef: queue-scorer}}, {{pluginRef: max-score-picker}}]
saturationDetector: {{pluginRef: concurrency-detector}}
flowControl:
  maxRequests: 3
  defaultRequestTTL: {TTL:g}s
"""

OBJECTIVES = """
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceObjective
metadata: {name: high}
spec: {priority: 10}
---
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceObjective
metadata: {name: batch}
spec: {priority: -1}
"""

#: Saturation: 2 endpoints x maxConcurrency 2.
POOL_CAPACITY = 4
#: A hog generates this many tokens at 100 ms each: far longer than any test.
HOG_TOKENS = 300


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    objectives: Path = tmp_path_factory.mktemp("flowcontrol") / "objectives.yaml"
    objectives.write_text(OBJECTIVES)
    options = StackOptions(
        simulators=2,
        simulator_base_ip="127.0.0.60",
        simulator_args=["--itl-ms", "100"],
        epp_args=["--config-text", CONFIG, "--static-objectives", str(objectives)],
    )
    with Stack.run(options) as running:
        yield running


# --- helpers -------------------------------------------------------------------------------


def _body(prompt: str, max_tokens: int, *, stream: bool = False) -> bytes:
    return orjson.dumps(
        {"model": DEFAULT_MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": stream}
    )


async def _request(
    session: aiohttp.ClientSession, stack: Stack, objective: str, prompt: str, max_tokens: int = 1
) -> tuple[int, str]:
    async with session.post(
        f"{stack.url}/v1/completions",
        data=_body(prompt, max_tokens),
        headers={OBJECTIVE_HEADER: objective},
    ) as response:
        return response.status, await response.text()


async def _metric(session: aiohttp.ClientSession, stack: Stack, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    async with session.get(stack.epp_metrics_url) as response:
        text = await response.text()
    wanted = [f'{key}="{value}"' for key, value in labels.items()]
    total = 0.0
    for line in text.splitlines():
        if not (line.startswith(name + "{") or line.startswith(name + " ")):
            continue
        series, _, value = line.rpartition(" ")
        if all(label in series for label in wanted):
            total += float(value)
    return total


async def _until(condition: Callable[[], Awaitable[bool]], *, within: float, what: str) -> float:
    """Poll ``condition`` until true; returns the time it took. Fails after ``within`` s."""
    start = time.monotonic()
    while not await condition():
        if time.monotonic() - start > within:
            raise AssertionError(f"timed out after {within:.0f}s waiting for {what}")
        await asyncio.sleep(0.02)
    return time.monotonic() - start


async def _queued(
    session: aiohttp.ClientSession, stack: Stack, priority: int | None = None
) -> float:
    if priority is None:
        return await _metric(session, stack, QUEUE_SIZE)
    return await _metric(session, stack, QUEUE_SIZE, priority=str(priority))


class Hogs:
    """Long streaming ``high`` requests holding the pool saturated until released."""

    def __init__(self, session: aiohttp.ClientSession, stack: Stack) -> None:
        self._session = session
        self._stack = stack
        self._tasks: list[asyncio.Task[None]] = []
        self._started: list[asyncio.Event] = []

    async def _hog(self, index: int, started: asyncio.Event) -> None:
        async with self._session.post(
            f"{self._stack.url}/v1/completions",
            data=_body(f"hog {index}", HOG_TOKENS, stream=True),
            headers={OBJECTIVE_HEADER: "high"},
        ) as response:
            assert response.status == 200, await response.text()
            started.set()
            await response.read()

    async def saturate(self, count: int = POOL_CAPACITY) -> None:
        """Start ``count`` hogs; returns once each is streaming (in flight in the EPP)."""
        for _ in range(count):
            started = asyncio.Event()
            task = asyncio.create_task(self._hog(len(self._tasks), started))
            self._tasks.append(task)
            self._started.append(started)
        deadline = time.monotonic() + 10
        for task, started in zip(self._tasks, self._started, strict=True):
            waiter = asyncio.create_task(started.wait())
            await asyncio.wait(
                {task, waiter},
                timeout=max(0.0, deadline - time.monotonic()),
                return_when=asyncio.FIRST_COMPLETED,
            )
            waiter.cancel()
            if task.done():
                task.result()  # raises what went wrong
            assert started.is_set(), "a hog never started streaming"

    async def release(self, count: int | None = None) -> None:
        """Cancel ``count`` (default: all remaining) hogs: their clients go away."""
        victims = [t for t in self._tasks if not t.done()][:count]
        for task in victims:
            task.cancel()
        for task in victims:
            with contextlib.suppress(asyncio.CancelledError):
                await task


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as s:
        yield s


@pytest.fixture
async def hogs(session: aiohttp.ClientSession, stack: Stack) -> AsyncIterator[Hogs]:
    """Hogs for one test; afterwards all are released and the queues are empty again."""
    hogs = Hogs(session, stack)
    try:
        yield hogs
    finally:
        await hogs.release()
        await _until(lambda: _zero(_queued(session, stack)), within=TTL + 2, what="empty queues")


async def _zero(value: Awaitable[float]) -> bool:
    return await value == 0


# --- tests ---------------------------------------------------------------------------------


async def test_request_waits_in_queue_while_saturated_and_succeeds_when_capacity_frees(
    stack: Stack, session: aiohttp.ClientSession, hogs: Hogs
) -> None:
    await hogs.saturate()
    waiting = asyncio.create_task(_request(session, stack, "high", "fifth"))
    await _until(
        lambda: _positive(_queued(session, stack, 10)),
        within=5,
        what="the fifth request to be queued at priority 10",
    )
    assert not waiting.done(), "the fifth request was not held while the pool was saturated"

    await hogs.release(1)
    status, text = await asyncio.wait_for(waiting, timeout=5)
    assert status == 200, text
    assert await _queued(session, stack, 10) == 0


async def test_sheddable_request_times_out_in_queue_with_503(
    stack: Stack, session: aiohttp.ClientSession, hogs: Hogs
) -> None:
    await hogs.saturate()
    start = time.monotonic()
    status, text = await asyncio.wait_for(
        _request(session, stack, "batch", "patient batch"), timeout=TTL + 5
    )
    elapsed = time.monotonic() - start
    assert status == 503, text
    assert text.startswith("inference error: ServiceUnavailable - request timed out in queue"), text
    assert elapsed >= TTL - 0.5, f"ended after {elapsed:.2f}s, before its {TTL}s TTL"


async def test_high_priority_arrival_displaces_newest_batch_request(
    stack: Stack, session: aiohttp.ClientSession, hogs: Hogs
) -> None:
    await hogs.saturate()
    displaced_before = await _metric(session, stack, DISPLACED, priority="-1")
    batch: list[asyncio.Task[tuple[int, str]]] = []
    for i in range(3):  # one at a time, so "newest" is well defined; fills maxRequests
        batch.append(asyncio.create_task(_request(session, stack, "batch", f"batch {i}")))

        async def enough(n: int = i + 1) -> bool:
            return await _at_least(_queued(session, stack, -1), n)

        await _until(
            enough,
            within=5,
            what=f"{i + 1} batch request(s) queued",
        )

    high = asyncio.create_task(_request(session, stack, "high", "urgent"))
    status, text = await asyncio.wait_for(batch[2], timeout=5)
    assert status == 429, text
    assert text.startswith("inference error: ResourceExhausted"), text
    assert "displaced" in text, text
    assert not batch[0].done(), "an older batch request was displaced"
    assert not batch[1].done(), "an older batch request was displaced"
    assert await _metric(session, stack, DISPLACED, priority="-1") == displaced_before + 1
    assert await _queued(session, stack, 10) == 1
    assert await _queued(session, stack, -1) == 2

    await hogs.release()
    status, text = await asyncio.wait_for(high, timeout=5)
    assert status == 200, text
    # The older batch requests go once the pool has room, unless their TTL ran out first.
    for task in batch[:2]:
        status, text = await asyncio.wait_for(task, timeout=TTL + 5)
        assert status in (200, 503), text


async def test_client_that_gives_up_leaves_the_queue(
    stack: Stack, session: aiohttp.ClientSession, hogs: Hogs
) -> None:
    await hogs.saturate()
    cancelled_before = await _metric(
        session, stack, QUEUE_DURATION_COUNT, outcome="EvictedContextCancelled"
    )
    impatient = asyncio.create_task(_request(session, stack, "high", "impatient"))
    await _until(
        lambda: _positive(_queued(session, stack, 10)), within=5, what="the request queued"
    )
    impatient.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await impatient
    # Well before its TTL would have removed it.
    await _until(
        lambda: _zero(_queued(session, stack, 10)), within=TTL - 1, what="the queue to empty"
    )
    await _until(
        lambda: _at_least(
            _metric(session, stack, QUEUE_DURATION_COUNT, outcome="EvictedContextCancelled"),
            cancelled_before + 1,
        ),
        within=2,
        what="the cancellation to be counted",
    )


async def test_queue_drains_when_load_drops(
    stack: Stack, session: aiohttp.ClientSession, hogs: Hogs
) -> None:
    await hogs.saturate()
    queued = []
    for i in range(3):
        queued.append(asyncio.create_task(_request(session, stack, "high", f"queued {i}")))
    await _until(
        lambda: _at_least(_queued(session, stack, 10), 3), within=5, what="3 requests queued"
    )

    await hogs.release()
    results = await asyncio.wait_for(asyncio.gather(*queued), timeout=10)
    assert [status for status, _ in results] == [200, 200, 200], results
    await _until(lambda: _zero(_queued(session, stack)), within=2, what="empty queues")


async def _positive(value: Awaitable[float]) -> bool:
    return await value > 0


async def _at_least(value: Awaitable[float], n: float) -> bool:
    return await value >= n
