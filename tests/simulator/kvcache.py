"""A paged KV cache with automatic prefix caching, modelled on vLLM v1's block pool.

- The cache holds ``num_blocks`` blocks of ``block_size`` tokens.
- A *full* prompt block is identified by a hash chain: ``h(i) = sha256(h(i-1) ‖ content(i))``
  with ``h(-1) = sha256("model:" ‖ cache key)``, where the cache key is the base model or
  the LoRA adapter. Equal hashes therefore mean equal prefixes for the same weights.
- Blocks are reference-counted by the requests using them. A block whose count drops to
  zero stays cached (findable by hash) until it is evicted.
- Allocation takes, in this order: blocks that hold no cached content (never used, or
  freed without a hash), then cached unreferenced blocks in least-recently-freed order,
  evicting their hash. A referenced block is never handed out, hence never evicted.
- A request frees its blocks in reverse order, so the tail of a sequence is evicted
  before its (more shareable) head.
- A :class:`KVCacheListener` hears every change of the cached content: a block stored
  (with its parent's hash and token ids), a cached block evicted, the cache reset. The
  KV-event publisher (:mod:`tests.simulator.kvevents`) turns these into vLLM's events.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Protocol


class Block:
    """One KV-cache block: its id, cached content hash (``None``: none) and users."""

    __slots__ = ("block_hash", "block_id", "ref_count")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.block_hash: bytes | None = None
        self.ref_count = 0

    def __repr__(self) -> str:
        digest = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return f"Block(id={self.block_id}, hash={digest}, refs={self.ref_count})"


def block_hashes(cache_key: str, contents: Iterable[bytes]) -> tuple[bytes, ...]:
    """The hash chain over ``contents`` (one entry per full block), seeded by ``cache_key``."""
    parent = hashlib.sha256(b"model:" + cache_key.encode()).digest()
    chain: list[bytes] = []
    for content in contents:
        digest = hashlib.sha256(parent)
        digest.update(content)
        parent = digest.digest()
        chain.append(parent)
    return tuple(chain)


class KVCacheListener(Protocol):
    """Hears changes of a :class:`KVCache`'s cached content (synchronously, in order)."""

    def stored(
        self,
        block_hash: bytes,
        parent_hash: bytes | None,
        token_ids: Sequence[int],
        lora_name: str | None = None,
    ) -> None:
        """A block became findable under ``block_hash`` (``parent_hash``: ``None`` first;
        ``lora_name``: the LoRA adapter whose request computed it)."""

    def removed(self, block_hash: bytes) -> None:
        """The cached block ``block_hash`` was evicted."""

    def cleared(self) -> None:
        """Every cached block was dropped (a prefix-cache reset)."""


class KVCache:
    """Block pool with prefix caching and LRU eviction of unreferenced cached blocks."""

    def __init__(
        self, num_blocks: int, block_size: int, *, listener: KVCacheListener | None = None
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self._num_blocks = num_blocks
        self._block_size = block_size
        self._next_fresh = 0  # blocks with an id >= this were never handed out
        self._unhashed_free: list[Block] = []  # reused first, last freed first
        self._evictable: OrderedDict[int, Block] = OrderedDict()  # least recently freed first
        self._by_hash: dict[bytes, Block] = {}
        self._used = 0
        self._evictions = 0
        self.listener = listener

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_used(self) -> int:
        """Blocks referenced by at least one request."""
        return self._used

    @property
    def num_free(self) -> int:
        """Blocks a new allocation may take (including cached unreferenced ones)."""
        return self._num_blocks - self._used

    @property
    def num_cached(self) -> int:
        """Blocks holding findable content, referenced or not."""
        return len(self._by_hash)

    @property
    def num_evictions(self) -> int:
        """Cached blocks whose content was dropped to make room so far."""
        return self._evictions

    @property
    def usage(self) -> float:
        """Referenced blocks over all blocks (vLLM's ``kv_cache_usage_perc``)."""
        return self._used / self._num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self._block_size)

    def is_cached(self, block_hash: bytes) -> bool:
        return block_hash in self._by_hash

    def longest_prefix(self, hashes: Sequence[bytes], max_blocks: int) -> list[Block]:
        """The cached blocks matching the longest prefix of ``hashes`` (at most ``max_blocks``)."""
        found: list[Block] = []
        by_hash = self._by_hash
        for block_hash in hashes[: max(0, max_blocks)]:
            block = by_hash.get(block_hash)
            if block is None:
                break
            found.append(block)
        return found

    def can_allocate(self, hits: Sequence[Block], num_new: int) -> bool:
        """Whether :meth:`acquire` of ``hits`` plus :meth:`allocate` of ``num_new`` fits."""
        revived = sum(1 for block in hits if block.ref_count == 0)
        return num_new + revived <= self.num_free

    def acquire(self, hits: Iterable[Block]) -> None:
        """Take a reference on cached blocks found by :meth:`longest_prefix`."""
        for block in hits:
            if block.ref_count == 0:
                del self._evictable[block.block_id]
                self._used += 1
            block.ref_count += 1

    def allocate(self, count: int) -> list[Block]:
        """Take ``count`` free blocks (referenced once each), evicting cached ones if needed."""
        if count > self.num_free:
            raise RuntimeError(f"cannot allocate {count} blocks, {self.num_free} free")
        taken: list[Block] = []
        for _ in range(count):
            if self._unhashed_free:
                block = self._unhashed_free.pop()
            elif self._next_fresh < self._num_blocks:
                block = Block(self._next_fresh)
                self._next_fresh += 1
            else:
                _, block = self._evictable.popitem(last=False)
                assert block.block_hash is not None
                del self._by_hash[block.block_hash]
                if self.listener is not None:
                    self.listener.removed(block.block_hash)
                block.block_hash = None
                self._evictions += 1
            block.ref_count = 1
            taken.append(block)
        self._used += count
        return taken

    def cache(
        self,
        block: Block,
        block_hash: bytes,
        *,
        parent_hash: bytes | None = None,
        token_ids: Sequence[int] = (),
        lora_name: str | None = None,
    ) -> bool:
        """Make ``block`` findable under ``block_hash``; ``False`` if that content is cached.

        ``parent_hash`` (the previous block's hash, ``None`` for a first block) and
        ``token_ids`` (the block's tokens) and ``lora_name`` are only passed on to the
        listener.
        """
        if block_hash in self._by_hash or block.block_hash is not None:
            return False
        block.block_hash = block_hash
        self._by_hash[block_hash] = block
        if self.listener is not None:
            self.listener.stored(block_hash, parent_hash, token_ids, lora_name)
        return True

    def reset(self) -> bool:
        """Drop every cached block (vLLM's prefix-cache reset); ``False`` while any is in use.

        Like vLLM, a reset is refused while requests hold blocks.
        """
        if self._used:
            return False
        for block in self._evictable.values():
            block.block_hash = None
            self._unhashed_free.append(block)
        self._evictable.clear()
        self._by_hash.clear()
        if self.listener is not None:
            self.listener.cleared()
        return True

    def free(self, blocks: Sequence[Block]) -> None:
        """Drop one reference on each block of a request (tail first)."""
        for block in reversed(blocks):
            block.ref_count -= 1
            if block.ref_count > 0:
                continue
            self._used -= 1
            if block.block_hash is not None:
                self._evictable[block.block_id] = block
            else:
                self._unhashed_free.append(block)
