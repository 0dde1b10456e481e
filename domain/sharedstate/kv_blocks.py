"""``InMemoryKVBlockStore``: the ``KVBlockStore`` port in one process's memory.

What the Redis store (``adapters/redis/kv_blocks.py``) keeps on the server, kept here: per
endpoint an insertion-ordered map hash → tiers, capped, and a writer lease. One process
has nothing to share, so the app never wires it; it is the reference the contract suite
holds the Redis store to, and the tests' stand-in for "the same store" seen by several
``SharedKVBlockIndex`` objects.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from ports.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, StoredBlock

__all__ = ["DEFAULT_MEDIUM", "InMemoryKVBlockStore", "apply_events"]

DEFAULT_MEDIUM = "GPU"


def apply_events(
    blocks: OrderedDict[int, tuple[str, ...]], events: Sequence[KVEvent], cap: int
) -> None:
    """``events`` applied to one endpoint's ``blocks`` (the rules of the port), capped."""
    for event in events:
        if isinstance(event, BlockStored):
            medium = event.medium or DEFAULT_MEDIUM
            for block_hash in event.block_hashes:
                media = blocks.get(block_hash)
                if media is None:
                    blocks[block_hash] = (medium,)
                else:
                    if medium not in media:
                        blocks[block_hash] = (*media, medium)
                    blocks.move_to_end(block_hash)
        elif isinstance(event, BlockRemoved):
            medium = event.medium or DEFAULT_MEDIUM
            for block_hash in event.block_hashes:
                media = blocks.get(block_hash)
                if media is None:
                    continue
                rest = tuple(m for m in media if m != medium)
                if rest:
                    blocks[block_hash] = rest
                else:
                    del blocks[block_hash]
        elif isinstance(event, AllBlocksCleared):
            blocks.clear()
    while len(blocks) > cap:
        blocks.popitem(last=False)


class InMemoryKVBlockStore:
    """A ``KVBlockStore`` in memory; never raises. Not thread-safe (event loop only)."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._blocks: dict[str, OrderedDict[int, tuple[str, ...]]] = {}
        # endpoint -> (owner, expiry); owner "" once released (current until expiry)
        self._leases: dict[str, tuple[str, float]] = {}
        self._clock = clock

    async def claim(self, endpoint: str, owner: str, lease: float) -> bool | None:
        now = self._clock()
        held = self._leases.get(endpoint)
        if held is not None and held[0] not in ("", owner) and held[1] > now:
            return None
        self._leases[endpoint] = (owner, now + lease)
        renewed = held is not None and held[0] == owner and held[1] > now
        return not (renewed and bool(self._blocks.get(endpoint)))

    async def apply(self, endpoint: str, events: Sequence[KVEvent], cap: int) -> None:
        apply_events(self._blocks.setdefault(endpoint, OrderedDict()), events, cap)

    async def replace(self, endpoint: str, blocks: Sequence[StoredBlock], cap: int) -> None:
        copy: OrderedDict[int, tuple[str, ...]] = OrderedDict()
        for block_hash, media in blocks[max(0, len(blocks) - cap) :]:
            if media:
                copy[block_hash] = tuple(media)
                copy.move_to_end(block_hash)
        self._blocks[endpoint] = copy

    async def blocks(self, endpoint: str, limit: int) -> list[StoredBlock]:
        copy = self._blocks.get(endpoint)
        if copy is None or limit <= 0:
            return []
        items = list(copy.items())
        return items[max(0, len(items) - limit) :]

    async def forget(self, endpoint: str) -> None:
        self._blocks.pop(endpoint, None)
        self._leases.pop(endpoint, None)

    async def release(self, endpoint: str, owner: str, lease: float) -> None:
        held = self._leases.get(endpoint)
        if held is not None and held[0] == owner and held[1] > self._clock():
            self._leases[endpoint] = ("", self._clock() + lease)

    async def current(self, endpoint: str) -> bool:
        held = self._leases.get(endpoint)
        return held is not None and held[1] > self._clock()
