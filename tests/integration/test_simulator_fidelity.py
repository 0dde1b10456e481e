"""Over HTTP: the simulator's prefix cache, KV blocks, LoRA slots and load behave like vLLM.

Latencies are checked on the simulator's own records (``/sim/stats``, simulated seconds),
not on wall-clock measurements.
"""

from __future__ import annotations

import asyncio
import re
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from tests.integration.test_simulator import (
    CHAT,
    COMPLETIONS,
    DEADLINE,
    REPO_ROOT,
    Sample,
    eventually,
    only,
    parse_metrics,
    post_status,
    scrape,
)
from tests.simulator import DEFAULT_MODEL, ModelServerSimulator, SimulatorConfig

Check = Callable[[], Awaitable[bool]]

H100_PREFILL_OVERHEAD = 0.030
H100_PREFILL_PER_TOKEN = 0.00025


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=DEADLINE)) as client:
        yield client


async def complete(
    session: aiohttp.ClientSession, url: str, prompt: str, **extra: Any
) -> dict[str, Any]:
    body = {"model": DEFAULT_MODEL, "prompt": prompt, "max_tokens": 2, **extra}
    async with session.post(f"{url}{COMPLETIONS}", json=body) as response:
        assert response.status == 200, await response.text()
        payload: dict[str, Any] = await response.json()
        return payload


