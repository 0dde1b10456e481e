"""The simulator's scheduler: FIFO slots, LoRA limit, KV blocks, prefix hits, preemption."""

from __future__ import annotations

from tests.simulator.kvcache import KVCache, block_hashes
from tests.simulator.scheduler import Phase, RequestState, Scheduler
from tests.simulator.tokens import PromptTokens

BLOCK = 16


def scheduler(*, num_blocks: int = 64, max_num_seqs: int = 8, max_loras: int = 1) -> Scheduler:
    return Scheduler(
        max_num_seqs=max_num_seqs,
        max_loras=max_loras,
        kv_cache=KVCache(num_blocks=num_blocks, block_size=BLOCK),
    )


def request(
    name: str, tokens: int, *, text: str | None = None, lora: str | None = None
) -> RequestState:
    """A request of ``tokens`` prompt tokens (``text`` repeated, default: its name)."""
    body = ((text or name) * tokens * 4)[: tokens * 4]
    prompt = PromptTokens.from_text(body)
    return RequestState(
        request_id=name,
        model=lora or "base",
        prompt=prompt,
        max_tokens=64,
        lora_adapter=lora,
        block_hashes=block_hashes(lora or "base", prompt.full_blocks(BLOCK)),
    )


def phase(state: RequestState) -> Phase:
    return state.phase


def names(states: tuple[RequestState, ...]) -> list[str]:
    return [state.request_id for state in states]


def test_slots_are_granted_in_arrival_order() -> None:
    sched = scheduler(max_num_seqs=2)
    a, b, c, d = (request(name, 10) for name in "abcd")
    for state in (a, b, c, d):
        sched.add(state, 0.0)
    assert names(sched.running) == ["a", "b"]
    assert names(sched.waiting) == ["c", "d"]
    assert phase(c) is Phase.WAITING
    sched.finish(b, 1.0)
    assert names(sched.running) == ["a", "c"]
    assert phase(c) is Phase.RUNNING
    assert c.admitted_at == 1.0
    assert c.enqueued_at == 0.0
    assert b.phase is Phase.FINISHED
    sched.finish(d, 2.0)  # abandoned while waiting
    assert sched.num_waiting == 0


def test_requests_wait_for_blocks_behind_the_head_of_the_queue() -> None:
    sched = scheduler(num_blocks=10)
    big = request("big", 8 * BLOCK)  # 8 blocks
    medium = request("medium", 4 * BLOCK)  # 4 blocks: does not fit next to big
    small = request("small", 1)  # 1 block would fit, but waits behind medium
    for state in (big, medium, small):
        sched.add(state, 0.0)
    assert names(sched.running) == ["big"]
    assert names(sched.waiting) == ["medium", "small"]
    assert sched.kv_cache.num_used == 8
    sched.finish(big, 1.0)
    assert names(sched.running) == ["medium", "small"]
    assert sched.kv_cache.num_used == 5


def test_admission_reuses_the_longest_cached_prefix() -> None:
    sched = scheduler()
    first = request("first", 100, text="p")  # 6 full blocks, 7 blocks in all
    sched.add(first, 0.0)
    assert first.cached_tokens == 0
    assert len(first.blocks) == 7
    sched.finish(first, 1.0)

    again = request("again", 100, text="p")
    sched.add(again, 2.0)
    assert again.cached_tokens == 96
    assert again.first_cached_tokens == 96
    assert sched.prefix_cache_queries == 200
    assert sched.prefix_cache_hits == 96
    assert sched.kv_cache.num_used == 7  # 6 shared blocks + 1 new

    # a prompt of exactly 4 blocks: the last one is recomputed, never a hit
    exact = request("exact", 4 * BLOCK, text="p")
    sched.add(exact, 3.0)
    assert exact.cached_tokens == 3 * BLOCK


