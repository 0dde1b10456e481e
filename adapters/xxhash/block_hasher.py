"""``BlockHasher`` on xxh64: the chained block hashes of the approximate prefix cache; and
``xxh3_128``, the ``ports.kv_events.Digest`` of vLLM's ``xxhash`` prefix-caching hashes."""

from __future__ import annotations

from xxhash import xxh3_128_digest, xxh64_intdigest

__all__ = ["XxhashBlockHasher", "xxh3_128"]


def xxh3_128(data: bytes, /) -> bytes:
    """The 16-byte XXH3-128 digest (seed 0) of ``data``, as vLLM's ``xxhash`` and
    ``xxhash_cbor`` algorithms take it."""
    return xxh3_128_digest(data)


_to_bytes = int.to_bytes


class XxhashBlockHasher:
    """Chained xxh64 (seed 0) block hashes, as the ``BlockHasher`` port defines them.

    ``h0 = xxh64(seed)``; each block (the trailing partial one included) hashes to
    ``xxh64(block || little-endian uint64(h_prev))``. ``data`` is cut to
    ``max_blocks * block_size`` bytes; shorter than one block gives ``[]``. Stateless and
    thread-safe. ``block_size`` must be positive.
    """

    __slots__ = ()

    def chain(self, data: bytes, block_size: int, seed: bytes, max_blocks: int) -> list[int]:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        end = min(len(data), max_blocks * block_size)
        if end < block_size:
            return []
        if len(data) > end or not isinstance(data, bytes):
            data = bytes(data[:end])
        digest = xxh64_intdigest
        to_bytes = _to_bytes
        h = digest(seed)
        out: list[int] = []
        append = out.append
        # Slicing ``bytes`` and concatenating is cheaper here than memoryview slices or a
        # reused buffer: one 64-byte copy beats two extra method calls per block.
        for start in range(0, end, block_size):
            h = digest(data[start : start + block_size] + to_bytes(h, 8, "little"))
            append(h)
        return out
