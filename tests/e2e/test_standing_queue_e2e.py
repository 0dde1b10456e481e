"""standing-queue-detector through a real Envoy, EPP and simulator: once the server has
queued, the EPP holds what the server would only queue, and lets it go when the server's
batch frees.

One simulator runs 2 requests at once (``--max-num-seqs 2``); nothing in the config says
so. "Hogs" are streaming requests long enough to outlast the test, cancelled to free the
server.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterator

import aiohttp
import orjson
import pytest

from tests.simulator import DEFAULT_MODEL
from tests.support.stack import Stack, StackOptions

pytestmark = pytest.mark.e2e

QUEUE_SIZE = "inference_extension_flow_control_queue_size"
POD_QUEUE = "inference_pool_per_pod_queue_size"
SERVER_WAITING = "vllm:num_requests_waiting"

CONFIG = """
featureGates: [flowControl]
plugins:
- type: standing-queue-detector
- type: queue-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins: [{pluginRef: queue-scorer}, {pluginRef: max-score-picker}]
flowControl:
  saturationDetector: {pluginRef: standing-queue-detector}
"""
HOG_TOKENS = 300  # at 100 ms a token: far longer than the test


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    options = StackOptions(
        simulators=1,
        simulator_base_ip="127.0.0.64",
        simulator_args=["--itl-ms", "100", "--max-num-seqs", "2"],
        epp_args=["--config-text", CONFIG],
    )
    with Stack.run(options) as running:
        yield running


def _body(prompt: str, max_tokens: int, *, stream: bool) -> bytes:
    return orjson.dumps(
        {"model": DEFAULT_MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": stream}
    )


async def _gauge(session: aiohttp.ClientSession, url: str, name: str) -> float:
    async with session.get(url) as response:
        text = await response.text()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rpartition(" ")[2])
    return total


async def _until(condition: Callable[[], Awaitable[bool]], *, within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not await condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within:.0f}s waiting for {what}")
        await asyncio.sleep(0.02)


async def _hog(session: aiohttp.ClientSession, stack: Stack, index: int) -> None:
    async with session.post(
        f"{stack.url}/v1/completions", data=_body(f"hog {index}", HOG_TOKENS, stream=True)
    ) as response:
        assert response.status == 200, await response.text()
        await response.read()


async def test_the_epp_holds_what_the_server_would_only_queue(stack: Stack) -> None:
    (server,) = stack.simulator_urls.values()
    server_metrics = f"{server}/metrics"
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def server_waiting(count: int) -> bool:
            return await _gauge(session, server_metrics, SERVER_WAITING) == count

        async def epp_sees_waiting(count: int) -> bool:
            return await _gauge(session, stack.epp_metrics_url, POD_QUEUE) == count

        async def epp_queued(count: int) -> bool:
            return await _gauge(session, stack.epp_metrics_url, QUEUE_SIZE) == count

        # Nothing learned yet: 4 hogs all reach the server, which runs 2 and queues 2.
        hogs = [asyncio.create_task(_hog(session, stack, i)) for i in range(4)]
        try:
            await _until(lambda: server_waiting(2), within=15, what="the server to queue 2")
            await _until(lambda: epp_sees_waiting(2), within=15, what="the EPP to scrape it")

            # Learned: a batch of 2, plus 1 waiting. 4 in flight: the next request waits
            # in the EPP, and the server's queue does not grow.
            request = asyncio.create_task(
                session.post(f"{stack.url}/v1/completions", data=_body("q", 1, stream=False))
            )
            await _until(lambda: epp_queued(1), within=15, what="the EPP to hold a request")
            assert await _gauge(session, server_metrics, SERVER_WAITING) == 2
            assert not request.done()

            # Three hogs leave: the server runs the two it queued and has a slot free; the
            # EPP lets the request go, and the server runs it.
            for hog in hogs[:3]:
                hog.cancel()
            response = await asyncio.wait_for(request, timeout=30)
            assert response.status == 200, await response.text()
            response.release()
            assert await _gauge(session, stack.epp_metrics_url, QUEUE_SIZE) == 0
        finally:
            for hog in hogs:
                hog.cancel()
            for hog in hogs:
                with contextlib.suppress(asyncio.CancelledError, AssertionError):
                    await hog