def test_partially_shared_prefix_hits_the_common_blocks() -> None:
    sched = scheduler()
    common = "c" * (2 * BLOCK * 4 + 10)  # two full blocks and a bit
    first = request("first", 100, text=common + "x" * 400)
    second = request("second", 100, text=common + "y" * 400)
    sched.add(first, 0.0)
    sched.add(second, 0.0)  # while the first still runs: its blocks are shared
    assert second.cached_tokens == 2 * BLOCK
    assert [block.ref_count for block in second.blocks[:3]] == [2, 2, 1]


def test_lora_requests_beyond_max_loras_are_skipped_not_blocking() -> None:
    sched = scheduler(max_loras=1)
    a1 = request("a1", 10, lora="adapter-a")
    b1 = request("b1", 10, lora="adapter-b")
    base = request("base", 10)
    a2 = request("a2", 10, lora="adapter-a")
    for state in (a1, b1, base, a2):
        sched.add(state, 0.0)
    assert names(sched.running) == ["a1", "base", "a2"]
    assert names(sched.waiting) == ["b1"]
    sched.finish(a1, 1.0)
    assert names(sched.waiting) == ["b1"]  # adapter-a is still in use by a2
    sched.finish(a2, 2.0)
    assert names(sched.running) == ["base", "b1"]


def test_skipped_lora_requests_keep_their_queue_order() -> None:
    sched = scheduler(max_loras=1, max_num_seqs=2)
    sched.add(request("a", 10, lora="adapter-a"), 0.0)
    for name in ("b1", "c1", "b2"):
        sched.add(request(name, 10, lora=f"adapter-{name[0]}"), 0.0)
    assert names(sched.waiting) == ["b1", "c1", "b2"]


def test_prefix_cache_is_per_adapter() -> None:
    sched = scheduler(max_loras=2)
    sched.add(request("base", 100, text="p"), 0.0)
    lora = request("lora", 100, text="p", lora="adapter")
    sched.add(lora, 0.0)
    assert lora.cached_tokens == 0


def test_decode_growth_preempts_the_most_recently_admitted_request() -> None:
    sched = scheduler(num_blocks=6)
    old = request("old", 2 * BLOCK, text="o")  # 2 blocks
    new = request("new", 4 * BLOCK - 1, text="n")  # 4 blocks, 3 of them full
    sched.add(old, 0.0)
    sched.add(new, 0.0)
    assert sched.kv_cache.num_free == 0

    old.generated_tokens = 1  # 33 tokens now: a third block is needed
    assert sched.grow(old, 5.0)
    assert len(old.blocks) == 3
    assert names(sched.running) == ["old"]
    assert names(sched.waiting) == ["new"]
    assert phase(new) is Phase.WAITING
    assert new.blocks == []
    assert new.num_preemptions == 1
    assert new.enqueued_at == 5.0
    assert sched.preemptions == 1

    sched.finish(old, 6.0)
    assert phase(new) is Phase.RUNNING
    assert new.epoch == 2
    assert new.cached_tokens == 3 * BLOCK  # its prompt blocks survived the preemption


def test_a_request_preempts_itself_when_it_is_the_most_recent() -> None:
    sched = scheduler(num_blocks=4)
    old = request("old", 2 * BLOCK, text="o")
    new = request("new", 2 * BLOCK, text="n")
    sched.add(old, 0.0)
    sched.add(new, 0.0)
    new.generated_tokens = 1
    assert not sched.grow(new, 1.0)
    assert new.phase is Phase.WAITING
    assert names(sched.running) == ["old"]
    assert names(sched.waiting) == ["new"]


def test_a_preempted_request_goes_to_the_front_of_the_queue() -> None:
    sched = scheduler(num_blocks=4, max_num_seqs=2)
    first = request("first", 2 * BLOCK, text="f")
    second = request("second", 2 * BLOCK, text="s")
    third = request("third", 1, text="t")
    for state in (first, second, third):
        sched.add(state, 0.0)
    assert names(sched.waiting) == ["third"]
    first.generated_tokens = 1
    assert sched.grow(first, 1.0)
    assert names(sched.waiting) == ["second", "third"]
