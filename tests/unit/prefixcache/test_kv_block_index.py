"""The KV-block index: stored/removed/cleared, tiers, trust after gaps, caps, speculation."""

from __future__ import annotations

import gc
import random
import sys
import time

import pytest

from domain.prefixcache.kv_block_index import InMemoryKVBlockIndex
from ports.kv_events import AllBlocksCleared, BlockRemoved, BlockStored


def stored(*hashes: int, medium: str | None = None) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=None, block_size=16, medium=medium)


def test_match_counts_leading_blocks_per_trusted_endpoint() -> None:
    index = InMemoryKVBlockIndex()
    index.apply("a", [stored(1, 2, 3)])
    index.apply("b", [stored(1, 5)])
    assert index.match([1, 2, 3, 4], ["a", "b", "c"]) == {"a": 3, "b": 1}
    assert index.match([2, 3], ["a"]) == {"a": 2}  # any position: keys are chained hashes
    assert index.match([9, 1], ["a", "b"]) == {}
    assert index.size() == 5


def test_removed_and_cleared() -> None:
    index = InMemoryKVBlockIndex()
    index.apply("a", [stored(1, 2, 3), BlockRemoved(block_hashes=(2, 99))])
    assert index.match([1, 2, 3], ["a"]) == {"a": 1}
    index.apply("a", [AllBlocksCleared()])
    assert index.match([1], ["a"]) == {}
    assert index.size() == 0


def test_a_block_held_in_two_tiers_stays_until_both_remove_it() -> None:
    index = InMemoryKVBlockIndex()
    index.apply("a", [stored(1), stored(1, medium="CPU")])
    assert index.size() == 1
    index.apply("a", [BlockRemoved(block_hashes=(1,), medium="GPU")])
    assert index.match([1], ["a"]) == {"a": 1}
    index.apply("a", [BlockRemoved(block_hashes=(1,), medium="CPU")])
    assert index.match([1], ["a"]) == {}


def test_lost_endpoint_is_ignored_until_resynced_or_cleared() -> None:
    index = InMemoryKVBlockIndex()
    index.apply("a", [stored(1, 2)])
    index.lost("a")
    assert index.match([1, 2], ["a"]) == {}
    index.resynced("a")
    assert index.match([1, 2], ["a"]) == {"a": 2}
    index.lost("a")
    index.apply("a", [AllBlocksCleared(), stored(7)])
    assert index.match([7], ["a"]) == {"a": 1}


def test_per_endpoint_cap_drops_the_oldest_stored() -> None:
    index = InMemoryKVBlockIndex(max_blocks_per_endpoint=3)
    index.apply("a", [stored(*range(10))])
    assert index.size() == 3
    assert index.match([7, 8, 9], ["a"]) == {"a": 3}
    assert index.match([6], ["a"]) == {}
    index.forget("a")
    assert index.size() == 0


def test_speculative_entries_lapse_unless_events_confirm() -> None:
    now = [100.0]
    index = InMemoryKVBlockIndex(clock=lambda: now[0])
    index.apply("a", [stored(1)])
    index.speculate("a", [1, 2, 3], ttl=2.0)
    assert index.match([1, 2, 3], ["a"]) == {"a": 3}
    index.apply("a", [stored(2)])  # the engine confirmed block 2
    now[0] = 103.0
    assert index.match([1, 2, 3], ["a"]) == {"a": 2}
    index.speculate("unknown", [1], ttl=2.0)  # never seen: no credit
    assert index.match([1], ["unknown"]) == {}


def test_a_loaded_copy_is_older_than_the_events_and_yields_to_them() -> None:
    index = InMemoryKVBlockIndex(max_blocks_per_endpoint=4)
    index.apply("a", [stored(5, medium="CPU")])
    added = index.load("a", [(1, ("GPU",)), (2, ("GPU",)), (5, ("GPU",)), (6, ("GPU",))])
    # 5 keeps what the events said; the copy fills the room left, newest first
    assert added == 3
    assert index.snapshot("a") == [(1, ("GPU",)), (2, ("GPU",)), (6, ("GPU",)), (5, ("CPU",))]
    assert index.match([1, 2], ["a"]) == {"a": 2}
    index.apply("a", [stored(7)])  # the cap drops the oldest: a loaded block
    assert [h for h, _ in index.snapshot("a")] == [2, 6, 5, 7]
    assert index.size() == 4


@pytest.mark.timed
def test_a_cleared_endpoint_is_freed_a_bounded_part_per_call() -> None:
    """1,024,000 blocks cleared: what they held is freed by the next calls, none of which
    takes more than a few ms of CPU (before: the call that freed the last shard returned
    the memory of every shard at once, 9-15 ms for 1-1.5 M blocks, the allocator's arenas
    holding hashes of every shard). The test session's heap is frozen out of the collector
    while the calls are timed."""
    rng = random.Random(1)
    index = InMemoryKVBlockIndex(max_blocks_per_endpoint=1 << 21)
    for _ in range(1_000):
        index.apply("a", [stored(*(rng.getrandbits(64) | 1 << 63 for _ in range(1024)))])
    gc.collect()
    gc.freeze()
    try:
        held = sys.getallocatedblocks()
        index.apply("a", [AllBlocksCleared()])
        took: list[float] = []
        for _ in range(2_000):
            cpu = time.thread_time()
            index.apply("a", [])
            took.append(time.thread_time() - cpu)
        freed = held - sys.getallocatedblocks()
    finally:
        gc.unfreeze()
    assert index.size() == 0
    assert freed > 0.99 * 1_024_000, freed  # every hash (the timings took a few)
    assert max(took) < 0.004, sorted(took)[-5:]
