"""The default's kv-capacity-gate through a real Envoy: a request with a new prefix that does
not fit in its server's KV cache waits in the EPP, and a cache hit sent after it is served
at once instead of queuing behind it at the server."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import aiohttp
import orjson
import pytest

from tests.simulator import DEFAULT_MODEL
from tests.support.stack import Stack, StackOptions, metric_sum

pytestmark = pytest.mark.e2e

HELD = "inference_extension_kv_capacity_gate_held_requests"
WAITED = "inference_extension_kv_capacity_gate_wait_seconds_count"
BLOCK = 64  # characters: one 16-token block for the simulator and for the EPP's index


def _text(tag: str, blocks: int) -> str:
    """``blocks`` whole blocks of text starting with ``tag``."""
    return (tag + " " + "lorem ipsum " * (BLOCK * blocks // 12 + 1))[: BLOCK * blocks]


async def _complete(
    session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int
) -> float:
    """One completion through the gateway; the monotonic time it finished."""
    body = orjson.dumps({"model": DEFAULT_MODEL, "prompt": prompt, "max_tokens": max_tokens})
    async with session.post(f"{url}/v1/completions", data=body) as response:
        await response.read()
        assert response.status == 200, await response.text()
    return time.monotonic()


async def _metric(session: aiohttp.ClientSession, url: str, prefix: str) -> float:
    async with session.get(url) as response:
        text = await response.text()
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix)
    )


async def _until(condition: Callable[[], Awaitable[float]], what: str) -> None:
    """Poll ``condition`` until it is non-zero, for at most 10 s."""
    deadline = time.monotonic() + 10
    while not await condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def test_a_cache_hit_passes_a_new_prefix_waiting_for_kv_room() -> None:
    # One server with 48 KV blocks of 16 tokens; 100 ms per output token.
    options = StackOptions(
        simulators=1,
        simulator_base_ip="127.0.0.41",
        simulator_args=["--num-gpu-blocks", "48", "--itl-ms", "100"],
    )
    with Stack.run(options) as stack:
        group = _text("Group A system prompt", 20)  # 20 blocks, shared
        server_metrics = next(iter(stack.simulator_urls.values())) + "/metrics"
        async with aiohttp.ClientSession() as session:
            # Requests of group A: after the first, each hits the prefix (the gate holds only
            # for servers that recently served cache hits).
            for i in range(8):
                await _complete(session, stack.url, group + _text(f"warm {i}", 1), 1)
            # A long request of group A runs: 21 prompt blocks and its output.
            long_a = asyncio.create_task(
                _complete(session, stack.url, group + _text("long", 1), 20)
            )
            await _until(
                lambda: _metric(session, server_metrics, "vllm:num_requests_running{"),
                "the long request to run",
            )
            # A new prefix of 36 blocks does not fit beside it: it waits in the EPP.
            new_prefix = asyncio.create_task(
                _complete(session, stack.url, _text("Group B system prompt", 36), 1)
            )
            await _until(
                lambda: _metric(session, stack.epp_metrics_url, HELD),
                "the EPP to hold the new prefix",
            )
            # A cache hit sent now is served at once, before the long request ends (behind
            # the new prefix in the server's queue it would wait for the long request).
            hit_done = await asyncio.wait_for(
                _complete(session, stack.url, group + _text("hit", 1), 1), 30
            )
            assert not long_a.done(), "the hit waited for the long request"
            assert not new_prefix.done()
            waiting = await _metric(session, server_metrics, "vllm:num_requests_waiting{")
            assert waiting == 0, "the server queued a request the EPP should hold"
            long_done = await asyncio.wait_for(long_a, 30)
            new_done = await asyncio.wait_for(new_prefix, 30)
            assert hit_done < long_done <= new_done
        assert metric_sum(stack.epp_metrics_url, HELD) == 0
        assert metric_sum(stack.epp_metrics_url, WAITED) >= 1
