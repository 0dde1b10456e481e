"""State shared by every EPP process of a pool (replicas and workers): the in-flight load
each process has booked, the requests each holds in flow control, the KV blocks its
in-flight requests hold, and the failure a remote store reports.

The prefix index is shared through the ``PrefixIndex`` port (``ports.prefix_index``). A
remote implementation of it (Redis) raises ``SharedStateError`` when the store fails or is
slow; the domain wraps it with a deadline and a local fallback, so routing never waits long
for the store and never fails because of it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol

__all__ = [
    "HASH_MASK",
    "NO_POOL_FLOWS",
    "SAMPLE_MASK",
    "EndpointLoad",
    "FlowCounts",
    "PoolBlocks",
    "PoolFlows",
    "ProcessBlocks",
    "SharedAdmission",
    "SharedKVBlocks",
    "SharedLoad",
    "SharedStateError",
    "SharedStateReplyError",
    "SharedStateWriteRefusedError",
    "estimate_pool_blocks",
]


class SharedStateError(Exception):
    """The shared store failed (connection refused or lost, timeout, an error reply, a reply
    that does not parse). The message says what; the caller degrades to local state."""


class SharedStateReplyError(SharedStateError):
    """The store is up and answered this one call with an error or a reply that does not
    parse (a key of the wrong type, a script refused while a cluster slot migrates). That
    call falls back to local state; the store stays in use for the others."""


class SharedStateWriteRefusedError(SharedStateError):
    """The store answered but refused a write (it is out of memory and evicts nothing).
    Reads still work: the caller keeps reading the store and keeps its new writes local."""


@dataclass(frozen=True, slots=True)
class EndpointLoad:
    """Requests and estimated tokens in flight on one endpoint."""

    requests: int = 0
    tokens: int = 0


class SharedLoad(Protocol):
    """The in-flight load the *other* EPP processes of the pool have booked, per endpoint.

    Every process knows its own bookings exactly and publishes its totals per endpoint
    (``publish``: absolute values, so a write that is lost or repeated does no harm, and
    publishing again after the store restarted empty rebuilds it). ``others`` is the sum
    over the other live processes, read from a local copy that is at most ``staleness``
    seconds old while the store answers; a process that stops publishing (it died) drops
    out of every other process's sum once its lease lapses.

    Both calls are synchronous and cheap (no I/O on the caller's path: writes and refreshes
    happen in the implementation's background task, between ``start`` and ``stop``), and
    never raise: when the store fails, ``publish`` keeps the totals to write later and
    ``others`` returns the last copy, or nothing once that is older than the lease.
    Called from the event loop only.
    """

    @property
    def staleness(self) -> float:
        """The most, in seconds, that ``others`` lags the store while the store answers."""
        ...

    def publish(self, endpoint: str, load: EndpointLoad) -> None:
        """This process's in-flight totals on ``endpoint`` are now ``load``."""
        ...

    def others(self) -> Mapping[str, EndpointLoad]:
        """The other processes' summed totals, by endpoint name (absent means none)."""
        ...

    def remove_endpoint(self, endpoint: str) -> None:
        """``endpoint`` left the pool: forget this process's totals for it."""
        ...

    async def refresh(self) -> None:
        """Bring ``others`` up to date now (and write this process's changes), waiting at
        most the implementation's routing budget; a refresh already under way is joined.
        Never raises: past the budget, or when the store fails, ``others`` stays the copy
        it was. For a routing decision that should see the pool's load as of now."""
        ...

    async def start(self) -> None: ...

    async def stop(self) -> None:
        """Withdraw this process's totals (best effort) and stop the background task."""
        ...


@dataclass(frozen=True, slots=True)
class FlowCounts:
    """One flow's requests in flow control: dispatched and not yet done (``in_flight``),
    and queued (``waiting``)."""

    in_flight: int = 0
    waiting: int = 0


_NO_FLOWS: Mapping[int, Mapping[str, FlowCounts]] = MappingProxyType({})
_NO_TOTALS: Mapping[int, int] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class PoolFlows:
    """The other processes' flow counts, summed over them: ``bands`` maps a priority to
    its flows (by the flow's shared key, ``domain.flowcontrol.pool.flow_key``) with their
    counts. Built with ``PoolFlows.of``, which also fills the per-band totals:
    ``waiting`` (priority -> queued requests), ``in_flight`` (all bands) and
    ``top_waiting`` (the highest priority with a queued request, None when none)."""

    bands: Mapping[int, Mapping[str, FlowCounts]] = field(default_factory=lambda: _NO_FLOWS)
    waiting: Mapping[int, int] = field(default_factory=lambda: _NO_TOTALS)
    in_flight: int = 0
    top_waiting: int | None = None
    #: how many other processes were live when the copy was taken, holding requests or not
    processes: int = 0

    @classmethod
    def of(cls, entries: Mapping[tuple[int, str], FlowCounts], processes: int = 0) -> PoolFlows:
        """From (priority, flow key) -> counts, the other live ``processes``; entries at
        zero are left out."""
        bands: dict[int, dict[str, FlowCounts]] = {}
        waiting: dict[int, int] = {}
        in_flight = 0
        for (priority, flow), counts in entries.items():
            if counts.in_flight <= 0 and counts.waiting <= 0:
                continue
            bands.setdefault(priority, {})[flow] = counts
            in_flight += max(0, counts.in_flight)
            if counts.waiting > 0:
                waiting[priority] = waiting.get(priority, 0) + counts.waiting
        processes = max(0, processes)
        if not bands:
            return NO_POOL_FLOWS if not processes else cls(processes=processes)
        return cls(
            bands=MappingProxyType({p: MappingProxyType(f) for p, f in bands.items()}),
            waiting=MappingProxyType(waiting),
            in_flight=in_flight,
            top_waiting=max(waiting) if waiting else None,
            processes=processes,
        )


#: Nobody else's flows.
NO_POOL_FLOWS = PoolFlows()


class SharedAdmission(Protocol):
    """The requests the *other* EPP processes of the pool hold in flow control, per
    priority band and flow (fairness id): how many each has dispatched and not seen end,
    and how many wait in its queues.

    Every process publishes its own counts per flow (``publish_flow``: absolute values, as
    ``SharedLoad.publish``); ``flows`` is the sum over the other live processes, from a
    local copy refreshed in the background (at most ``SharedLoad.staleness`` old while
    the store answers). A process that stops publishing drops out within a short lease
    (a second for the Redis implementation), and the copy itself counts for no longer
    than that: past it, ``flows`` is empty and flow control is per process until the
    store answers again. ``watch`` registers a callback run on the event loop each time
    the copy changed. Synchronous, cheap and never raising, like ``SharedLoad``."""

    def publish_flow(self, priority: int, flow: str, counts: FlowCounts) -> None:
        """This process's counts for flow ``flow`` of band ``priority`` are now ``counts``."""
        ...

    def flows(self) -> PoolFlows:
        """The other processes' counts, summed (the same object until it changes)."""
        ...

    def visible_after(self) -> float:
        """At most how long (seconds) a dispatch at another process takes to show in this
        process's copy, its write's delay and this copy's refresh together; in that time
        each process is blind to what the others let in."""
        ...

    def watch(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (no arguments, on the event loop) whenever ``flows`` changed."""
        ...


#: A prefix block hash ``h`` is in ``PoolBlocks.sampled`` when ``h & SAMPLE_MASK == 0`` (one
#: in 16): enough to find how much of a request's chain the others hold, at a sixteenth of
#: the hashes.
SAMPLE_MASK = 0xF
#: Block hashes are 64-bit; a negative one is taken modulo 2**64.
HASH_MASK = 0xFFFF_FFFF_FFFF_FFFF


@dataclass(frozen=True, slots=True)
class PoolBlocks:
    """The blocks the other processes' requests hold on one endpoint beyond this
    process's (``count``: distinct prefix blocks this process does not hold, plus their
    blocks that are not shared), and ``sampled``, the prefix block hashes they hold (taken
    modulo 2**64) with ``h & SAMPLE_MASK == 0``. Block hashes are chained (each covers the
    whole prefix before it), so a request whose block ``i`` is in ``sampled`` shares its
    blocks ``0..i`` with a request in flight at another process."""

    count: int = 0
    sampled: frozenset[int] = frozenset()


@dataclass(frozen=True, slots=True)
class ProcessBlocks:
    """What one process's requests hold on one endpoint, as it publishes it: ``prefix``
    distinct prefix blocks, ``sampled`` the hashes among them (taken modulo 2**64) with
    ``h & SAMPLE_MASK == 0``, and ``unshared`` blocks that are not shared.

    ``sample_size`` (0: ``len(sampled)``) is how many sampled hashes the process holds when
    ``sampled`` carries only those no process before it holds (a store that sends each
    hash once)."""

    prefix: int = 0
    unshared: int = 0
    sampled: frozenset[int] = frozenset()
    sample_size: int = 0


def estimate_pool_blocks(
    own: Mapping[str, AbstractSet[int]], others: Iterable[Mapping[str, ProcessBlocks]]
) -> dict[str, PoolBlocks]:
    """Per endpoint, the blocks ``others`` (the other processes, in a fixed order) hold
    beyond this process's, whose sampled prefix hashes per endpoint are ``own``.

    A process's prefix blocks count in the proportion of its sample that neither this
    process nor one before it holds (a process with no sampled hash counts all of them);
    its blocks that are not shared count whole. One sampled hash stands for 16 blocks, so
    the count is exact when the processes hold the same prefixes or different ones, and
    within the sampling error in between: that is what lets a process publish a sixteenth
    of its hashes and the store keep no count per block."""
    counts: dict[str, float] = {}
    seen: dict[str, set[int]] = {}
    for process in others:
        for endpoint, blocks in process.items():
            union = seen.get(endpoint)
            if union is None:
                union = seen[endpoint] = set()
            sampled = blocks.sampled
            size = blocks.sample_size or len(sampled)
            share = 1.0
            if size:
                fresh = sampled - union
                mine = own.get(endpoint)
                if mine:
                    fresh = fresh - mine
                share = len(fresh) / size
                union |= sampled
            counts[endpoint] = counts.get(endpoint, 0.0) + blocks.unshared + blocks.prefix * share
    return {
        endpoint: PoolBlocks(round(count), frozenset(seen[endpoint]))
        for endpoint, count in counts.items()
        if count > 0 or seen[endpoint]
    }


class SharedKVBlocks(Protocol):
    """The KV-cache blocks the *other* EPP processes' in-flight requests hold, per
    endpoint, with shared prefix blocks counted once over the whole pool.

    Every process publishes, per endpoint, the prefix blocks its own in-flight requests
    hold (``publish_blocks``: the block hashes that became held, ``added``, and those no
    longer held, ``removed``, by this process) and ``own``, the blocks of its requests
    there that are not shared (the rest of each prompt, one output block each).
    ``kv_blocks`` is, per endpoint, the blocks the pool holds there beyond this
    process's (``PoolBlocks``): the distinct prefix blocks of every live process that this
    one does not hold, plus the others' ``own`` blocks, and a sample of the others' prefix
    block hashes. The distinct prefix blocks are estimated from the samples
    (``estimate_pool_blocks``, the same function in every implementation), so a store
    keeps a sixteenth of the hashes and no count per block. An endpoint absent from it
    has no published blocks from another process. A local copy refreshed in the background, as
    ``SharedAdmission.flows``, and empty once that copy is older than the admission lease.
    Synchronous, cheap and never raising, like ``SharedLoad``."""

    def publish_blocks(
        self, endpoint: str, added: Iterable[int], removed: Iterable[int], own: int
    ) -> None:
        """This process now also holds ``added`` on ``endpoint``, no longer ``removed``,
        and ``own`` blocks there that are not shared."""
        ...

    def kv_blocks(self) -> Mapping[str, PoolBlocks]:
        """Blocks the pool holds per endpoint beyond this process's (see the class)."""
        ...