async def sim_stats(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.get(f"{url}/sim/stats", params={"samples": "1"}) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("application/json")
        document: dict[str, Any] = await response.json()
        return document


def text(tokens: int, seed: str) -> str:
    """A prompt of exactly ``tokens`` tokens whose every block differs per ``seed``."""
    return (seed * (tokens * 4))[: tokens * 4]


def metric(samples: list[Sample], name: str) -> float:
    return only(samples, name).value


async def test_a_repeated_prompt_is_served_from_the_cache(
    session: aiohttp.ClientSession,
) -> None:
    config = SimulatorConfig.h100_8b(time_scale=0.01, enable_prompt_tokens_details=True)
    async with ModelServerSimulator(config, host="127.0.0.2", port=0) as sim:
        prompt = text(500, "abc")  # 31 full blocks and 4 tokens
        first = await complete(session, sim.url, prompt)
        after_first = await sim_stats(session, sim.url)
        second = await complete(session, sim.url, prompt)
        after_second = await sim_stats(session, sim.url)

    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": 496}
    assert after_first["prefix_cache"] == {"queries": 500, "hits": 0, "hit_rate": 0.0}
    assert after_second["prefix_cache"]["queries"] == 1000
    assert after_second["prefix_cache"]["hits"] == 496  # grew by the 31 full blocks
    slow, fast = after_second["ttft_samples"]
    assert slow == pytest.approx(H100_PREFILL_OVERHEAD + 500 * H100_PREFILL_PER_TOKEN)
    assert fast == pytest.approx(H100_PREFILL_OVERHEAD + 4 * H100_PREFILL_PER_TOKEN)
    assert after_second["ttft"]["count"] == 2
    assert after_second["ttft"]["max"] == pytest.approx(slow)


async def test_chat_prompts_sharing_a_system_prompt_partially_hit(
    session: aiohttp.ClientSession,
) -> None:
    config = SimulatorConfig.h100_8b(time_scale=0.0)
    system = {"role": "system", "content": text(250, "you are helpful. ")}  # 1000 chars
    async with ModelServerSimulator(config, host="127.0.0.3", port=0) as sim:
        for question in ("what is a cache?", "why is the sky blue?"):
            messages = [system, {"role": "user", "content": question * 20}]
            body = {"model": DEFAULT_MODEL, "messages": messages, "max_tokens": 1}
            assert await post_status(session, f"{sim.url}{CHAT}", body) == 200
        stats = await sim_stats(session, sim.url)
    # the 1000 common characters hold 15 full 64-character blocks
    assert stats["prefix_cache"]["hits"] == 15 * 16
    # "system\nuser" texts of 1321 and 1401 characters: 331 and 351 tokens
    assert stats["prefix_cache"]["queries"] == 331 + 351
    assert stats["ttft_samples"] == pytest.approx(
        [
            H100_PREFILL_OVERHEAD + 331 * H100_PREFILL_PER_TOKEN,
            H100_PREFILL_OVERHEAD + (351 - 240) * H100_PREFILL_PER_TOKEN,
        ]
    )


async def test_a_full_cache_evicts_the_least_recently_used_prompt(
    session: aiohttp.ClientSession,
) -> None:
    config = SimulatorConfig.h100_8b(time_scale=0.0, num_gpu_blocks=8, block_size=16)
    async with ModelServerSimulator(config, host="127.0.0.4", port=0) as sim:
        prompts = {name: text(65, name) for name in ("aaa", "bbb", "ccc")}  # 5 blocks each
        for name in ("aaa", "bbb", "ccc"):
            await complete(session, sim.url, prompts[name], max_tokens=1)
        before = (await sim_stats(session, sim.url))["prefix_cache"]["hits"]
        await complete(session, sim.url, prompts["ccc"], max_tokens=1)
        after_recent = (await sim_stats(session, sim.url))["prefix_cache"]["hits"]
        await complete(session, sim.url, prompts["aaa"], max_tokens=1)
        stats = await sim_stats(session, sim.url)
    assert before == 0
    assert after_recent - before == 64  # the most recent prompt is still cached
    assert stats["prefix_cache"]["hits"] == after_recent  # the oldest one was evicted
    assert stats["kv_cache"]["evictions"] > 0
    assert stats["kv_cache"]["usage"] == 0.0


async def test_requests_wait_for_blocks_and_an_abort_frees_them(
    session: aiohttp.ClientSession,
) -> None:
    # 8 blocks of 16 tokens; prefill takes long enough to hold them until aborted
    config = SimulatorConfig(num_gpu_blocks=8, block_size=16, prefill_overhead=60.0)
    async with ModelServerSimulator(config, host="127.0.0.5", port=0) as sim:
        url = f"{sim.url}{COMPLETIONS}"

        def post(prompt: str) -> asyncio.Task[int]:
            body = {"model": DEFAULT_MODEL, "prompt": prompt, "max_tokens": 1}
            return asyncio.create_task(post_status(session, url, body))

        async def state_is(running: int, waiting: int, usage: float) -> bool:
            samples = await scrape(session, sim.url)
            return (
                metric(samples, "vllm:num_requests_running") == running
                and metric(samples, "vllm:num_requests_waiting") == waiting
                and metric(samples, "vllm:kv_cache_usage_perc") == pytest.approx(usage)
            )

        holder = post(text(65, "a"))  # 5 blocks
        await eventually(lambda: state_is(1, 0, 5 / 8))
        blocked = post(text(49, "b"))  # 4 blocks: only 3 are free
        await eventually(lambda: state_is(1, 1, 5 / 8))
        holder.cancel()  # the client goes away: the request is aborted
        await eventually(lambda: state_is(1, 0, 4 / 8))
        blocked.cancel()
        await eventually(lambda: state_is(0, 0, 0.0))
        samples = await scrape(session, sim.url)
    aborted = [
        s
        for s in samples
        if s.name == "vllm:request_success_total" and s.labels["finished_reason"] == "abort"
    ]
    assert [s.value for s in aborted] == [2.0]
    await asyncio.gather(holder, blocked, return_exceptions=True)


async def test_max_loras_limits_adapters_in_use(session: aiohttp.ClientSession) -> None:
    config = SimulatorConfig(
        lora_adapters=("sql-lora", "tweet-lora"),
        max_loras=1,
        max_num_seqs=4,
        prefill_overhead=60.0,
    )
    async with ModelServerSimulator(config, host="127.0.0.6", port=0) as sim:
        url = f"{sim.url}{COMPLETIONS}"
        tasks: dict[str, asyncio.Task[int]] = {}

        def lora_state(running: str, waiting: str, num_running: int) -> Check:
            async def check() -> bool:
                samples = await scrape(session, sim.url)
                lora = only(samples, "vllm:lora_requests_info").labels
                return (
                    lora["running_lora_adapters"] == running
                    and lora["waiting_lora_adapters"] == waiting
                    and metric(samples, "vllm:num_requests_running") == num_running
                )

            return check

        arrivals = [
            ("sql-lora", lora_state("sql-lora", "", 1)),
            ("tweet-lora", lora_state("sql-lora", "tweet-lora", 1)),
            # the base-model request passes the waiting adapter request
            (DEFAULT_MODEL, lora_state("sql-lora", "tweet-lora", 2)),
        ]
        for model, reached in arrivals:
            body = {"model": model, "prompt": f"{model} prompt", "max_tokens": 1}
            tasks[model] = asyncio.create_task(post_status(session, url, body))
            await eventually(reached)
        tasks["sql-lora"].cancel()
        await eventually(lora_state("tweet-lora", "", 2))
        stats = await sim_stats(session, sim.url)
        assert stats["lora"] == {"running": ["tweet-lora"], "waiting": []}
        for task in tasks.values():
            task.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)


async def test_concurrent_requests_get_slower_prefill(session: aiohttp.ClientSession) -> None:
    # 10 simulated seconds of prefill last 0.2 s: long enough for all four to overlap
    config = SimulatorConfig(prefill_overhead=10.0, load_alpha=3.0, max_num_seqs=4, time_scale=0.02)
    async with ModelServerSimulator(config, host="127.0.0.7", port=0) as sim:
        await asyncio.gather(
            *(complete(session, sim.url, text(20, seed), max_tokens=1) for seed in "abcd")
        )
        stats = await sim_stats(session, sim.url)
    ttfts = sorted(stats["ttft_samples"])
    # load = 1 + 3 * (running - 1) / 4 for the 1st, 2nd, ... request admitted
    allowed = [10.0, 17.5, 25.0, 32.5]
    assert all(any(t == pytest.approx(a) for a in allowed) for t in ttfts), ttfts
    assert ttfts[0] == pytest.approx(10.0)
    assert ttfts[-1] >= 17.5 - 1e-9  # at least two of them overlapped


