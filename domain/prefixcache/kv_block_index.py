"""The in-memory index of the blocks each endpoint's KV cache holds, fed by its events.

- Per endpoint, insertion-ordered maps of block hash → the tiers (media) holding it,
  capped at ``max_blocks_per_endpoint``: past the cap the oldest stored block is dropped
  (a publisher that floods cannot grow memory beyond the cap times the pool size).
  Bounded pauses: the maps are shards of at most about ``SHARD_BLOCKS`` blocks, by the
  hash's value, each with its share of the cap, so that no single operation grows,
  rehashes or frees a map of a million entries (one ``OrderedDict`` growing past 700,000
  entries held the event loop for up to a second); a cap below ``2 * SHARD_BLOCKS`` is one
  shard, dropped exactly oldest first, above it oldest first within each shard. A cleared
  or forgotten endpoint's blocks are freed a bounded number per later call, oldest first
  over its shards (``RELEASE_SHARDS``, ``RELEASE_BLOCKS``).
  The shards are plain dicts from int to str (the tiers, joined), which the garbage
  collector leaves untracked: a full collection does not walk them (with ``OrderedDict``
  shards of 1.5 M entries one took 2.7 s).
- Memory: about 110 bytes per (block, endpoint) entry traced, 125 of RSS (the hash's int
  and its slot; the tier strings are shared), so the default ``max_blocks_per_endpoint``
  (1,048,576) bounds one endpoint at about 130 MiB (``tests.bench.kv_index_memory``; an
  ``OrderedDict`` of tuples took 228 bytes traced).
- An endpoint whose stream broke (``lost``) is *untrusted*: ``match`` ignores it until
  ``resynced`` or an ``AllBlocksCleared``. Its blocks are kept, so a replay only has to
  add what was missed.
- Speculative entries: right after routing, the chosen endpoint is credited with the
  prompt's blocks for ``ttl`` seconds (``speculate``), so a burst of one prefix sticks to
  one endpoint before its events arrive; a stored event makes the entry real, and the
  entry lapses otherwise.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

from ports.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, StoredBlock
from ports.metric_catalogue import KV_INDEX_ENTRIES
from ports.observer import NoopObserver, Observer

__all__ = [
    "DEFAULT_MEDIUM",
    "RELEASE_BLOCKS",
    "RELEASE_SHARDS",
    "SHARD_BLOCKS",
    "InMemoryKVBlockIndex",
]

DEFAULT_MEDIUM = "GPU"
"""The tier of a block whose event names none."""
SHARD_BLOCKS = 2048
"""The blocks one shard of an endpoint's map holds (up to twice as many, per the cap)."""
RELEASE_SHARDS = 4
"""Shards of cleared endpoints taken apart per ``apply`` or ``forget``."""
RELEASE_BLOCKS = 2048
"""Blocks of cleared endpoints freed per ``apply`` or ``forget``, oldest first."""
_ROUND_BLOCKS = 16  # freed from each cleared shard per round
_MEDIA_INTERNED = 256  # distinct tier strings shared between entries
_SEPARATOR = "\x1f"  # between the tiers of a block held in several

_Shard = dict[int, str]  # hash -> its tiers, joined by _SEPARATOR; oldest stored first


class _Endpoint:
    __slots__ = ("count", "shards", "speculative", "trusted")

    def __init__(self, shards: int) -> None:
        self.shards: list[_Shard | None] = [None] * shards
        self.count = 0  # blocks held, over the shards
        self.speculative: dict[int, float] = {}  # hash -> expiry (monotonic seconds)
        self.trusted = True

    def blocks(self) -> list[StoredBlock]:
        return [
            (block, tuple(media.split(_SEPARATOR)))
            for shard in self.shards
            if shard
            for block, media in shard.items()
        ]


