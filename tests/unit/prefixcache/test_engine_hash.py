"""The engine's block-hash chain: structure, seed, extra keys (LoRA, cache salt), the
algorithms."""

from __future__ import annotations

import hashlib
import pickle

import pytest
import xxhash

from adapters.xxhash import xxh3_128
from domain.prefixcache.engine_hash import EngineBlockHasher, canonical_cbor, external
from domain.prefixcache.precise import PromptKeyer


def test_sha256_chain_is_sha256_of_the_pickled_parent_tokens_extra_triple() -> None:
    hasher = EngineBlockHasher(algorithm="sha256", seed="0")
    seed = hashlib.sha256(pickle.dumps("0", protocol=5)).digest()
    first = hashlib.sha256(pickle.dumps((seed, (1, 2), None), protocol=5)).digest()
    second = hashlib.sha256(pickle.dumps((first, (3, 4), None), protocol=5)).digest()
    assert hasher.chain([1, 2, 3, 4, 5], 2) == [first, second]  # no hash for a partial block
    assert hasher.keys([1, 2, 3, 4], 2) == [external(first), external(second)]
    assert external(first) == int.from_bytes(first[24:], "big")


def test_seed_algorithm_and_extra_keys_change_every_hash() -> None:
    tokens = list(range(8))
    base = EngineBlockHasher(seed="0").chain(tokens, 4)
    assert set(base).isdisjoint(EngineBlockHasher(seed="1").chain(tokens, 4))
    assert set(base).isdisjoint(
        EngineBlockHasher(algorithm="sha256_cbor", seed="0").chain(tokens, 4)
    )
    assert set(base).isdisjoint(EngineBlockHasher(seed="0").chain(tokens, 4, extra_keys=("lora",)))
    assert EngineBlockHasher(seed="0").chain(tokens, 4, max_blocks=1) == base[:1]


def test_canonical_cbor_encodings() -> None:
    # RFC 8949 appendix A examples
    assert canonical_cbor(0) == bytes.fromhex("00")
    assert canonical_cbor(23) == bytes.fromhex("17")
    assert canonical_cbor(24) == bytes.fromhex("1818")
    assert canonical_cbor(1000) == bytes.fromhex("1903e8")
    assert canonical_cbor(1000000) == bytes.fromhex("1a000f4240")
    assert canonical_cbor(1000000000000) == bytes.fromhex("1b000000e8d4a51000")
    assert canonical_cbor(-1) == bytes.fromhex("20")
    assert canonical_cbor(-1000) == bytes.fromhex("3903e7")
    assert canonical_cbor(None) == bytes.fromhex("f6")
    assert canonical_cbor(b"\x01\x02\x03\x04") == bytes.fromhex("4401020304")
    assert canonical_cbor("IETF") == bytes.fromhex("6449455446")
    assert canonical_cbor((1, [2, 3], [4, 5])) == bytes.fromhex("8301820203820405")
    with pytest.raises(TypeError):
        canonical_cbor(1.5)


def test_unknown_algorithm() -> None:
    with pytest.raises(ValueError, match="sha256_cbor"):
        EngineBlockHasher(algorithm="md5", seed="0")


def _vllm_sha256(value: object) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


@pytest.mark.parametrize(
    ("lora", "salt"), [("sql-adapter", None), ("sql-adapter", "s1"), (None, "s1")]
)
def test_lora_and_cache_salt_keys_equal_a_hand_computed_engine_chain(
    lora: str | None, salt: str | None
) -> None:
    """vLLM's extra keys: the adapter's name on every block, then (first block only) the
    request's cache_salt; no extra keys is ``None``."""
    ids = list(range(10))
    keyer = PromptKeyer(_NoTokenizer(), EngineBlockHasher(seed="42"), block_size=4)
    rest = (lora,) if lora else None
    first = tuple(k for k in (lora, salt) if k) or None
    h0 = _vllm_sha256((_vllm_sha256("42"), (0, 1, 2, 3), first))
    h1 = _vllm_sha256((h0, (4, 5, 6, 7), rest))
    expected = [int.from_bytes(h[-8:], "big") for h in (h0, h1)]
    assert keyer.keys_for_tokens(ids, lora_name=lora, cache_salt=salt) == expected
    assert set(expected).isdisjoint(keyer.keys_for_tokens(ids))  # the base model's keys


class _NoTokenizer:
    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        raise AssertionError("not used")


def test_xxhash_algorithms_are_xxh3_128_of_the_pickled_or_cbor_triple() -> None:
    """vLLM's ``xxhash`` (pickle) and ``xxhash_cbor`` (canonical CBOR) are XXH3-128 digests;
    the digest comes from the app, the CBOR bytes here are written out by hand."""
    seed = xxhash.xxh3_128_digest(pickle.dumps("42", protocol=5))
    first = xxhash.xxh3_128_digest(pickle.dumps((seed, (1, 2), None), protocol=5))
    hasher = EngineBlockHasher(algorithm="xxhash", seed="42", xxh3_128=xxh3_128)
    assert hasher.chain([1, 2, 3], 2) == [first]
    assert hasher.keys([1, 2], 2) == [int.from_bytes(first[8:], "big")]
    cbor_seed = xxhash.xxh3_128_digest(b"\x62" + b"42")  # text string of 2 bytes
    # [bytes(16), [1, 2], null]: array of 3, byte string of 16, array of 2, 1, 2, null
    triple = b"\x83\x50" + cbor_seed + b"\x82\x01\x02\xf6"
    cbor_first = xxhash.xxh3_128_digest(triple)
    cbor = EngineBlockHasher(algorithm="xxhash_cbor", seed="42", xxh3_128=xxh3_128)
    assert cbor.chain([1, 2], 2) == [cbor_first]


def test_xxhash_algorithms_need_the_digest() -> None:
    with pytest.raises(ValueError, match="XXH3-128"):
        EngineBlockHasher(algorithm="xxhash", seed="0")


def test_canonical_cbor_of_token_ids_around_the_encoding_boundaries() -> None:
    ids = (0, 23, 24, 255, 256, 65535, 65536, 131071, 131072, 2**32)
    heads = ["00", "17", "1818", "18ff", "190100", "19ffff", "1a00010000", "1a0001ffff"]
    heads += ["1a00020000", "1b0000000100000000"]
    assert canonical_cbor(ids) == bytes.fromhex("8a" + "".join(heads))
    # not token ids: bools and negative ints keep their own encodings
    assert canonical_cbor([True, False, -1, 1]) == bytes.fromhex("84f5f42001")
