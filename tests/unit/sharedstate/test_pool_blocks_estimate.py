"""``estimate_pool_blocks``: the others' blocks beyond this process's, from one hash in 16.
Exact when the processes hold the same chains or different ones; within the sampling error
when they share part of them, as requests of a shared-prefix workload do."""

from __future__ import annotations

import random

from ports.shared_state import (
    HASH_MASK,
    SAMPLE_MASK,
    PoolBlocks,
    ProcessBlocks,
    estimate_pool_blocks,
)


def chain(rng: random.Random, length: int) -> list[int]:
    return [rng.getrandbits(64) for _ in range(length)]


def published(prefix_blocks: set[int], unshared: int = 0) -> ProcessBlocks:
    return ProcessBlocks(
        len(prefix_blocks), unshared, frozenset(h for h in prefix_blocks if not h & SAMPLE_MASK)
    )


def sample(blocks: set[int]) -> frozenset[int]:
    return frozenset(h & HASH_MASK for h in blocks if not h & SAMPLE_MASK)


def test_disjoint_and_identical_holdings_are_counted_exactly() -> None:
    rng = random.Random(7)
    mine, theirs = set(chain(rng, 300)), set(chain(rng, 200))
    assert sample(theirs)  # 200 random hashes hold about 12 sampled ones
    other = published(theirs, unshared=5)
    assert estimate_pool_blocks({"e": sample(mine)}, [{"e": other}]) == {
        "e": PoolBlocks(200 + 5, sample(theirs))
    }
    same = published(mine, unshared=2)
    assert estimate_pool_blocks({"e": sample(mine)}, [{"e": same}])["e"].count == 2


def test_a_process_is_not_counted_twice_behind_another() -> None:
    rng = random.Random(8)
    shared = set(chain(rng, 160))
    first, second = published(shared, 1), published(shared, 1)
    assert estimate_pool_blocks({}, [{"e": first}, {"e": second}])["e"].count == 160 + 2


def test_an_unsampled_holding_counts_whole() -> None:
    unsampled = {0x11, 0x21, 0x31}  # none ends in a 0 hex digit
    estimate = estimate_pool_blocks({}, [{"e": published(unsampled, 1)}])
    assert estimate == {"e": PoolBlocks(3 + 1, frozenset())}


def test_shared_prefix_holdings_stay_within_the_sampling_error() -> None:
    # Per endpoint: groups of prompts sharing a long system prompt, each process holding a
    # random subset of the group's requests. The true count is the distinct blocks the
    # others hold beyond this process's.
    rng = random.Random(9)
    errors: list[float] = []
    for _ in range(200):
        groups = [(chain(rng, 150), [chain(rng, 40) for _ in range(6)]) for _ in range(3)]
        holdings: list[set[int]] = []
        for _ in range(3):
            held: set[int] = set()
            for prefix, tails in groups:
                for tail in rng.sample(tails, rng.randint(0, 3)):
                    held.update(prefix)
                    held.update(tail)
            holdings.append(held)
        mine, others = holdings[0], holdings[1:]
        true = len(set().union(*others) - mine)
        estimate = estimate_pool_blocks(
            {"e": sample(mine)}, [{"e": published(held)} for held in others]
        )
        count = estimate["e"].count if "e" in estimate else 0
        if true > 50:
            errors.append((count - true) / true)
    # Unbiased, and mostly close: one sampled hash stands for 16 blocks (measured: mean
    # -1.5%, median error 12%, nine in ten within 33%).
    assert abs(sum(errors) / len(errors)) < 0.05
    spread = sorted(abs(error) for error in errors)
    assert spread[len(spread) // 2] < 0.15
    assert spread[int(len(spread) * 0.9)] < 0.40


def test_each_sampled_hash_sent_once_gives_the_same_estimate() -> None:
    # A store may send each sampled hash once, with the first process holding it, and each
    # process's sample size: the estimate is the one of the whole samples.
    rng = random.Random(10)
    prefix = chain(rng, 150)
    holdings = [set(prefix[: rng.randint(40, 150)]) | set(chain(rng, 40)) for _ in range(3)]
    mine = sample(set(prefix[:60]))
    whole = [{"e": published(held, unshared=2)} for held in holdings]
    seen: set[int] = set()
    once: list[dict[str, ProcessBlocks]] = []
    for held in holdings:
        full = sample(held)
        once.append(
            {"e": ProcessBlocks(len(held), 2, frozenset(full - seen), sample_size=len(full))}
        )
        seen |= full
    assert any(len(p["e"].sampled) < p["e"].sample_size for p in once)
    assert estimate_pool_blocks({"e": mine}, once) == estimate_pool_blocks({"e": mine}, whole)