class InMemoryKVBlockIndex:
    """Block hash → endpoints (and tiers), per endpoint bounded; see the module docstring.

    Not thread-safe: used on the event loop only.
    """

    def __init__(
        self,
        *,
        max_blocks_per_endpoint: int = 1 << 20,
        max_speculative_per_endpoint: int = 1 << 14,
        observer: Observer | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_blocks_per_endpoint < 1 or max_speculative_per_endpoint < 0:
            raise ValueError("max_blocks_per_endpoint must be >= 1, speculative cap >= 0")
        self._cap = max_blocks_per_endpoint
        self._shards = max(1, max_blocks_per_endpoint // SHARD_BLOCKS)
        self._shard_cap = max_blocks_per_endpoint // self._shards
        self._spec_cap = max_speculative_per_endpoint
        self._endpoints: dict[str, _Endpoint] = {}
        self._entries = 0
        self._released: list[_Shard] = []  # cleared shards, taken apart a few at a time
        self._freeing: list[list[int]] = []  # their hashes, newest first, freed in rounds
        self._cursor = 0  # where in ``_freeing`` the round is
        self._media: dict[str, str] = {}
        self._observer = observer if observer is not None else NoopObserver()
        self._clock = clock

    # KVEventSink

    def apply(self, endpoint: str, events: Sequence[KVEvent]) -> None:
        self._release()
        state = self._state(endpoint)
        for event in events:
            if isinstance(event, BlockStored):
                self._store(state, event.block_hashes, event.medium or DEFAULT_MEDIUM)
            elif isinstance(event, BlockRemoved):
                self._remove(state, event.block_hashes, event.medium or DEFAULT_MEDIUM)
            elif isinstance(event, AllBlocksCleared):
                self._clear(state)
                state.speculative.clear()
                state.trusted = True
        self._observer.gauge(KV_INDEX_ENTRIES, {}, self._entries)

    def lost(self, endpoint: str) -> None:
        state = self._state(endpoint)
        state.trusted = False
        state.speculative.clear()

    def resynced(self, endpoint: str) -> None:
        state = self._endpoints.get(endpoint)
        if state is not None:
            state.trusted = True

    def forget(self, endpoint: str) -> None:
        self._release()
        state = self._endpoints.pop(endpoint, None)
        if state is not None:
            self._clear(state)
            self._observer.gauge(KV_INDEX_ENTRIES, {}, self._entries)

    # routing path

    def match(self, hashes: Sequence[int], endpoints: Sequence[str]) -> Mapping[str, int]:
        out: dict[str, int] = {}
        now = -1.0
        for name in endpoints:
            state = self._endpoints.get(name)
            if state is None or not state.trusted:
                continue
            shards = state.shards
            width = len(shards)
            speculative = state.speculative
            count = 0
            for block_hash in hashes:
                shard = shards[block_hash % width]
                if shard is not None and block_hash in shard:
                    count += 1
                    continue
                expiry = speculative.get(block_hash)
                if expiry is None:
                    break
                if now < 0:
                    now = self._clock()
                if expiry <= now:
                    del speculative[block_hash]
                    break
                count += 1
            if count:
                out[name] = count
        return out

    def speculate(self, endpoint: str, hashes: Sequence[int], ttl: float) -> None:
        """Credit ``endpoint`` with ``hashes`` for ``ttl`` seconds, until events confirm."""
        state = self._endpoints.get(endpoint)
        if state is None or not state.trusted or self._spec_cap == 0:
            return
        expiry = self._clock() + ttl
        speculative = state.speculative
        shards = state.shards
        width = len(shards)
        for block_hash in hashes:
            shard = shards[block_hash % width]
            if shard is None or block_hash not in shard:
                speculative[block_hash] = expiry
        if len(speculative) > self._spec_cap:
            now = self._clock()
            for block_hash in [h for h, e in speculative.items() if e <= now]:
                del speculative[block_hash]
            while len(speculative) > self._spec_cap:
                del speculative[next(iter(speculative))]

    def size(self) -> int:
        return self._entries

    def snapshot(self, endpoint: str) -> list[StoredBlock]:
        """``endpoint``'s blocks and their tiers, oldest stored first (within each shard)."""
        state = self._endpoints.get(endpoint)
        return state.blocks() if state is not None else []

    def load(self, endpoint: str, blocks: Sequence[StoredBlock]) -> int:
        """Add ``blocks`` (oldest first, e.g. a shared store's copy) as older than every
        block the endpoint's own events stored: a block already known keeps what the
        events said. The cap drops the oldest. Returns how many were added."""
        state = self._state(endpoint)
        shards = state.shards
        width = len(shards)
        cap = self._shard_cap
        older: list[dict[int, str]] = [{} for _ in shards]  # per shard, newest first
        added = 0
        for block_hash, media in reversed(blocks):
            index = block_hash % width
            shard = shards[index]
            taken = older[index]
            if (
                len(taken) + (len(shard) if shard else 0) >= cap
                or (shard and block_hash in shard)
                or block_hash in taken
                or not media
            ):
                continue
            taken[block_hash] = self._intern(_SEPARATOR.join(media))
            added += 1
        for index, taken in enumerate(older):
            if taken:
                merged = dict(reversed(taken.items()))  # oldest first, then the known ones
                merged.update(shards[index] or {})
                shards[index] = merged
        state.count += added
        self._entries += added
        self._observer.gauge(KV_INDEX_ENTRIES, {}, self._entries)
        return added

    def endpoint_size(self, endpoint: str) -> int:
        state = self._endpoints.get(endpoint)
        return state.count if state is not None else 0

    def trusted(self, endpoint: str) -> bool:
        """Whether ``endpoint`` is known and its stream unbroken."""
        state = self._endpoints.get(endpoint)
        return state is not None and state.trusted

    def _state(self, endpoint: str) -> _Endpoint:
        state = self._endpoints.get(endpoint)
        if state is None:
            state = self._endpoints[endpoint] = _Endpoint(self._shards)
        return state

    def _intern(self, media: str) -> str:
        """One shared string per distinct set of tiers (a few), not one per entry."""
        shared = self._media.get(media)
        if shared is not None:
            return shared
        if len(self._media) < _MEDIA_INTERNED:
            self._media[media] = media
        return media

    def _clear(self, state: _Endpoint) -> None:
        """Drop every block of ``state``; the shards are freed by later calls."""
        if not state.count:
            return  # nothing held (empty shards are kept): a flood of clears costs nothing
        self._entries -= state.count
        state.count = 0
        self._released.extend(shard for shard in state.shards if shard)
        state.shards = [None] * len(state.shards)

    def _release(self) -> None:
        """Free a bounded part of what cleared endpoints held: first their shards become
        lists of their hashes (``RELEASE_SHARDS`` a call; nothing is freed yet), then
        ``RELEASE_BLOCKS`` a call, in rounds over the lists taking the oldest few of each,
        so blocks go in about the order they came. Freed a shard at a time, the last shard
        freed the memory of all of them at once (the allocator's arenas hold hashes of
        every shard, and one is returned when its last hash goes): 13-15 ms for 1.5 M."""
        released = self._released
        if released:
            for _ in range(min(RELEASE_SHARDS, len(released))):
                hashes = list(released.pop())
                hashes.reverse()
                self._freeing.append(hashes)
            return
        freeing = self._freeing
        if freeing:
            start = self._cursor
            stop = start + RELEASE_BLOCKS // _ROUND_BLOCKS
            for hashes in freeing[start:stop]:
                del hashes[-_ROUND_BLOCKS:]
            if stop < len(freeing):
                self._cursor = stop
            else:  # a round over every list: the next starts with what is left
                self._freeing = [hashes for hashes in freeing if hashes]
                self._cursor = 0

    def _store(self, state: _Endpoint, hashes: Sequence[int], medium: str) -> None:
        shards = state.shards
        width = len(shards)
        cap = self._shard_cap
        speculative = state.speculative
        single = self._intern(medium)
        added = 0
        for block_hash in hashes:
            index = block_hash % width
            shard = shards[index]
            if shard is None:
                shard = shards[index] = {}
            media = shard.pop(block_hash, None)
            if media is None:
                shard[block_hash] = single
                if len(shard) > cap:
                    del shard[next(iter(shard))]  # the oldest stored
                else:
                    added += 1
            elif media == single or medium in media.split(_SEPARATOR):
                shard[block_hash] = media  # stored again: the newest now
            else:
                shard[block_hash] = self._intern(media + _SEPARATOR + medium)
            speculative.pop(block_hash, None)
        state.count += added
        self._entries += added

    def _remove(self, state: _Endpoint, hashes: Sequence[int], medium: str) -> None:
        shards = state.shards
        width = len(shards)
        removed = 0
        for block_hash in hashes:
            shard = shards[block_hash % width]
            media = shard.get(block_hash) if shard is not None else None
            if shard is None or media is None:
                continue  # never stored (or already evicted by the cap): nothing to undo
            rest = [m for m in media.split(_SEPARATOR) if m != medium]
            if rest:
                shard[block_hash] = self._intern(_SEPARATOR.join(rest))
            else:
                del shard[block_hash]
                removed += 1
        state.count -= removed
        self._entries -= removed