async def test_metrics_agree_with_sim_stats(session: aiohttp.ClientSession) -> None:
    config = SimulatorConfig.h100_8b(time_scale=0.0, num_gpu_blocks=512)
    async with ModelServerSimulator(config, name="agree", host="127.0.0.8", port=0) as sim:
        for prompt in (text(300, "x"), text(300, "x"), text(120, "y"), text(300, "x")):
            await complete(session, sim.url, prompt, max_tokens=3)
        samples = await scrape(session, sim.url)
        stats = await sim_stats(session, sim.url)

    assert stats["name"] == "agree"
    assert stats["model"] == DEFAULT_MODEL
    assert stats["time_scale"] == 0.0
    cache = only(samples, "vllm:cache_config_info").labels
    assert int(cache["num_gpu_blocks"]) == stats["num_gpu_blocks"] == 512
    assert int(cache["block_size"]) == stats["block_size"] == 16
    assert metric(samples, "vllm:prefix_cache_queries_total") == stats["prefix_cache"]["queries"]
    assert metric(samples, "vllm:prefix_cache_hits_total") == stats["prefix_cache"]["hits"]
    assert stats["prefix_cache"]["queries"] == 1020
    assert stats["prefix_cache"]["hits"] == 2 * 18 * 16
    assert metric(samples, "vllm:prompt_tokens_total") == stats["tokens"]["prompt"] == 1020
    assert metric(samples, "vllm:generation_tokens_total") == stats["tokens"]["generation"] == 12
    assert metric(samples, "vllm:num_requests_running") == stats["requests"]["running"] == 0
    assert metric(samples, "vllm:num_requests_waiting") == stats["requests"]["waiting"] == 0
    assert metric(samples, "vllm:kv_cache_usage_perc") == stats["kv_cache"]["usage"]
    assert metric(samples, "vllm:num_preemptions_total") == stats["requests"]["preemptions"]
    successes = {
        s.labels["finished_reason"]: s.value
        for s in samples
        if s.name == "vllm:request_success_total"
    }
    assert successes == stats["requests"]["finished"] == {"stop": 0, "length": 4, "abort": 0}
    assert metric(samples, "vllm:time_to_first_token_seconds_count") == stats["ttft"]["count"]
    assert metric(samples, "vllm:time_to_first_token_seconds_sum") == pytest.approx(
        stats["ttft"]["sum"]
    )
    assert stats["ttft"]["sum"] == pytest.approx(sum(stats["ttft_samples"]))
    assert metric(samples, "vllm:inter_token_latency_seconds_count") == stats["itl"]["count"] == 8
    assert stats["itl"]["mean"] == pytest.approx(0.012)
    assert metric(samples, "vllm:e2e_request_latency_seconds_count") == 4
    # only the uncached 300-token prompt (0.105 s) takes longer than 0.1 s
    buckets = {
        s.labels["le"]: s.value
        for s in samples
        if s.name == "vllm:time_to_first_token_seconds_bucket"
    }
    assert buckets["0.1"] + 1 == buckets["0.25"] == buckets["+Inf"] == 4


async def test_too_long_requests_are_rejected(session: aiohttp.ClientSession) -> None:
    config = SimulatorConfig(num_gpu_blocks=4, block_size=16)  # 64 tokens
    async with ModelServerSimulator(config, host="127.0.0.9", port=0) as sim:
        body = {"model": DEFAULT_MODEL, "prompt": text(60, "z"), "max_tokens": 5}
        async with session.post(f"{sim.url}{COMPLETIONS}", json=body) as response:
            assert response.status == 400
            error = (await response.json())["error"]
        assert "maximum context length" in error["message"]
        body["max_tokens"] = 4
        assert await post_status(session, f"{sim.url}{COMPLETIONS}", body) == 200


async def test_command_line_preset_and_flags(session: aiohttp.ClientSession) -> None:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.simulator",
        "--base-ip",
        "127.0.0.10",
        "--port",
        "0",
        "--preset",
        "h100-8b",
        "--time-scale",
        "0",
        "--num-gpu-blocks",
        "64",
        "--prefill-overhead-ms",
        "50",
        "--enable-prompt-tokens-details",
        cwd=REPO_ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert process.stdout is not None
        line = await asyncio.wait_for(process.stdout.readline(), timeout=DEADLINE)
        match = re.fullmatch(rb"ready sim-0 (http://127\.0\.0\.10:\d+)\n", line)
        assert match is not None, line
        url = match.group(1).decode()
        for _ in range(2):
            payload = await complete(session, url, text(100, "cli"))
        assert payload["usage"]["prompt_tokens_details"] == {"cached_tokens": 96}
        stats = await sim_stats(session, url)
        assert stats["num_gpu_blocks"] == 64
        assert stats["ttft_samples"] == pytest.approx(
            [0.050 + 100 * H100_PREFILL_PER_TOKEN, 0.050 + 4 * H100_PREFILL_PER_TOKEN]
        )
        async with session.get(f"{url}/metrics") as response:
            types, samples = parse_metrics(await response.text())
        assert types["vllm:time_to_first_token_seconds"] == "histogram"
        assert only(samples, "vllm:cache_config_info").labels["num_gpu_blocks"] == "64"
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), timeout=DEADLINE) == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
