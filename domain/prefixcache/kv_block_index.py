"""The in-memory index of the blocks each endpoint's KV cache holds, fed by its events.

- Per endpoint, an insertion-ordered map of block hash → the tiers (media) holding it,
  capped at ``max_blocks_per_endpoint``: past the cap the oldest stored block is dropped
  (a publisher that floods cannot grow memory beyond the cap times the pool size).
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
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence

from ports.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, StoredBlock
from ports.metric_catalogue import KV_INDEX_ENTRIES
from ports.observer import NoopObserver, Observer

__all__ = ["DEFAULT_MEDIUM", "InMemoryKVBlockIndex"]

DEFAULT_MEDIUM = "GPU"
"""The tier of a block whose event names none."""


class _Endpoint:
    __slots__ = ("blocks", "speculative", "trusted")

    def __init__(self) -> None:
        self.blocks: OrderedDict[int, tuple[str, ...]] = OrderedDict()
        self.speculative: dict[int, float] = {}  # hash -> expiry (monotonic seconds)
        self.trusted = True


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
        self._spec_cap = max_speculative_per_endpoint
        self._endpoints: dict[str, _Endpoint] = {}
        self._entries = 0
        self._observer = observer if observer is not None else NoopObserver()
        self._clock = clock

    # KVEventSink

    def apply(self, endpoint: str, events: Sequence[KVEvent]) -> None:
        state = self._endpoints.get(endpoint)
        if state is None:
            state = self._endpoints[endpoint] = _Endpoint()
        for event in events:
            if isinstance(event, BlockStored):
                self._store(state, event.block_hashes, event.medium or DEFAULT_MEDIUM)
            elif isinstance(event, BlockRemoved):
                self._remove(state, event.block_hashes, event.medium or DEFAULT_MEDIUM)
            elif isinstance(event, AllBlocksCleared):
                self._entries -= len(state.blocks)
                state.blocks.clear()
                state.speculative.clear()
                state.trusted = True
        self._observer.gauge(KV_INDEX_ENTRIES, {}, self._entries)

    def lost(self, endpoint: str) -> None:
        state = self._endpoints.get(endpoint)
        if state is None:
            state = self._endpoints[endpoint] = _Endpoint()
        state.trusted = False
        state.speculative.clear()

    def resynced(self, endpoint: str) -> None:
        state = self._endpoints.get(endpoint)
        if state is not None:
            state.trusted = True

    def forget(self, endpoint: str) -> None:
        state = self._endpoints.pop(endpoint, None)
        if state is not None:
            self._entries -= len(state.blocks)
            self._observer.gauge(KV_INDEX_ENTRIES, {}, self._entries)

    # routing path

    def match(self, hashes: Sequence[int], endpoints: Sequence[str]) -> Mapping[str, int]:
        out: dict[str, int] = {}
        now = -1.0
        for name in endpoints:
            state = self._endpoints.get(name)
            if state is None or not state.trusted:
                continue
            blocks = state.blocks
            speculative = state.speculative
            count = 0
            for block_hash in hashes:
                if block_hash in blocks:
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
        blocks = state.blocks
        for block_hash in hashes:
            if block_hash not in blocks:
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
        """``endpoint``'s blocks and their tiers, oldest stored first."""
        state = self._endpoints.get(endpoint)
        return list(state.blocks.items()) if state is not None else []

    def load(self, endpoint: str, blocks: Sequence[StoredBlock]) -> int:
        """Add ``blocks`` (oldest first, e.g. a shared store's copy) as older than every
        block the endpoint's own events stored: a block already known keeps what the
        events said. The cap drops the oldest. Returns how many were added."""
        state = self._endpoints.get(endpoint)
        if state is None:
            state = self._endpoints[endpoint] = _Endpoint()
        known = state.blocks
        room = self._cap - len(known)
        added = 0
        for block_hash, media in reversed(blocks):
            if room <= 0:
                break
            if block_hash in known or not media:
                continue
            known[block_hash] = tuple(media)
            known.move_to_end(block_hash, last=False)
            room -= 1
            added += 1
        self._entries += added
        self._observer.gauge(KV_INDEX_ENTRIES, {}, self._entries)
        return added

    def endpoint_size(self, endpoint: str) -> int:
        state = self._endpoints.get(endpoint)
        return len(state.blocks) if state is not None else 0

    def trusted(self, endpoint: str) -> bool:
        """Whether ``endpoint`` is known and its stream unbroken."""
        state = self._endpoints.get(endpoint)
        return state is not None and state.trusted

    def _store(self, state: _Endpoint, hashes: Sequence[int], medium: str) -> None:
        blocks = state.blocks
        speculative = state.speculative
        for block_hash in hashes:
            media = blocks.get(block_hash)
            if media is None:
                blocks[block_hash] = (medium,)
                self._entries += 1
            else:
                if medium not in media:
                    blocks[block_hash] = (*media, medium)
                blocks.move_to_end(block_hash)
            speculative.pop(block_hash, None)
        overflow = len(blocks) - self._cap
        for _ in range(max(0, overflow)):
            blocks.popitem(last=False)
        if overflow > 0:
            self._entries -= overflow

    def _remove(self, state: _Endpoint, hashes: Sequence[int], medium: str) -> None:
        blocks = state.blocks
        for block_hash in hashes:
            media = blocks.get(block_hash)
            if media is None:
                continue  # never stored (or already evicted by the cap): nothing to undo
            rest = tuple(m for m in media if m != medium)
            if rest:
                blocks[block_hash] = rest
            else:
                del blocks[block_hash]
                self._entries -= 1
