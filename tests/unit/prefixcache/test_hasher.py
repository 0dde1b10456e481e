"""Chained block hashes: the xxh64 adapter and the stdlib (BLAKE2b) hasher."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from adapters.xxhash import XxhashBlockHasher
from domain.prefixcache import StdlibBlockHasher
from ports.prefix_index import BlockHasher

HASHERS = [XxhashBlockHasher(), StdlibBlockHasher()]
IDS = ["xxhash", "stdlib"]


def _xxh64(data: bytes) -> int:
    return xxhash.xxh64(data, seed=0).intdigest()


def _blake64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def _reference(
    h: Callable[[bytes], int], data: bytes, block_size: int, seed: bytes, max_blocks: int
) -> list[int]:
    """The chain written out plainly: cut, split into blocks, hash each with its parent."""
    data = data[: max_blocks * block_size]
    if len(data) < block_size:
        return []
    out = []
    previous = h(seed)
    for start in range(0, len(data), block_size):
        previous = h(data[start : start + block_size] + previous.to_bytes(8, "little"))
        out.append(previous)
    return out


@pytest.mark.parametrize(
    ("data", "block_size", "max_blocks"),
    [
        (b"a" * 64, 64, 256),
        (b"abcdefgh" * 50, 64, 256),  # 6 full blocks and a partial one
        (bytes(range(256)) * 3, 16, 10),  # truncated to 10 blocks
        (b"x" * 100, 7, 1000),
    ],
)
def test_xxhash_adapter_matches_the_reference_chain(
    data: bytes, block_size: int, max_blocks: int
) -> None:
    expected = _reference(_xxh64, data, block_size, b"model-salt", max_blocks)
    assert XxhashBlockHasher().chain(data, block_size, b"model-salt", max_blocks) == expected


def test_stdlib_hasher_matches_the_reference_chain() -> None:
    data = b"The quick brown fox jumps over the lazy dog. " * 9
    expected = _reference(_blake64, data, 32, b"m", 256)
    assert StdlibBlockHasher().chain(data, 32, b"m", 256) == expected


@given(
    data=st.binary(max_size=600),
    block_size=st.integers(1, 80),
    seed=st.binary(max_size=20),
    max_blocks=st.integers(0, 12),
)
def test_both_hashers_follow_the_reference_for_any_input(
    data: bytes, block_size: int, seed: bytes, max_blocks: int
) -> None:
    assert XxhashBlockHasher().chain(data, block_size, seed, max_blocks) == _reference(
        _xxh64, data, block_size, seed, max_blocks
    )
    assert StdlibBlockHasher().chain(data, block_size, seed, max_blocks) == _reference(
        _blake64, data, block_size, seed, max_blocks
    )


@pytest.mark.parametrize("hasher", HASHERS, ids=IDS)
def test_input_shorter_than_one_block_has_no_hashes(hasher: BlockHasher) -> None:
    assert hasher.chain(b"", 64, b"m", 256) == []
    assert hasher.chain(b"x" * 63, 64, b"m", 256) == []
    assert len(hasher.chain(b"x" * 64, 64, b"m", 256)) == 1


@pytest.mark.parametrize("hasher", HASHERS, ids=IDS)
def test_no_blocks_allowed_means_no_hashes(hasher: BlockHasher) -> None:
    assert hasher.chain(b"x" * 640, 64, b"m", 0) == []


@pytest.mark.parametrize("hasher", HASHERS, ids=IDS)
def test_each_hash_covers_the_whole_prefix(hasher: BlockHasher) -> None:
    a = hasher.chain(b"A" * 64 + b"B" * 64 + b"C" * 64, 64, b"m", 256)
    b = hasher.chain(b"A" * 64 + b"X" * 64 + b"C" * 64, 64, b"m", 256)
    assert len(a) == len(b) == 3
    assert a[0] == b[0]
    assert a[1] != b[1]
    assert a[2] != b[2]  # same block content, different prefix
    assert len(set(a)) == 3  # equal blocks at different positions hash differently
    assert hasher.chain(b"A" * 192, 64, b"m", 256)[0] == a[0]


@pytest.mark.parametrize("hasher", HASHERS, ids=IDS)
def test_a_longer_prompt_extends_the_chain(hasher: BlockHasher) -> None:
    prompt = bytes(range(200)) * 2
    short = hasher.chain(prompt[:128], 32, b"m", 256)
    long = hasher.chain(prompt, 32, b"m", 256)
    assert long[: len(short)] == short


@pytest.mark.parametrize("hasher", HASHERS, ids=IDS)
def test_the_trailing_partial_block_is_hashed(hasher: BlockHasher) -> None:
    full = hasher.chain(b"y" * 128, 64, b"m", 256)
    partial = hasher.chain(b"y" * 128 + b"z", 64, b"m", 256)
    other_partial = hasher.chain(b"y" * 128 + b"w", 64, b"m", 256)
    assert len(full) == 2
    assert len(partial) == 3
    assert partial[:2] == full
    assert partial[2] != other_partial[2]


@pytest.mark.parametrize("hasher", HASHERS, ids=IDS)
def test_input_is_cut_to_max_blocks(hasher: BlockHasher) -> None:
    data = bytes(range(256)) * 4
    cut = hasher.chain(data, 16, b"m", 5)
    assert len(cut) == 5
    assert cut == hasher.chain(data[:80], 16, b"m", 256)
    # The cut falls on a block boundary: no partial block after it.
    assert hasher.chain(data[:85], 16, b"m", 5) == cut


@pytest.mark.parametrize("hasher", HASHERS, ids=IDS)
def test_the_seed_changes_every_hash(hasher: BlockHasher) -> None:
    data = b"shared prompt text " * 20
    one = hasher.chain(data, 32, b"model-a", 256)
    other = hasher.chain(data, 32, b"model-b", 256)
    salted = hasher.chain(data, 32, b"model-asalt", 256)
    assert len(one) == len(other) == len(salted) > 1
    assert not set(one) & set(other)
    assert not set(one) & set(salted)
    assert hasher.chain(data, 32, b"model-a", 256) == one  # deterministic


@pytest.mark.parametrize("hasher", HASHERS, ids=IDS)
def test_hashes_are_unsigned_64_bit(hasher: BlockHasher) -> None:
    hashes = hasher.chain(bytes(range(256)) * 8, 16, b"m", 256)
    assert all(0 <= h < 2**64 for h in hashes)


@pytest.mark.parametrize("hasher", HASHERS, ids=IDS)
def test_a_non_positive_block_size_is_refused(hasher: BlockHasher) -> None:
    with pytest.raises(ValueError, match="block_size"):
        hasher.chain(b"x" * 100, 0, b"m", 4)
