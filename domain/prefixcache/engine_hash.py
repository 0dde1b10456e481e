"""The model server's block-hash chain (vLLM's prefix caching), so EPP keys equal its events'.

vLLM names a full block of ``block_size`` tokens by chaining:

    h(0)  = H((NONE_HASH, tokens(0), extra_keys(0)))
    h(i)  = H((h(i-1), tokens(i), extra_keys(i)))

where ``tokens(i)`` is the tuple of the block's token ids, ``extra_keys(i)`` is ``None`` or
a tuple, in this order: the LoRA adapter's name (every block of a LoRA request), multimodal
hashes, the request's ``cache_salt`` (the first block only); ``NONE_HASH = H(seed)`` with
``seed`` the engine's ``PYTHONHASHSEED`` string (unset: random per process, so nothing
outside the engine can match), and ``H`` the ``--prefix-caching-hash-algo``:

- ``sha256`` (vLLM's default): SHA-256 of the object pickled with protocol 5;
- ``sha256_cbor``: SHA-256 of its canonical CBOR encoding (language-neutral);
- ``xxhash``: XXH3-128 of the pickled object; ``xxhash_cbor``: XXH3-128 of its canonical
  CBOR encoding (faster; not cryptographic).

SHA-256 hashes are 32 bytes, XXH3-128 ones 16; events carry their low 64 bits as an
unsigned integer (``external``). Only the standard library is used: ``pickle`` and
``hashlib``, a canonical CBOR encoder for the few types a key holds (None, bool, int,
bytes, str, tuples and lists), and the XXH3-128 digest the app passes in
(``ports.kv_events.Digest``, from ``adapters/xxhash``).
"""

from __future__ import annotations

import functools
import hashlib
import pickle
import struct
from collections.abc import Callable, Sequence
from typing import Any

from ports.kv_events import Digest

__all__ = [
    "HASH_ALGORITHMS",
    "EngineBlockHasher",
    "canonical_cbor",
    "external",
]

_PICKLE_PROTOCOL = 5


def _pickled(value: object) -> bytes:
    return pickle.dumps(value, protocol=_PICKLE_PROTOCOL)


def _cbor_bytes(value: object) -> bytes:
    return canonical_cbor(value)


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


#: ``--prefix-caching-hash-algo`` → (how the object is serialized, which digest: ``sha256``
#: from the standard library, ``xxh3_128`` from the app).
_ALGORITHMS: dict[str, tuple[Callable[[object], bytes], str]] = {
    "sha256": (_pickled, "sha256"),
    "sha256_cbor": (_cbor_bytes, "sha256"),
    "xxhash": (_pickled, "xxh3_128"),
    "xxhash_cbor": (_cbor_bytes, "xxh3_128"),
}
HASH_ALGORITHMS: tuple[str, ...] = tuple(_ALGORITHMS)


def external(block_hash: bytes) -> int:
    """The integer a KV event carries for ``block_hash``: its low 64 bits, big-endian."""
    return int.from_bytes(block_hash[-8:], "big")


