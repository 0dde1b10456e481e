"""The simulated engine: TTFT and ITL formulas, load factor, queueing, preemption, records."""

from __future__ import annotations

import asyncio
from contextlib import aclosing

import pytest

from tests.simulator.config import SimulatorConfig
from tests.simulator.engine import SimulatedEngine, filler_text
from tests.simulator.tokens import PromptTokens

DEADLINE = 10.0


def text_prompt(tokens: int, fill: str = "p") -> PromptTokens:
    return PromptTokens.from_text(fill * tokens * 4)


async def run(engine: SimulatedEngine, name: str, prompt: PromptTokens, max_tokens: int) -> str:
    state = engine.new_request(name, engine.config.model_name, prompt, max_tokens)
    async with aclosing(engine.generate(state)) as tokens:
        return "".join([token async for token in tokens])


async def run_all(engine: SimulatedEngine, *jobs: tuple[PromptTokens, int]) -> list[str]:
    """Start every job at once (in order) and wait for all of them."""
    runs = (run(engine, f"r{i}", prompt, n) for i, (prompt, n) in enumerate(jobs))
    return await asyncio.wait_for(asyncio.gather(*runs), DEADLINE)


async def test_ttft_is_prefill_overhead_plus_uncached_tokens() -> None:
    engine = SimulatedEngine(SimulatorConfig.h100_8b(time_scale=0.0))
    assert await run(engine, "first", text_prompt(1000), 5) == filler_text(5)
    assert await run(engine, "second", text_prompt(1000), 5) == filler_text(5)
    stats = engine.stats(with_samples=True)
    # 1000 tokens, then 992 of them (62 full blocks) from the cache
    assert stats.ttft.samples == pytest.approx([0.030 + 1000 * 0.00025, 0.030 + 8 * 0.00025])
    assert stats.prefix_cache_queries_total == 2000
    assert stats.prefix_cache_hits_total == 992
    assert stats.itl.count == 8
    assert stats.itl.sum == pytest.approx(8 * 0.012)
    assert stats.e2e_latency.samples == pytest.approx([0.280 + 4 * 0.012, 0.032 + 4 * 0.012])
    assert stats.prompt_tokens_total == 2000
    assert stats.generation_tokens_total == 10
    assert stats.request_success_total == {"stop": 0, "length": 2, "abort": 0}
    assert stats.kv_cache_usage == 0.0
    assert stats.kv_cached_blocks == 62


async def test_a_slowed_server_takes_that_much_longer_to_prefill_and_decode() -> None:
    engine = SimulatedEngine(SimulatorConfig.h100_8b(time_scale=0.0).slowed(2.0))
    await run(engine, "only", text_prompt(1000), 5)
    stats = engine.stats(with_samples=True)
    assert stats.ttft.samples == pytest.approx([2 * (0.030 + 1000 * 0.00025)])
    assert stats.itl.sum == pytest.approx(4 * 2 * 0.012)


def test_a_slowdown_must_be_a_finite_positive_factor() -> None:
    for factor in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="slowdown"):
            SimulatorConfig().slowed(factor)


async def test_token_id_prompts_hit_the_cache_too() -> None:
    engine = SimulatedEngine(SimulatorConfig.h100_8b(time_scale=0.0))
    ids = PromptTokens.from_ids(tuple(range(40)))
    await run(engine, "a", ids, 1)
    await run(engine, "b", ids, 1)
    assert engine.stats().prefix_cache_hits_total == 32


async def test_load_factor_slows_prefill_and_decode_of_a_busy_batch() -> None:
    config = SimulatorConfig(
        prefill_overhead=1.0, itl=1.0, load_alpha=1.0, max_num_seqs=4, time_scale=0.02
    )
    alone = SimulatedEngine(config)
    await run_all(alone, (text_prompt(10), 2))
    assert alone.stats(with_samples=True).ttft.samples == pytest.approx([1.0])
    assert alone.stats().itl.max == pytest.approx(1.0)

    busy = SimulatedEngine(config)
    await run_all(busy, *[(text_prompt(10, fill), 2) for fill in "abcd"])
    stats = busy.stats(with_samples=True)
    # admitted together: the n-th one runs in a batch of n, load = 1 + (n - 1) / 4
    assert sorted(stats.ttft.samples or ()) == pytest.approx([1.0, 1.25, 1.5, 1.75])
    assert stats.itl.max == pytest.approx(1.75)
    assert stats.itl.sum / stats.itl.count > 1.0


async def test_waiting_time_counts_in_ttft() -> None:
    config = SimulatorConfig(prefill_overhead=1.0, itl=1.0, max_num_seqs=1, time_scale=0.01)
    engine = SimulatedEngine(config)
    await run_all(engine, (text_prompt(10, "a"), 3), (text_prompt(10, "b"), 3))
    stats = engine.stats(with_samples=True)
    first, second = stats.ttft.samples or ()
    assert first == pytest.approx(1.0)
    # the second waited for the whole first request (3 simulated seconds) at least
    assert second >= 1.0 + 3.0 * 0.99
    assert stats.queue_time.count == 2
    assert stats.queue_time.max >= 3.0 * 0.99


