"""In-memory ``SharedLoad`` and ``SharedAdmission`` implementations (``ports.shared_state``).

- ``LocalSharedLoad``: one process alone, the default when no shared store is configured.
  ``others()`` and ``kv_blocks()`` are always the same empty mapping, ``flows()`` always
  ``NO_POOL_FLOWS``, and ``publish``/``publish_flow``/``publish_blocks`` do nothing, so a
  caller pays one method call.
- ``LoadBoard``: a store that several members (each one "process") share inside one
  process, for tests: ``board.member("a")`` is a ``SharedLoad`` and a ``SharedAdmission``.
  Each member's totals carry a lease of ``lease`` seconds on the board's clock, renewed by
  every ``publish`` and by ``renew()`` (what a real implementation's background task does
  every lease/3); a member whose lease lapsed drops out of every other member's
  ``others()``. Its flow counts and KV blocks carry the shorter ``admission_lease`` (1 s),
  renewed the same way. Reads are immediate (``staleness`` 0); a member's ``watch``
  callbacks run as soon as another member's ``publish_flow`` changed a count.

``others()`` and ``flows()`` return the same object for as long as their content does not
change, so a caller may compare by identity to skip work.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType

from ports.shared_state import (
    HASH_MASK,
    NO_POOL_FLOWS,
    SAMPLE_MASK,
    EndpointLoad,
    FlowCounts,
    PoolBlocks,
    PoolFlows,
    ProcessBlocks,
    estimate_pool_blocks,
)

__all__ = ["BoardMember", "LoadBoard", "LocalSharedLoad"]

_NOTHING: Mapping[str, EndpointLoad] = MappingProxyType({})
_NO_BLOCKS: Mapping[str, PoolBlocks] = MappingProxyType({})


class LocalSharedLoad:
    """No other process: ``others()`` is always empty, ``publish`` is a no-op."""

    __slots__ = ()

    @property
    def staleness(self) -> float:
        return 0.0

    def publish(self, endpoint: str, load: EndpointLoad) -> None:
        return None

    def others(self) -> Mapping[str, EndpointLoad]:
        return _NOTHING

    def remove_endpoint(self, endpoint: str) -> None:
        return None

    async def refresh(self) -> None:
        return None

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    # SharedAdmission
    def publish_flow(self, priority: int, flow: str, counts: FlowCounts) -> None:
        return None

    def flows(self) -> PoolFlows:
        return NO_POOL_FLOWS

    def visible_after(self) -> float:
        return 0.0

    def watch(self, callback: Callable[[], None]) -> None:
        return None

    # SharedKVBlocks
    def publish_blocks(
        self, endpoint: str, added: Iterable[int], removed: Iterable[int], own: int
    ) -> None:
        return None

    def kv_blocks(self) -> Mapping[str, PoolBlocks]:
        return _NO_BLOCKS


_NO_COUNTS = FlowCounts()
#: The lease of a member's flow counts on a ``LoadBoard`` by default (seconds).
ADMISSION_LEASE = 1.0


class _Entry:
    __slots__ = ("admission_end", "blocks", "flows", "lease_end", "own_blocks", "totals")

    def __init__(self) -> None:
        self.totals: dict[str, EndpointLoad] = {}
        self.lease_end = 0.0
        self.flows: dict[tuple[int, str], FlowCounts] = {}
        self.admission_end = 0.0
        #: endpoint -> prefix block hashes held; endpoint -> blocks not shared
        self.blocks: dict[str, set[int]] = {}
        self.own_blocks: dict[str, int] = {}


class LoadBoard:
    """Totals per member (process id) and endpoint, with leases on ``clock``."""

    def __init__(
        self,
        *,
        lease: float = 10.0,
        admission_lease: float = ADMISSION_LEASE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not lease > 0:
            raise ValueError(f"lease must be > 0, got {lease}")
        if not admission_lease > 0:
            raise ValueError(f"admission lease must be > 0, got {admission_lease}")
        self.lease = lease
        self.admission_lease = admission_lease
        self.clock = clock
        self._entries: dict[str, _Entry] = {}
        self._members: list[BoardMember] = []

    def member(
        self, process_id: str, *, lease: float | None = None, staleness: float = 0.0
    ) -> BoardMember:
        """The ``SharedLoad`` of the process ``process_id`` (a new one each call), with its
        own ``lease`` (the board's by default). ``staleness`` is only reported: a member
        reads the board directly, so it is never stale."""
        member = BoardMember(self, process_id, lease=lease or self.lease, staleness=staleness)
        self._members.append(member)
        return member

    def live(self) -> list[str]:
        """The process ids whose lease has not lapsed."""
        now = self.clock()
        return [pid for pid, entry in self._entries.items() if entry.lease_end > now]

    # Used by the members
    def _entry(self, process_id: str) -> _Entry:
        entry = self._entries.get(process_id)
        if entry is None:
            entry = self._entries[process_id] = _Entry()
        return entry

    def _renew(self, process_id: str, lease: float) -> None:
        entry = self._entry(process_id)
        now = self.clock()
        entry.lease_end = now + lease
        entry.admission_end = now + min(lease, self.admission_lease)

    def _publish_flow(
        self, process_id: str, priority: int, flow: str, counts: FlowCounts, lease: float
    ) -> None:
        entry = self._entry(process_id)
        key = (priority, flow)
        before = entry.flows.get(key)
        if counts.in_flight > 0 or counts.waiting > 0:
            entry.flows[key] = counts
        else:
            entry.flows.pop(key, None)
        self._renew(process_id, lease)
        if before != entry.flows.get(key):
            for member in self._members:
                if member.process_id != process_id:
                    member._changed()

    def _processes(self, process_id: str) -> int:
        """The other live members (whose lease runs)."""
        now = self.clock()
        return sum(
            1 for pid, entry in self._entries.items() if pid != process_id and entry.lease_end > now
        )

    def _flows(self, process_id: str) -> dict[tuple[int, str], FlowCounts]:
        now = self.clock()
        summed: dict[tuple[int, str], FlowCounts] = {}
        for pid, entry in self._entries.items():
            if pid == process_id or entry.admission_end <= now:
                continue
            for key, counts in entry.flows.items():
                seen = summed.get(key)
                summed[key] = (
                    counts
                    if seen is None
                    else FlowCounts(
                        seen.in_flight + counts.in_flight, seen.waiting + counts.waiting
                    )
                )
        return summed

    def _publish_blocks(
        self,
        process_id: str,
        endpoint: str,
        added: Iterable[int],
        removed: Iterable[int],
        own: int,
        lease: float,
    ) -> None:
        entry = self._entry(process_id)
        held = entry.blocks.setdefault(endpoint, set())
        held.update(h & HASH_MASK for h in added)
        held.difference_update(h & HASH_MASK for h in removed)
        if not held:
            del entry.blocks[endpoint]
        if own > 0:
            entry.own_blocks[endpoint] = own
        else:
            entry.own_blocks.pop(endpoint, None)
        self._renew(process_id, lease)

    def _kv_blocks(self, process_id: str) -> dict[str, PoolBlocks]:
        now = self.clock()
        mine = self._entries.get(process_id)
        own = {endpoint: _sample(held) for endpoint, held in (mine.blocks if mine else {}).items()}
        others: list[dict[str, ProcessBlocks]] = []
        for pid in sorted(self._entries):
            entry = self._entries[pid]
            if pid == process_id or entry.admission_end <= now:
                continue
            others.append(
                {
                    endpoint: ProcessBlocks(
                        len(entry.blocks.get(endpoint, ())),
                        entry.own_blocks.get(endpoint, 0),
                        _sample(entry.blocks.get(endpoint, ())),
                    )
                    for endpoint in entry.blocks.keys() | entry.own_blocks.keys()
                }
            )
        return estimate_pool_blocks(own, others)

    def _publish(self, process_id: str, endpoint: str, load: EndpointLoad, lease: float) -> None:
        entry = self._entry(process_id)
        if load.requests or load.tokens:
            entry.totals[endpoint] = load
        else:
            entry.totals.pop(endpoint, None)
        self._renew(process_id, lease)

    def _forget(self, process_id: str, endpoint: str | None) -> None:
        entry = self._entries.get(process_id)
        if entry is None:
            return
        if endpoint is None:
            del self._entries[process_id]
            if entry.flows:
                for member in self._members:
                    if member.process_id != process_id:
                        member._changed()
        else:
            entry.totals.pop(endpoint, None)
            entry.blocks.pop(endpoint, None)
            entry.own_blocks.pop(endpoint, None)

    def _others(self, process_id: str) -> dict[str, EndpointLoad]:
        now = self.clock()
        summed: dict[str, EndpointLoad] = {}
        for pid, entry in self._entries.items():
            if pid == process_id or entry.lease_end <= now:
                continue
            for endpoint, load in entry.totals.items():
                seen = summed.get(endpoint)
                summed[endpoint] = (
                    load
                    if seen is None
                    else EndpointLoad(seen.requests + load.requests, seen.tokens + load.tokens)
                )
        return summed


class BoardMember:
    """One process's ``SharedLoad``, ``SharedAdmission`` and ``SharedKVBlocks`` on a
    ``LoadBoard``. Between ``start`` and ``stop`` a task renews its leases every third of the
    shorter one, as a live process does."""

    __slots__ = (
        "_board",
        "_flows",
        "_flows_at",
        "_last",
        "_lease",
        "_renewer",
        "_staleness",
        "_watchers",
        "process_id",
    )

    def __init__(
        self, board: LoadBoard, process_id: str, *, lease: float, staleness: float = 0.0
    ) -> None:
        self._board = board
        self.process_id = process_id
        self._lease = lease
        self._staleness = staleness
        self._last: Mapping[str, EndpointLoad] = _NOTHING
        self._renewer: asyncio.Task[None] | None = None
        self._flows: PoolFlows = NO_POOL_FLOWS
        self._flows_at: dict[tuple[int, str], FlowCounts] = {}
        self._watchers: list[Callable[[], None]] = []

    @property
    def staleness(self) -> float:
        return self._staleness

    def publish(self, endpoint: str, load: EndpointLoad) -> None:
        self._board._publish(self.process_id, endpoint, load, self._lease)

    def others(self) -> Mapping[str, EndpointLoad]:
        current = self._board._others(self.process_id)
        if current != self._last:
            self._last = MappingProxyType(current) if current else _NOTHING
        return self._last

    def remove_endpoint(self, endpoint: str) -> None:
        self._board._forget(self.process_id, endpoint)

    async def refresh(self) -> None:
        return None  # reads the board directly: never stale

    # SharedAdmission
    def publish_flow(self, priority: int, flow: str, counts: FlowCounts) -> None:
        self._board._publish_flow(self.process_id, priority, flow, counts, self._lease)

    def flows(self) -> PoolFlows:
        current = self._board._flows(self.process_id)
        processes = self._board._processes(self.process_id)
        if current != self._flows_at or processes != self._flows.processes:
            self._flows_at = current
            self._flows = PoolFlows.of(current, processes)
        return self._flows

    def visible_after(self) -> float:
        return 0.0  # reads the board directly

    def watch(self, callback: Callable[[], None]) -> None:
        self._watchers.append(callback)

    # SharedKVBlocks
    def publish_blocks(
        self, endpoint: str, added: Iterable[int], removed: Iterable[int], own: int
    ) -> None:
        self._board._publish_blocks(self.process_id, endpoint, added, removed, own, self._lease)

    def kv_blocks(self) -> Mapping[str, PoolBlocks]:
        return MappingProxyType(self._board._kv_blocks(self.process_id))

    def _changed(self) -> None:
        for callback in self._watchers:
            callback()

    def renew(self) -> None:
        """Extend this member's lease (without changing its totals)."""
        self._board._renew(self.process_id, self._lease)

    async def start(self) -> None:
        self.renew()
        if self._renewer is None:
            self._renewer = asyncio.create_task(self._renew_forever())

    async def stop(self) -> None:
        await self._halt()
        self._board._forget(self.process_id, None)

    async def _halt(self) -> None:
        """Stop renewing without withdrawing (what a process that dies does)."""
        renewer, self._renewer = self._renewer, None
        if renewer is not None:
            renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewer

    async def _renew_forever(self) -> None:
        while True:
            await asyncio.sleep(min(self._lease, self._board.admission_lease) / 3)
            self.renew()


def _sample(held: Iterable[int]) -> frozenset[int]:
    """The sampled ones of prefix block hashes (taken modulo 2**64)."""
    return frozenset(h for h in held if not h & SAMPLE_MASK)