class EngineBlockHasher:
    """Computes the engine's block hashes for token ids. Pure and thread-safe."""

    __slots__ = ("_fn", "_none_hash", "algorithm")

    def __init__(
        self, *, algorithm: str = "sha256", seed: str, xxh3_128: Digest | None = None
    ) -> None:
        """``xxh3_128``: the XXH3-128 digest, needed by the ``xxhash`` algorithms."""
        entry = _ALGORITHMS.get(algorithm)
        if entry is None:
            raise ValueError(
                f"hash algorithm must be one of {sorted(HASH_ALGORITHMS)}, got {algorithm!r}"
            )
        serialize, digest_name = entry
        digest: Digest | None = _sha256 if digest_name == "sha256" else xxh3_128
        if digest is None:
            raise ValueError(f"hash algorithm {algorithm}: no XXH3-128 digest was given")

        def fn(value: object) -> bytes:
            return digest(serialize(value))

        self.algorithm = algorithm
        self._fn = fn
        self._none_hash = fn(seed)

    def chain(
        self,
        token_ids: Sequence[int],
        block_size: int,
        *,
        extra_keys: tuple[Any, ...] | None = None,
        first_extra_keys: tuple[Any, ...] | None = None,
        max_blocks: int | None = None,
        parent: bytes | None = None,
    ) -> list[bytes]:
        """The hashes of the full blocks of ``token_ids`` (a trailing partial block has none).

        ``extra_keys`` go with every block, ``first_extra_keys`` (when given) replace them
        for the first block of ``token_ids``. ``parent``: continue a chain (the hash of the
        block before ``token_ids[0]``).
        """
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        count = len(token_ids) // block_size
        if max_blocks is not None:
            count = min(count, max_blocks)
        fn = self._fn
        previous = self._none_hash if parent is None else parent
        out: list[bytes] = []
        for index in range(count):
            block = tuple(token_ids[index * block_size : (index + 1) * block_size])
            extra = first_extra_keys if index == 0 and first_extra_keys is not None else extra_keys
            previous = fn((previous, block, extra))
            out.append(previous)
        return out

    def keys(
        self,
        token_ids: Sequence[int],
        block_size: int,
        *,
        extra_keys: tuple[Any, ...] | None = None,
        first_extra_keys: tuple[Any, ...] | None = None,
        max_blocks: int | None = None,
    ) -> list[int]:
        """:meth:`chain` as the integers the engine's events carry."""
        chain = self.chain(
            token_ids,
            block_size,
            extra_keys=extra_keys,
            first_extra_keys=first_extra_keys,
            max_blocks=max_blocks,
        )
        return [external(h) for h in chain]


def canonical_cbor(value: object) -> bytes:
    """Canonical CBOR (RFC 8949 core deterministic encoding) of a key's values."""
    out = bytearray()
    _cbor(value, out)
    return bytes(out)


def _head(major: int, length: int, out: bytearray) -> None:
    if length < 24:
        out.append(major << 5 | length)
    elif length < 1 << 8:
        out += bytes((major << 5 | 24, length))
    elif length < 1 << 16:
        out.append(major << 5 | 25)
        out += struct.pack(">H", length)
    elif length < 1 << 32:
        out.append(major << 5 | 26)
        out += struct.pack(">I", length)
    elif length < 1 << 64:
        out.append(major << 5 | 27)
        out += struct.pack(">Q", length)
    else:
        raise ValueError("integer out of CBOR's 64-bit range")


def _uint(value: int) -> bytes:
    out = bytearray()
    _head(0, value, out)
    return bytes(out)


_TABLE_SIZE = 1 << 17


@functools.cache
def _uint_table() -> tuple[bytes, ...]:
    """The encodings of 0 .. 131071 (a tokenizer's ids: Llama 3's 128,256 included), looked
    up instead of encoded; built on first use (about 5 MB)."""
    return tuple(_uint(i) for i in range(_TABLE_SIZE))


def _cbor(value: object, out: bytearray) -> None:
    if value is None:
        out.append(0xF6)
    elif value is True:
        out.append(0xF5)
    elif value is False:
        out.append(0xF4)
    elif isinstance(value, int):
        if value >= 0:
            _head(0, value, out)
        else:
            _head(1, -1 - value, out)
    elif isinstance(value, bytes | bytearray):
        _head(2, len(value), out)
        out += value
    elif isinstance(value, str):
        raw = value.encode()
        _head(3, len(raw), out)
        out += raw
    elif isinstance(value, tuple | list):
        _head(4, len(value), out)
        table = _uint_table()
        for item in value:
            # token ids (ints, not bools, below 2**16): their encodings from a table
            if type(item) is int and 0 <= item < _TABLE_SIZE:
                out += table[item]
            else:
                _cbor(item, out)
    else:
        raise TypeError(f"cannot encode {type(value).__name__} in a block key")