async def test_requests_wait_for_kv_blocks() -> None:
    config = SimulatorConfig(
        prefill_overhead=1.0, block_size=16, num_gpu_blocks=10, time_scale=0.01
    )
    engine = SimulatedEngine(config)
    big = engine.new_request("big", config.model_name, text_prompt(8 * 16, "b"), 1)
    small = engine.new_request("small", config.model_name, text_prompt(3 * 16, "s"), 1)
    async with aclosing(engine.generate(big)) as big_tokens:
        first = asyncio.ensure_future(anext(big_tokens))
        await asyncio.sleep(0)  # let it be admitted
        async with aclosing(engine.generate(small)) as small_tokens:
            second = asyncio.ensure_future(anext(small_tokens))
            await asyncio.sleep(0)
            stats = engine.stats()
            assert (stats.num_running, stats.num_waiting) == (1, 1)
            assert stats.kv_cache_usage == pytest.approx(0.8)
            await asyncio.wait_for(first, DEADLINE)
            # the first token is out; the big request ends once its consumer returns
            with pytest.raises(StopAsyncIteration):
                await anext(big_tokens)
            await asyncio.wait_for(second, DEADLINE)
            assert engine.stats().kv_cache_usage == pytest.approx(0.3)


async def test_growth_preempts_and_every_request_still_completes() -> None:
    config = SimulatorConfig(
        itl=1.0, block_size=4, num_gpu_blocks=8, max_model_len=32, time_scale=0.001
    )
    engine = SimulatedEngine(config)
    texts = await run_all(engine, (text_prompt(8, "a"), 16), (text_prompt(8, "b"), 16))
    assert texts == [filler_text(16)] * 2
    stats = engine.stats()
    assert stats.preemptions_total >= 1
    assert stats.request_success_total["length"] == 2
    assert stats.generation_tokens_total == 32
    assert stats.kv_used_blocks == 0
    # the preempted request found its prompt blocks again when readmitted
    assert stats.prefix_cache_hits_total >= 4


async def test_abandoned_requests_count_as_aborted_and_free_their_blocks() -> None:
    engine = SimulatedEngine(SimulatorConfig(itl=1.0, time_scale=0.01))
    state = engine.new_request("r", engine.config.model_name, text_prompt(40), 10)
    async with aclosing(engine.generate(state)) as tokens:
        await anext(tokens)
        assert engine.stats().kv_used_blocks == 3
    stats = engine.stats()
    assert stats.request_success_total["abort"] == 1
    assert stats.kv_used_blocks == 0
    assert stats.num_running == 0


def test_requests_longer_than_the_model_are_refused() -> None:
    engine = SimulatedEngine(SimulatorConfig(block_size=16, num_gpu_blocks=4))
    engine.new_request("fits", "m", text_prompt(60), 4)
    with pytest.raises(ValueError, match="maximum model length 64"):
        engine.new_request("too-long", "m", text_prompt(60), 5)


def test_lora_requests_are_marked() -> None:
    engine = SimulatedEngine(SimulatorConfig(lora_adapters=("sql",)))
    assert engine.new_request("a", "sql", text_prompt(1), 1).lora_adapter == "sql"
    assert engine.new_request("b", "other", text_prompt(1), 1).lora_adapter is None


async def test_mixed_workload_under_pressure_leaves_a_consistent_engine() -> None:
    """Shared prefixes, LoRA adapters, a tiny cache and aborts: nothing leaks or hangs."""
    config = SimulatorConfig(
        itl=1.0,
        prefill_overhead=1.0,
        prefill_per_token=0.01,
        load_alpha=2.0,
        block_size=4,
        num_gpu_blocks=16,
        max_num_seqs=6,
        lora_adapters=("a", "b", "c"),
        max_loras=2,
        time_scale=0.0005,
    )
    engine = SimulatedEngine(config)
    models = [config.model_name, "a", "b", "c"]

    async def one(index: int) -> int:
        prompt = PromptTokens.from_text("shared-prefix-" * (index % 3) + f"{index:04d}" * 5)
        state = engine.new_request(f"r{index}", models[index % 4], prompt, 3 + index % 12)
        produced = 0
        async with aclosing(engine.generate(state)) as tokens:
            async for _ in tokens:
                produced += 1
                if index % 11 == 0 and produced == 2:
                    break  # the client goes away
        return produced

    produced = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(60))), DEADLINE)
    stats = engine.stats()
    aborted = sum(1 for i in range(60) if i % 11 == 0 and 3 + i % 12 > 2)
    assert stats.request_success_total == {"stop": 0, "length": 60 - aborted, "abort": aborted}
    assert stats.generation_tokens_total == sum(produced)
    assert (stats.num_running, stats.num_waiting, stats.kv_used_blocks) == (0, 0, 0)
    assert stats.running_lora_adapters == stats.waiting_lora_adapters == ()
    assert stats.ttft.count == 60
    assert 0 < stats.prefix_cache_hits_total < stats.prefix_cache_queries_total
    assert stats.preemptions_total > 0
    assert stats.kv_evictions > 0
