"""A standard-library ``BlockHasher`` (BLAKE2b, 64-bit), for tests and as a fallback."""

from __future__ import annotations

from hashlib import blake2b

__all__ = ["StdlibBlockHasher"]

_to_bytes = int.to_bytes
_from_bytes = int.from_bytes


class StdlibBlockHasher:
    """The ``BlockHasher`` chain with ``H = blake2b(digest_size=8)`` read little-endian.

    Same chaining, truncation and partial-block rules as the production xxh64 hasher;
    the values differ from it, so replicas sharing an index must use the same hasher.
    Stateless and thread-safe. ``block_size`` must be positive.
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
        to_bytes = _to_bytes
        from_bytes = _from_bytes
        h = from_bytes(blake2b(seed, digest_size=8).digest(), "little")
        out: list[int] = []
        append = out.append
        for start in range(0, end, block_size):
            block = data[start : start + block_size] + to_bytes(h, 8, "little")
            h = from_bytes(blake2b(block, digest_size=8).digest(), "little")
            append(h)
        return out
