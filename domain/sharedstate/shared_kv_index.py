"""``SharedKVBlockIndex``: the KV-block index of several EPP processes, on a ``KVBlockStore``.

Every process subscribes to every endpoint's KV events (a ZMQ publisher serves any number
of subscribers) and keeps its own ``InMemoryKVBlockIndex``: the routing path reads only
that, so it never waits for the store and the store's failures never reach a request.
The store (Redis with ``--redis-url``) is the pool's one copy, for two things:

- **Warm start.** The first time a process hears of an endpoint (``follow``, when it
  joins the pool, or its first event) it loads the store's
  copy into its own index (as older than anything the events said since, and without the
  blocks its events removed meanwhile), so a new replica routes on the servers' caches at
  once instead of after each block's next event.
- **Dedup.** One process per endpoint writes its events to the store: the holder of the
  endpoint's writer lease (``claim`` every ``lease / 3`` seconds, and at once for a new
  endpoint). The others drop their
  copy of the same events. When the holder dies, another takes the lease within ``lease``
  seconds and first rewrites the endpoint's copy from its own index (``replace``), as it
  does whenever the store lost the copy (restarted empty) or its own writes had a gap (its
  stream broke, its queue overflowed, the store failed).

Lifecycle: ``start`` with the process (``warmed`` gates readiness at start-up: the first
request routes warm); ``stop`` releases the leases held, so another process takes over at
its next claim. A copy that is not ``current`` (its writer died, the lease lapsed) is not
loaded: it misses the events since; the endpoint's lease is not claimed before its load
ended, so whoever claims it rewrites the stale copy.

Failure: the first failed store call logs one warning, sets the shared-state degraded
gauge and stops the writes (they are dropped and counted; every owned endpoint is
rewritten later); the lease calls go on as the probe, and the first answered one logs one
info line, clears the gauge and resumes. Routing is not affected either way. Writes wait
in one queue of at most ``max_pending`` batches (beyond: dropped, counted, the endpoint
rewritten later) and go out in order by one task.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping, Sequence

from domain.prefixcache.kv_block_index import InMemoryKVBlockIndex
from domain.sharedstate.degraded import DegradedGauge
from ports.kv_events import AllBlocksCleared, BlockRemoved, KVBlockStore, KVEvent
from ports.metric_catalogue import (
    KV_INDEX_LOADED_BLOCKS,
    KV_INDEX_PENDING_WRITES,
    KV_INDEX_WRITER_LEASES,
    SHARED_STATE_DROPPED_WRITES,
    SHARED_STATE_ERRORS,
    SHARED_STATE_WRITES,
)
from ports.observer import NoopObserver, Observer

__all__ = ["SharedKVBlockIndex"]

logger = logging.getLogger(__name__)

_NO_LABELS: dict[str, str] = {}
#: Seconds ``stop`` waits for its cancelled tasks, then for its lease releases.
_STOP_WAIT = 1.0
#: Seconds after ``start`` past which ``warmed`` is true even if loads are still running.
WARM_WAIT = 5.0
_COMPONENT = "kv_index"

# queued operations: ("apply", endpoint, events) / ("replace" | "warm" | "forget", endpoint)
_Op = tuple[str, str, Sequence[KVEvent]]
_NONE: Sequence[KVEvent] = ()


class SharedKVBlockIndex:
    """A ``KVBlockIndex`` (the sink and the routing path: the local index) that shares its
    endpoints' blocks through ``store``; see the module docstring. Event loop only."""

    def __init__(
        self,
        store: KVBlockStore,
        local: InMemoryKVBlockIndex,
        *,
        owner: str,
        cap: int,
        lease: float = 10.0,
        max_pending: int = 1024,
        observer: Observer | None = None,
        degraded_gauge: DegradedGauge | None = None,
    ) -> None:
        if lease <= 0 or cap < 1 or max_pending < 1:
            raise ValueError("lease must be > 0, cap and max_pending >= 1")
        self._store = store
        self._local = local
        self._owner = owner
        self._cap = cap
        self._lease = lease
        self._max_pending = max_pending
        self._observer = observer if observer is not None else NoopObserver()
        self._gauge = (
            degraded_gauge if degraded_gauge is not None else DegradedGauge(self._observer)
        )
        self._started_at: float | None = None
        self._wake: asyncio.Event | None = None
        self._queue: asyncio.Queue[_Op] | None = None
        self._followed: set[str] = set()
        self._owned: set[str] = set()
        self._dirty: set[str] = set()  # owned, but the store's copy missed writes
        # owned, and this process wrote the copy empty and nothing since: a store's empty
        # copy makes every claim answer "rewrite", which would rewrite it empty again
        self._written_empty: set[str] = set()
        self._warming: dict[str, set[int] | None] = {}  # removed since (None: cleared)
        self._failing = False
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def local(self) -> InMemoryKVBlockIndex:
        return self._local

    def owns(self, endpoint: str) -> bool:
        """Whether this process writes ``endpoint``'s events to the store."""
        return endpoint in self._owned

    @property
    def failing(self) -> bool:
        """Whether the store failed and has not answered since."""
        return self._failing

    @property
    def warmed(self) -> bool:
        """Whether the endpoints followed so far were loaded from the store (or their loads
        failed, or the store is failing, or ``WARM_WAIT`` seconds passed since ``start``):
        readiness waits for it at start-up, so the first request routes warm."""
        if self._started_at is None:
            return False
        if not self._warming or self._failing:
            return True
        return asyncio.get_running_loop().time() - self._started_at >= WARM_WAIT

    # lifecycle

    def start(self) -> None:
        """Start the writer and the lease task (on the running event loop)."""
        if self._tasks:
            return
        self._queue = asyncio.Queue()
        self._wake = asyncio.Event()
        loop = asyncio.get_running_loop()
        self._started_at = loop.time()
        self._gauge.set(_COMPONENT, self._failing)
        self._observer.gauge(KV_INDEX_WRITER_LEASES, _NO_LABELS, 0)
        self._observer.gauge(KV_INDEX_PENDING_WRITES, _NO_LABELS, 0)
        self._tasks = [
            loop.create_task(self._write_loop(), name="kv-store-writer"),
            loop.create_task(self._lease_loop(), name="kv-store-leases"),
        ]
        for endpoint in sorted(self._followed):
            self._put(("warm", endpoint, _NONE))

    async def stop(self) -> None:
        """Cancel the background tasks and wait for them at most ``_STOP_WAIT`` seconds (a
        store call being cancelled is not always prompt to end), then release the leases
        this process holds (within ``_STOP_WAIT`` seconds more), so the other processes
        take its endpoints over at their next claim instead of after the lease."""
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=_STOP_WAIT)
        owned = sorted(self._owned)
        self._owned.clear()
        self._observer.gauge(KV_INDEX_WRITER_LEASES, _NO_LABELS, 0)
        if not owned or self._failing:
            return
        try:
            async with asyncio.timeout(_STOP_WAIT):
                for endpoint in owned:
                    await self._store.release(endpoint, self._owner, self._lease)
        except Exception as exc:  # the leases lapse by themselves
            logger.info("KV-block index: writer leases not released at stop: %r", exc)

    async def wait_idle(self) -> None:
        """Until every queued write was sent (for tests)."""
        if self._queue is not None:
            await self._queue.join()

    # KVEventSink

    def apply(self, endpoint: str, events: Sequence[KVEvent]) -> None:
        self._follow(endpoint)
        if endpoint in self._warming:
            removed = self._warming[endpoint]
            for event in events:
                if isinstance(event, AllBlocksCleared):
                    removed = None
                elif isinstance(event, BlockRemoved) and removed is not None:
                    removed.update(event.block_hashes)
            self._warming[endpoint] = removed
        self._local.apply(endpoint, events)
        if endpoint not in self._owned:
            return
        if self._failing or endpoint in self._dirty or not self._local.trusted(endpoint):
            self._dirty.add(endpoint)
            return
        self._put(("apply", endpoint, events))

    def lost(self, endpoint: str) -> None:
        self._follow(endpoint)
        self._local.lost(endpoint)
        if endpoint in self._owned:
            self._dirty.add(endpoint)

    def resynced(self, endpoint: str) -> None:
        self._local.resynced(endpoint)
        if endpoint in self._owned and endpoint in self._dirty and not self._failing:
            self._dirty.discard(endpoint)
            self._put(("replace", endpoint, _NONE))

    def forget(self, endpoint: str) -> None:
        self._local.forget(endpoint)
        self._followed.discard(endpoint)
        self._owned.discard(endpoint)
        self._dirty.discard(endpoint)
        self._written_empty.discard(endpoint)
        self._warming.pop(endpoint, None)
        self._put(("forget", endpoint, _NONE))

    # routing path: the local index

    def match(self, hashes: Sequence[int], endpoints: Sequence[str]) -> Mapping[str, int]:
        return self._local.match(hashes, endpoints)

    def speculate(self, endpoint: str, hashes: Sequence[int], ttl: float) -> None:
        self._local.speculate(endpoint, hashes, ttl)

    def size(self) -> int:
        return self._local.size()

    def endpoint_size(self, endpoint: str) -> int:
        return self._local.endpoint_size(endpoint)

    def trusted(self, endpoint: str) -> bool:
        return self._local.trusted(endpoint)

    def follow(self, endpoint: str) -> None:
        """``endpoint`` joined the pool: load the store's copy of it and take part in its
        writer lease, before its first event (a quiet server may publish none for long)."""
        self._follow(endpoint)

    # background

    def _follow(self, endpoint: str) -> None:
        if endpoint in self._followed:
            return
        self._followed.add(endpoint)
        self._warming[endpoint] = set()
        if self._queue is not None:
            self._put(("warm", endpoint, _NONE))
        if self._wake is not None:
            self._wake.set()  # claim its lease now, not at the next renewal

    def _put(self, op: _Op) -> None:
        queue = self._queue
        if queue is None:
            if op[0] == "apply":
                self._dirty.add(op[1])
            return
        if queue.qsize() >= self._max_pending and op[0] == "apply":
            self._dirty.add(op[1])
            self._observer.counter(SHARED_STATE_DROPPED_WRITES, _NO_LABELS)
            return
        queue.put_nowait(op)
        self._observer.gauge(KV_INDEX_PENDING_WRITES, _NO_LABELS, queue.qsize())

    async def _write_loop(self) -> None:
        queue = self._queue
        assert queue is not None
        while True:
            kind, endpoint, events = await queue.get()
            try:
                if self._failing and kind != "forget":
                    if kind in ("apply", "replace") and endpoint in self._owned:
                        self._dirty.add(endpoint)
                        self._observer.counter(SHARED_STATE_DROPPED_WRITES, _NO_LABELS)
                    if kind == "warm":
                        self._warmed(endpoint)
                    continue
                await self._run(kind, endpoint, events)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._observer.counter(SHARED_STATE_ERRORS, {"operation": f"kv_{kind}"})
                if kind == "warm":
                    self._warmed(endpoint)
                if kind in ("apply", "replace") and endpoint in self._owned:
                    self._dirty.add(endpoint)
                self._fail(f"{kind} failed: {exc!r}")
            finally:
                queue.task_done()
                self._observer.gauge(KV_INDEX_PENDING_WRITES, _NO_LABELS, queue.qsize())

    async def _run(self, kind: str, endpoint: str, events: Sequence[KVEvent]) -> None:
        store = self._store
        if kind == "apply":
            if endpoint in self._owned:
                self._written_empty.discard(endpoint)
                await store.apply(endpoint, events, self._cap)
                self._observer.counter(SHARED_STATE_WRITES, _NO_LABELS)
        elif kind == "replace":
            if endpoint in self._owned and self._local.trusted(endpoint):
                self._dirty.discard(endpoint)
                blocks = self._local.snapshot(endpoint)
                if not blocks and endpoint in self._written_empty:
                    return
                self._written_empty.discard(endpoint)
                await store.replace(endpoint, blocks, self._cap)
                if not blocks:
                    self._written_empty.add(endpoint)
                self._observer.counter(SHARED_STATE_WRITES, _NO_LABELS)
        elif kind == "forget":
            await store.forget(endpoint)
        elif kind == "warm":
            current = False
            try:
                # a copy nobody keeps up to date (its writer died, the lease lapsed) may
                # hold blocks removed since: not loaded
                current = await store.current(endpoint)
                blocks = await store.blocks(endpoint, self._cap) if current else []
            finally:
                removed = self._warmed(endpoint)
            if removed is None or endpoint not in self._followed:
                return  # cleared meanwhile, or gone
            if not current:
                # known, empty: what this process holds is its own events' (a subset of
                # the server's), and its rewrite replaces the stale copy when it claims
                self._local.load(endpoint, [])
                logger.info(
                    "KV-block index: the shared copy of %s has no writer; not loaded", endpoint
                )
                return
            added = self._local.load(endpoint, [b for b in blocks if b[0] not in removed])
            self._observer.counter(KV_INDEX_LOADED_BLOCKS, _NO_LABELS, added)
            if added:
                logger.info(
                    "KV-block index: %d blocks of %s loaded from the shared store",
                    added,
                    endpoint,
                )

    def _warmed(self, endpoint: str) -> set[int] | None:
        """``endpoint``'s warm load ended: what its events removed meanwhile (``None``:
        cleared); its lease may be claimed now."""
        removed = self._warming.pop(endpoint, None)
        if self._wake is not None:
            self._wake.set()
        return removed

    async def _lease_loop(self) -> None:
        while True:
            for endpoint in sorted(self._followed):
                if endpoint in self._warming:
                    # claimed before its load, a lapsed copy would count as current
                    continue
                try:
                    claimed = await self._store.claim(endpoint, self._owner, self._lease)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    self._observer.counter(SHARED_STATE_ERRORS, {"operation": "kv_claim"})
                    self._fail(f"lease failed: {exc!r}")
                    break
                if self._failing:
                    self._failing = False
                    logger.info("KV-block index: the shared store answers again")
                    self._gauge.set(_COMPONENT, False)
                if endpoint not in self._followed:
                    continue  # forgotten meanwhile
                if claimed is None:
                    self._written_empty.discard(endpoint)
                    self._owned.discard(endpoint)
                    self._dirty.discard(endpoint)
                    continue
                self._owned.add(endpoint)
                if claimed or endpoint in self._dirty:
                    self._dirty.discard(endpoint)
                    self._put(("replace", endpoint, _NONE))
            self._observer.gauge(KV_INDEX_WRITER_LEASES, _NO_LABELS, len(self._owned))
            wake = self._wake
            assert wake is not None
            # asyncio.timeout, not wait_for: 3.11's wait_for can lose a cancellation that
            # arrives as the event is set, and stop() would wait for ever
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._lease / 3):
                    await wake.wait()
            wake.clear()

    def _fail(self, why: str) -> None:
        if not self._failing:
            self._failing = True
            self._gauge.set(_COMPONENT, True)
            logger.warning(
                "KV-block index: the shared store failed, writes stop until it answers "
                "(routing is not affected): %s",
                why,
            )
        self._dirty.update(self._owned)
