"""The in-memory ``PrefixIndex``: per-endpoint LRUs of block hashes and who holds each hash.

Layout, chosen for memory (the index holds millions of (hash, endpoint) entries) and for
bounded pauses (resizing one multi-million-entry dict would stall the event loop for
hundreds of milliseconds):

- endpoint names are interned to small integer ids (freed ids are reused, lowest first);
- the owner map, hash → bit mask of the ids of the endpoints holding it, is the only
  hash-keyed table. It is split into 256 shards by the hash's low bits so that each dict
  stays small. A hash held by one endpoint (the common case) shares a pre-built
  single-bit int, so it costs one dict slot and its int object;
- each endpoint's recency order is a ``deque`` of hashes, oldest first: ``add`` appends
  every hash it is given (one C-level ``extend``). A hash the endpoint already holds is
  appended again and its older occurrence becomes stale; ``_Lru.stale`` counts stale
  occurrences per hash, so eviction from the left skips them and removes a hash only
  when its latest occurrence comes out. This is exact LRU at about 8 bytes per entry.
  When stale occurrences outnumber the live entries the deque is compacted.

Everything runs on the event loop thread; the async port methods never await, so each
call is atomic with respect to the others. The ``*_sync`` methods are the same
operations for callers that cannot await (endpoint-deletion listeners, benchmarks).
"""

from __future__ import annotations

import heapq
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol, runtime_checkable

from ports.prefix_index import CLAIM_HALF_LIFE

__all__ = ["InMemoryPrefixIndex", "SupportsSyncEndpointRemoval"]

_SHARD_MASK = 0xFF
#: Compact a deque when it holds more than twice its live entries plus this many.
_COMPACT_SLACK = 1024
#: Claim counts closer than this are equal (the claimer's own choice wins).
_CLAIM_EPSILON = 1e-3
#: Endpoints whose recent claim counts are kept before the negligible ones are dropped.
_CLAIMED_LIMIT = 4096


@runtime_checkable
class SupportsSyncEndpointRemoval(Protocol):
    """A prefix index that can forget an endpoint synchronously (no await needed)."""

    def remove_endpoint_sync(self, endpoint: str) -> None: ...


class _Lru:
    """One endpoint's recency order: ``order`` (oldest left) holds each live hash once
    plus ``stale[h]`` older occurrences of it; ``live`` counts the distinct hashes."""

    __slots__ = ("live", "order", "stale")

    def __init__(self) -> None:
        self.order: deque[int] = deque()
        self.stale: Counter[int] = Counter()
        self.live = 0


