"""The paged KV cache: hash chain, reference counts, prefix lookup and LRU eviction."""

from __future__ import annotations

import pytest

from tests.simulator.kvcache import Block, KVCache, block_hashes


def chain(*contents: str, key: str = "model") -> tuple[bytes, ...]:
    return block_hashes(key, (content.encode() for content in contents))


def cached_sequence(kv: KVCache, hashes: tuple[bytes, ...]) -> list[Block]:
    """Allocate and cache one block per hash, like an admitted prompt."""
    blocks = kv.allocate(len(hashes))
    for block, block_hash in zip(blocks, hashes, strict=True):
        assert kv.cache(block, block_hash)
    return blocks


def test_hash_chain_identifies_prefixes() -> None:
    assert chain("a", "b", "c") == chain("a", "b", "c")
    assert chain("a", "b", "c")[:2] == chain("a", "b", "x")[:2]
    # a different first block changes every later hash, even for equal content
    assert set(chain("a", "b", "c")).isdisjoint(chain("z", "b", "c"))
    # the model (or LoRA adapter) seeds the chain
    assert set(chain("a", "b", key="m1")).isdisjoint(chain("a", "b", key="m2"))
    assert len(set(chain("a", "a", "a"))) == 3


def test_freed_blocks_stay_findable_and_usage_counts_referenced_ones() -> None:
    kv = KVCache(num_blocks=8, block_size=16)
    hashes = chain("a", "b", "c")
    blocks = cached_sequence(kv, hashes)
    assert kv.num_used == 3
    assert kv.usage == pytest.approx(3 / 8)
    kv.free(blocks)
    assert kv.num_used == 0
    assert kv.usage == 0.0
    assert kv.num_cached == 3
    found = kv.longest_prefix(chain("a", "b", "x"), max_blocks=10)
    assert found == blocks[:2]
    assert kv.longest_prefix(hashes, max_blocks=1) == blocks[:1]
    assert kv.longest_prefix(chain("x", "b"), max_blocks=10) == []


def test_shared_blocks_are_reference_counted() -> None:
    kv = KVCache(num_blocks=4, block_size=16)
    blocks = cached_sequence(kv, chain("a", "b"))
    hits = kv.longest_prefix(chain("a", "b"), max_blocks=2)
    kv.acquire(hits)
    assert [block.ref_count for block in blocks] == [2, 2]
    assert kv.num_used == 2
    kv.free(blocks)
    assert kv.num_used == 2  # still referenced by the second user
    kv.free(hits)
    assert kv.num_used == 0


def test_uncached_blocks_are_used_before_cached_ones_are_evicted() -> None:
    kv = KVCache(num_blocks=4, block_size=16)
    kv.free(cached_sequence(kv, chain("a", "b")))
    plain = kv.allocate(2)  # the two never-used blocks
    assert kv.num_cached == 2
    assert kv.num_evictions == 0
    kv.free(plain)
    again = kv.allocate(2)  # freed without content: reused before evicting
    assert kv.num_cached == 2
    assert {block.block_id for block in again} == {block.block_id for block in plain}


def test_eviction_is_least_recently_used_among_unreferenced_blocks() -> None:
    kv = KVCache(num_blocks=4, block_size=16)
    first = chain("a", "b", key="first")
    second = chain("a", "b", key="second")
    kv.free(cached_sequence(kv, first))
    kv.free(cached_sequence(kv, second))
    # use the first prompt again: its blocks become the most recently used
    hits = kv.longest_prefix(first, max_blocks=2)
    assert kv.can_allocate(hits, 2)
    kv.acquire(hits)
    kv.free(hits)

    kv.allocate(2)
    assert kv.num_evictions == 2
    assert len(kv.longest_prefix(first, max_blocks=2)) == 2
    assert kv.longest_prefix(second, max_blocks=2) == []


def test_a_sequence_is_evicted_tail_first() -> None:
    kv = KVCache(num_blocks=3, block_size=16)
    hashes = chain("a", "b", "c")
    kv.free(cached_sequence(kv, hashes))
    kv.allocate(1)
    assert [kv.is_cached(h) for h in hashes] == [True, True, False]


def test_referenced_blocks_are_never_evicted() -> None:
    kv = KVCache(num_blocks=4, block_size=16)
    hashes = chain("a", "b")
    held = cached_sequence(kv, hashes)
    kv.free(cached_sequence(kv, chain("x", "y")))
    assert kv.num_free == 2
    assert not kv.can_allocate([], 3)
    with pytest.raises(RuntimeError, match="cannot allocate 3 blocks"):
        kv.allocate(3)
    taken = kv.allocate(2)
    assert kv.num_free == 0
    assert kv.longest_prefix(hashes, max_blocks=2) == held
    assert not {block.block_id for block in taken} & {block.block_id for block in held}


def test_reviving_a_cached_block_counts_against_free_space() -> None:
    kv = KVCache(num_blocks=3, block_size=16)
    kv.free(cached_sequence(kv, chain("a", "b")))
    hits = kv.longest_prefix(chain("a", "b"), max_blocks=2)
    # three free blocks, but two of them are the hits themselves
    assert kv.can_allocate(hits, 1)
    assert not kv.can_allocate(hits, 2)


def test_content_is_cached_once() -> None:
    kv = KVCache(num_blocks=4, block_size=16)
    hashes = chain("a")
    cached_sequence(kv, hashes)
    duplicate = kv.allocate(1)[0]
    assert not kv.cache(duplicate, hashes[0])
    assert duplicate.block_hash is None
    assert kv.num_cached == 1