class InMemoryPrefixIndex:
    """A per-process ``PrefixIndex``: exact per-endpoint LRU, least recently added first out.

    ``add(hashes, endpoint, capacity)`` records the hashes in order (an already held hash
    becomes the most recent again), then evicts the endpoint's oldest hashes beyond
    ``capacity`` (a capacity different from the last call resizes the endpoint's LRU).
    ``match`` walks the hashes in order, stops at the first hash no endpoint holds, and
    counts for every endpoint each walked hash it holds (not necessarily consecutively).
    ``size()`` is the number of (hash, endpoint) entries. Hashes are unsigned 64-bit ints.
    """

    __slots__ = (
        "_bits",
        "_claimed",
        "_clock",
        "_entries",
        "_free",
        "_ids",
        "_lrus",
        "_names",
        "_shards",
    )

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        #: endpoint -> (new chains claimed for it, decayed; when that was computed)
        self._claimed: dict[str, tuple[float, float]] = {}
        self._ids: dict[str, int] = {}
        self._names: list[str | None] = []
        self._lrus: list[_Lru | None] = []
        self._bits: list[int] = []
        self._free: list[int] = []  # heap of released ids
        self._shards: list[dict[int, int]] = [{} for _ in range(_SHARD_MASK + 1)]
        self._entries = 0

    # PrefixIndex port
    async def match(self, hashes: Sequence[int]) -> Mapping[str, int]:
        return self.match_sync(hashes)

    async def add(self, hashes: Sequence[int], endpoint: str, capacity: int) -> None:
        self.add_sync(hashes, endpoint, capacity)

    async def remove_endpoint(self, endpoint: str) -> None:
        self.remove_endpoint_sync(endpoint)

    async def claim(
        self,
        hashes: Sequence[int],
        endpoint: str,
        capacity: int,
        alternates: Sequence[str] = (),
    ) -> str:
        return self.claim_sync(hashes, endpoint, capacity, alternates)

    async def add_tail(
        self, hashes: Sequence[int], held: int, endpoint: str, capacity: int
    ) -> None:
        self.add_sync(hashes[held:], endpoint, capacity)

    def size(self) -> int:
        return self._entries

    # Synchronous operations
    def match_sync(self, hashes: Sequence[int]) -> dict[str, int]:
        """Endpoint name → matched blocks, for the endpoints that match at least one."""
        shards = self._shards
        masks: list[int] = []
        append = masks.append
        for h in hashes:
            mask = shards[h & _SHARD_MASK].get(h)
            if mask is None:
                break
            append(mask)
        if not masks:
            return {}
        first = masks[0]
        walked = len(masks)
        tally: Mapping[int, int] = (
            {first: walked} if masks.count(first) == walked else Counter(masks)
        )
        names = self._names
        result: dict[str, int] = {}
        for mask, count in tally.items():
            bits = mask
            while bits:
                low = bits & -bits
                name = names[low.bit_length() - 1]
                if name is not None:
                    result[name] = result.get(name, 0) + count
                bits ^= low
        return result

    def add_sync(self, hashes: Sequence[int], endpoint: str, capacity: int) -> None:
        """Record ``hashes`` (most recent last) for ``endpoint``; keep at most ``capacity``."""
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        ep = self._ids.get(endpoint)
        if ep is None:
            ep = self._intern(endpoint)
        lru = self._lrus[ep]
        assert lru is not None
        bit = self._bits[ep]
        shards = self._shards
        retouched: list[int] = []
        added = 0
        for h in hashes:
            shard = shards[h & _SHARD_MASK]
            mask = shard.get(h)
            if mask is None:
                shard[h] = bit
                added += 1
            elif mask & bit:  # held already: its older occurrence goes stale
                retouched.append(h)
            else:
                shard[h] = mask | bit
                added += 1
        if retouched:
            lru.stale.update(retouched)
        lru.order.extend(hashes)
        lru.live += added
        self._entries += added
        if lru.live > capacity:
            self._evict(lru, bit, lru.live - capacity)
        if len(lru.order) > 2 * lru.live + _COMPACT_SLACK:
            _compact(lru)

    def claim_sync(
        self,
        hashes: Sequence[int],
        endpoint: str,
        capacity: int,
        alternates: Sequence[str] = (),
    ) -> str:
        """``ClaimingPrefixIndex.claim``: unless some endpoint holds the first hash, the
        least claimed lately of ``endpoint`` and ``alternates`` records ``hashes``; else
        the endpoint matching the most is returned (the lowest id among equals)."""
        if hashes:
            first = hashes[0]
            if self._shards[first & _SHARD_MASK].get(first) is not None:
                held = self.match_sync(hashes)
                if held:
                    return max(held, key=held.__getitem__)
        now = self._clock()
        claimed = self._claimed
        choices = [endpoint, *(a for a in alternates if a != endpoint)]
        counts = [_decayed(claimed.get(name), now) for name in choices]
        best = 0
        for i in range(1, len(choices)):
            if counts[i] < counts[best] - _CLAIM_EPSILON:
                best = i
        chosen = choices[best]
        claimed[chosen] = (counts[best] + 1.0, now)
        if len(claimed) > _CLAIMED_LIMIT:
            self._claimed = {
                name: entry for name, entry in claimed.items() if _decayed(entry, now) > 0.01
            }
        self.add_sync(hashes, chosen, capacity)
        return chosen

    def remove_endpoint_sync(self, endpoint: str) -> None:
        """Forget ``endpoint`` and every hash it holds; unknown names are ignored."""
        self._claimed.pop(endpoint, None)
        ep = self._ids.pop(endpoint, None)
        if ep is None:
            return
        lru = self._lrus[ep]
        assert lru is not None
        shards = self._shards
        bits = self._bits
        bit = bits[ep]
        for h in dict.fromkeys(lru.order):
            shard = shards[h & _SHARD_MASK]
            mask = shard.pop(h) ^ bit
            if mask:
                shard[h] = bits[mask.bit_length() - 1] if not mask & (mask - 1) else mask
        self._entries -= lru.live
        self._lrus[ep] = None
        self._names[ep] = None
        heapq.heappush(self._free, ep)

    def holds(self, endpoint: str) -> bool:
        """Whether the index knows ``endpoint`` (added to and not removed)."""
        return endpoint in self._ids

    def endpoint_count(self) -> int:
        """How many endpoints the index knows (added to and not removed)."""
        return len(self._ids)

    # Internals
    def _intern(self, endpoint: str) -> int:
        if self._free:
            ep = heapq.heappop(self._free)
            self._names[ep] = endpoint
            self._lrus[ep] = _Lru()
        else:
            ep = len(self._names)
            self._names.append(endpoint)
            self._lrus.append(_Lru())
            self._bits.append(1 << ep)
        self._ids[endpoint] = ep
        return ep

    def _evict(self, lru: _Lru, bit: int, count: int) -> None:
        """Remove the ``count`` least recently added hashes of ``lru``."""
        shards = self._shards
        bits = self._bits
        popleft = lru.order.popleft
        stale = lru.stale
        left = count
        while left:
            h = popleft()
            if stale:
                older = stale.get(h)
                if older:  # a newer occurrence follows: not evicted
                    if older == 1:
                        del stale[h]
                    else:
                        stale[h] = older - 1
                    continue
            shard = shards[h & _SHARD_MASK]
            mask = shard.pop(h) ^ bit
            if mask:
                # A single remaining holder shares the pre-built int of its bit.
                shard[h] = bits[mask.bit_length() - 1] if not mask & (mask - 1) else mask
            left -= 1
        lru.live -= count
        self._entries -= count


def _decayed(entry: tuple[float, float] | None, now: float) -> float:
    """A claim count as of ``now``: halved every ``CLAIM_HALF_LIFE`` seconds."""
    if entry is None:
        return 0.0
    count, at = entry
    return count * float(0.5 ** (max(0.0, now - at) / CLAIM_HALF_LIFE))


def _compact(lru: _Lru) -> None:
    """Drop the stale occurrences: keep each hash's latest occurrence, in order."""
    latest_first = list(dict.fromkeys(reversed(lru.order)))
    latest_first.reverse()
    lru.order = deque(latest_first)
    lru.stale.clear()
