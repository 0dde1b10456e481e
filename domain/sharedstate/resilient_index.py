"""``ResilientPrefixIndex``: a remote (shared) ``PrefixIndex`` behind a deadline, with the
process's own ``InMemoryPrefixIndex`` as fallback. What callers see never raises.

- ``match`` awaits the remote for at most ``budget`` seconds (the event loop's timer). An
  answered match is merged with the local one (per endpoint, the larger count): the local
  index holds this process's adds that have not reached the remote yet. Past the budget, or
  on any error (and while degraded), the request gets the local index's match merged with
  the *answers index*, and a deadline miss or an error is counted.
- The answers index is a read-through copy of what the remote said: after each answered
  match (on time or late), the endpoint holding the longest part of the chain is recorded
  for that part (LRU per endpoint, the capacity of the last ``add``, ``answers_capacity``
  before one). So a miss still finds the prefixes other processes placed, as the remote
  reported them when this process last asked; it may name an endpoint the remote has since
  evicted (a hint for one request, corrected by the next answer).
- A call past the budget is not cancelled but left to finish in the background (at most
  ``max_late`` at once; the others are cancelled, so the remote must tolerate cancellation):
  its answer is usually on its way and feeds the answers index, and a cancelled call costs
  the Redis client its connection, so the next call would pay a reconnect and miss too.
- ``add`` records locally at once and queues the write for the remote; one background task
  sends the queue in order. A chain whose start this process sent for the same endpoint in
  full less than ``resend_interval`` ago (1 s) is sent from where the two differ
  (``TailAddingPrefixIndex``): a group of prompts sharing a long system prompt writes its
  own end, not the whole chain, so the store does a few blocks of work per request; the
  shared start is sent in full again once per interval, which keeps its recency there.
  The request never awaits the remote. At most ``max_pending``
  writes wait; past that a write is dropped and counted.
- ``claim`` (a new chain, after the pick: ``ClaimingPrefixIndex``) awaits the remote's
  atomic claim within ``claim_budget`` (``budget`` unless given: the request it delays
  pays a whole prefill, so it can wait longer than a match), and returns the endpoint that owns the
  chain. Without an answer in time the caller's endpoint keeps the request and the late
  answer decides: won, the chain is recorded here too; another owner, nothing is written
  and the owner is learnt (answers index), so the chain's later requests follow the owner
  instead of splitting between two servers; an error, the chain is recorded as by ``add``.
  Degraded for slowness, the claim is sent without waiting and its answer handled the same.
  A remote that names the owner before its last writes (``StagedClaimingPrefixIndex``)
  is waited for only until the owner is known; those writes run in a background task (at
  most ``max_late`` at once, under ``write_timeout``; ``stop`` gives them that long), and
  their failure counts as the claim's.
- ``remove_endpoint`` removes locally at once, then from the remote (in the caller's task,
  under ``write_timeout``; the prefix producer calls it from a background task).

Health (one log line and the degraded gauge on each change):

- *healthy → degraded* on the first remote error (``SharedStateError`` or anything else the
  remote raises, from any operation), or after ``miss_limit`` consecutive routing-path
  deadline misses (one miss can be a pause; several in a row mean every request pays the
  budget, so stop waiting). Calls in flight together through one pause count once: a miss
  counts only if its call started after the last counted miss fired, so a burst of
  concurrent requests at a busy moment does not degrade by itself. An answered match or
  claim resets the miss count.
- *while degraded* ``match`` does not wait for the remote, ``add`` only records locally (the
  queued writes are dropped and counted), and a background probe (a one-hash ``match``
  under ``probe_timeout``, 1 s by default: not the routing budget, so a busy machine and a
  reconnect after an outage heal too) runs after ``probe_initial`` seconds, doubling up to
  ``probe_max``. Degraded again within ``probe_max`` of healing, the probe keeps the delay
  it had reached: a store that answers probes but fails requests flaps at most that often.
  Degraded by deadline misses only (the remote answers, too slowly), the writes go on, and
  each ``match`` still sends its call without waiting (up to ``max_late`` at once), so the
  answers index stays current; an error then turns it into the failing kind (one more log
  line).
- *degraded → healthy* on the first answered probe (degraded by deadline misses: the first
  probe answered within ``budget``); then a background rebuild re-sends, oldest first, the
  removals seen while degraded and (unless it was degraded for slowness only, when no write
  was dropped) the recent adds this process made
  (``journal_hashes`` hashes at most, for endpoints still in the local index). The remote
  keys blocks by their chain's first hash, so the rebuild replays whole chains as they were
  added; a flat export of the local index would lose the chains.

Not a change of health (the store is up):

- an error reply or garbage about one call (``SharedStateReplyError``: a key of the wrong
  type, a script refused while a cluster slot migrates): that call falls back, counted in
  ``..._errors_total``; one warning at once, then at most one a minute with the count since;
- a refused write (``SharedStateWriteRefusedError``: out of memory under ``noeviction``): the write
  is counted as an error and kept (the last ``max_pending``; older ones are dropped and
  counted), one warning when writes start being refused and one info line when one is
  accepted again, and then the kept ones (for endpoints still known) are sent again;
  matches keep reading the remote.

``start`` warms the remote (the EPP asks for 4): ``warm_connections`` concurrent one-hash
matches under ``probe_timeout`` open that many connections and load the match script before
the first request would pay for them; a failure there counts as a failed match (degraded,
probed).

The background tasks run between ``start`` and ``stop``. ``clock`` times the round trips,
``sleep`` paces the probe; both are injectable for tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from domain.prefixcache.index import InMemoryPrefixIndex
from domain.sharedstate.degraded import DegradedGauge
from ports.metric_catalogue import (
    SHARED_STATE_CLAIMS,
    SHARED_STATE_DEADLINE_MISSES,
    SHARED_STATE_DROPPED_WRITES,
    SHARED_STATE_ERRORS,
    SHARED_STATE_ROUNDTRIP,
    SHARED_STATE_WRITES,
)
from ports.observer import NoopObserver, Observer
from ports.prefix_index import (
    ClaimingPrefixIndex,
    PrefixIndex,
    StagedClaimingPrefixIndex,
    TailAddingPrefixIndex,
)
from ports.shared_state import SharedStateReplyError, SharedStateWriteRefusedError

__all__ = ["ResilientPrefixIndex"]

logger = logging.getLogger(__name__)

_NO_LABELS: dict[str, str] = {}
_COMPONENT = "prefix_index"
_MATCH = {"operation": "match"}
_ADD = {"operation": "add"}
_REMOVE = {"operation": "remove_endpoint"}
_CLAIM = {"operation": "claim"}
_WON = {"outcome": "won"}
_LOST = {"outcome": "lost"}
_MOVED = {"outcome": "moved"}
_FALLBACK = {"outcome": "fallback"}
_PROBE = {"operation": "probe"}
#: Seconds between two warnings about error replies (the first one is logged at once).
_REPLY_WARNING_INTERVAL = 60.0
#: The probe's chain: one hash nobody is expected to hold.
_PROBE_HASHES = (0x5EED_0F_5EED_0F_5E,)

_Write = tuple[tuple[int, ...], str, int]
#: Chains remembered for ``resend_interval`` (oldest forgotten first).
_SENT_LIMIT = 16_384


class ResilientPrefixIndex:
    """A ``PrefixIndex`` that never raises and never waits past ``budget`` on the remote."""

    def __init__(
        self,
        remote: PrefixIndex,
        local: InMemoryPrefixIndex | None = None,
        *,
        observer: Observer | None = None,
        degraded_gauge: DegradedGauge | None = None,
        budget: float = 0.005,
        claim_budget: float | None = None,
        miss_limit: int = 5,
        max_pending: int = 1024,
        max_late: int = 16,
        answers_capacity: int = 31_250,
        write_timeout: float = 1.0,
        journal_hashes: int = 262_144,
        probe_initial: float = 0.1,
        probe_max: float = 5.0,
        probe_timeout: float = 1.0,
        warm_connections: int = 0,
        resend_interval: float = 1.0,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        if not budget > 0:
            raise ValueError(f"budget must be > 0, got {budget}")
        if claim_budget is not None and not claim_budget > 0:
            raise ValueError(f"claim_budget must be > 0, got {claim_budget}")
        if miss_limit < 1 or max_pending < 1 or journal_hashes < 0:
            raise ValueError("miss_limit and max_pending must be >= 1, journal_hashes >= 0")
        if not 0 < probe_initial <= probe_max:
            raise ValueError("need 0 < probe_initial <= probe_max")
        if not probe_timeout > 0:
            raise ValueError(f"probe_timeout must be > 0, got {probe_timeout}")
        self.remote = remote
        self.local = local if local is not None else InMemoryPrefixIndex()
        self._observer = observer or NoopObserver()
        # the process's degraded gauge, shared with the other components on the store
        self._gauge = (
            degraded_gauge if degraded_gauge is not None else DegradedGauge(self._observer)
        )
        self._budget = budget
        self._claim_budget = budget if claim_budget is None else claim_budget
        self._miss_limit = miss_limit
        self._max_pending = max_pending
        self._max_late = max_late
        self._answers = InMemoryPrefixIndex()
        self._answers_capacity = answers_capacity
        self._late: set[asyncio.Future[Mapping[str, int]]] = set()
        self._write_timeout = write_timeout
        self._journal_limit = journal_hashes
        self._probe_initial = probe_initial
        self._probe_max = probe_max
        self._probe_timeout = probe_timeout
        self._warm_connections = max(0, warm_connections)
        self._resend_interval = resend_interval
        self._tails = resend_interval > 0 and isinstance(remote, TailAddingPrefixIndex)
        #: (endpoint, chain root) -> the chain last written and when its start was sent in full.
        self._sent: dict[tuple[str, int], tuple[tuple[int, ...], float]] = {}
        self._probe_delay = probe_initial
        self._healed_at = -float("inf")
        self._clock = clock
        self._sleep = sleep
        self._degraded = False
        self._slow = False  # degraded by deadline misses only: the remote answers, slowly
        self._writes_refused = False
        self._reply_errors = 0
        self._reply_warned_at = -float("inf")
        self._misses = 0
        #: When the last miss counted towards ``miss_limit`` fired.
        self._stall_seen_at = -float("inf")
        self._late_claims: set[asyncio.Future[str]] = set()
        self._claim_rests: set[asyncio.Future[None]] = set()
        #: Writes the remote refused (out of memory), sent again once it accepts one.
        self._refused_writes: deque[_Write] = deque()
        self._pending: deque[_Write] = deque()
        self._wake = asyncio.Event()
        self._drained = asyncio.Event()
        self._sending = False
        self._journal: deque[_Write] = deque()
        self._journal_size = 0
        self._removed_while_degraded: set[str] = set()
        self._running = False
        self._writer: asyncio.Task[None] | None = None
        self._probe: asyncio.Task[None] | None = None
        self._rebuild: asyncio.Task[None] | None = None

    @property
    def degraded(self) -> bool:
        return self._degraded

    @property
    def writes_refused(self) -> bool:
        """True from a write the remote refused (out of memory) to the next one it accepts;
        matches still read the remote meanwhile."""
        return self._writes_refused

    def pending_writes(self) -> int:
        return len(self._pending)

    # PrefixIndex port
    async def match(self, hashes: Sequence[int]) -> Mapping[str, int]:
        local = self.local.match_sync(hashes)
        if self._degraded or not hashes:
            if self._slow and hashes and len(self._late) < self._max_late:
                # Too slow to wait for, but up: ask anyway, the answer feeds the answers index.
                self._let_finish(hashes, asyncio.ensure_future(self.remote.match(hashes)))
            return self._fallback(hashes, local)
        start = self._clock()
        call = asyncio.ensure_future(self.remote.match(hashes))
        try:
            async with asyncio.timeout(self._budget):
                remote = await asyncio.shield(call)
        except asyncio.CancelledError:  # the request itself was cancelled
            self._let_finish(hashes, call)
            raise
        except TimeoutError:
            if not _answered(call):
                self._let_finish(hashes, call)
                self._missed(start)
                return self._fallback(hashes, local)
            remote = call.result()  # answered in the loop turn the deadline fired in
        except SharedStateReplyError as exc:  # the store is up; this call fell back
            self._reply_error(_MATCH, exc)
            return self._fallback(hashes, local)
        except Exception as exc:  # any other remote failure degrades; never raise to routing
            self._failed(_MATCH, exc)
            return self._fallback(hashes, local)
        self._observer.histogram(SHARED_STATE_ROUNDTRIP, _MATCH, self._clock() - start)
        self._misses = 0
        self._learn(hashes, remote)
        return _merged(remote, local) if local else remote

    def _missed(self, started: float) -> None:
        """A call started at ``started`` missed the budget. It counts towards ``miss_limit``
        only if it started after the last counted miss fired: calls that were in flight
        together through one pause (a burst of requests on a busy machine) are one stall,
        not several in a row."""
        self._observer.counter(SHARED_STATE_DEADLINE_MISSES, _NO_LABELS)
        if started < self._stall_seen_at:
            return
        self._stall_seen_at = self._clock()
        self._misses += 1
        if self._misses >= self._miss_limit:
            self._degrade(
                f"{self._misses} consecutive deadline misses of {self._budget}s", slow=True
            )

    def _fallback(self, hashes: Sequence[int], local: dict[str, int]) -> dict[str, int]:
        """Without the remote's answer: this process's adds, and what earlier answers said."""
        learned = self._answers.match_sync(hashes)
        return _merged(local, learned) if learned else local

    def _learn(self, hashes: Sequence[int], answer: Mapping[str, int]) -> None:
        """Keep the endpoint holding the longest part of the chain, as the remote said, in
        the answers index: a later match that misses the budget is answered from it."""
        if not answer:
            return
        best = max(answer, key=answer.__getitem__)
        count = min(answer[best], len(hashes))
        if self._answers.match_sync(hashes[:count]).get(best, 0) < count:
            self._answers.add_sync(hashes[:count], best, self._answers_capacity)

    def _let_finish(self, hashes: Sequence[int], call: asyncio.Future[Mapping[str, int]]) -> None:
        """A match past the budget runs on in the background, at most ``max_late`` at once
        (past that it is cancelled)."""
        if len(self._late) >= self._max_late:
            call.cancel()
        else:
            self._late.add(call)
        call.add_done_callback(functools.partial(self._late_done, hashes))

    def _late_done(self, hashes: Sequence[int], call: asyncio.Future[Mapping[str, int]]) -> None:
        self._late.discard(call)
        if call.cancelled() or call.exception() is not None:
            return  # a late failure is not this request's (retrieved, not raised)
        self._learn(hashes, call.result())

    async def add(self, hashes: Sequence[int], endpoint: str, capacity: int) -> None:
        self._add_now(hashes, endpoint, capacity)

    async def claim(
        self,
        hashes: Sequence[int],
        endpoint: str,
        capacity: int,
        alternates: Sequence[str] = (),
    ) -> str:
        """The remote's claim within ``budget``, returning the endpoint that owns the chain
        (``endpoint``, one of ``alternates`` it placed the new chain on, or another owner).

        Without its answer in time (a miss, or degraded for slowness: then it is sent
        without waiting), ``endpoint`` keeps this request and the late answer decides what
        is recorded: won, the chain is ``endpoint``'s here too; another owner, nothing is
        written and this process learns the owner, so the chain's next requests follow it
        rather than split between two servers; no answer (an error), the chain is recorded
        as by ``add``. Degraded by failures, or a remote that cannot claim: ``add``.
        """
        remote = self.remote
        can_claim = isinstance(remote, ClaimingPrefixIndex)
        if not hashes or not can_claim or (self._degraded and not self._slow):
            if hashes:
                self._observer.counter(SHARED_STATE_CLAIMS, _FALLBACK)
            await self.add(hashes, endpoint, capacity)
            return endpoint
        assert isinstance(remote, ClaimingPrefixIndex)
        if self._degraded:  # slow: too slow to wait for, but up: claim without waiting
            self._observer.counter(SHARED_STATE_CLAIMS, _FALLBACK)
            self._claim_late(remote, hashes, endpoint, capacity, alternates)
            return endpoint
        start = self._clock()
        call = asyncio.ensure_future(
            self._remote_claim(remote, hashes, endpoint, capacity, alternates)
        )
        try:
            async with asyncio.timeout(self._claim_budget):
                owner = await asyncio.shield(call)
        except asyncio.CancelledError:
            self._watch_late_claim(call, hashes, endpoint, capacity)
            raise
        except TimeoutError:
            if not _answered(call):
                self._watch_late_claim(call, hashes, endpoint, capacity)
                self._missed(start)
                self._observer.counter(SHARED_STATE_CLAIMS, _FALLBACK)
                return endpoint
            owner = call.result()
        except SharedStateReplyError as exc:
            self._reply_error(_CLAIM, exc)
            self._observer.counter(SHARED_STATE_CLAIMS, _FALLBACK)
            await self.add(hashes, endpoint, capacity)
            return endpoint
        except Exception as exc:
            self._failed(_CLAIM, exc)
            self._observer.counter(SHARED_STATE_CLAIMS, _FALLBACK)
            await self.add(hashes, endpoint, capacity)
            return endpoint
        self._observer.histogram(SHARED_STATE_ROUNDTRIP, _CLAIM, self._clock() - start)
        self._misses = 0
        if owner == endpoint:
            self._observer.counter(SHARED_STATE_CLAIMS, _WON)
            self._claimed(hashes, endpoint, capacity)
        else:
            self._observer.counter(SHARED_STATE_CLAIMS, _MOVED if owner in alternates else _LOST)
            self._learn(hashes, {owner: len(hashes)})
        return owner

    async def _remote_claim(
        self,
        remote: ClaimingPrefixIndex,
        hashes: Sequence[int],
        endpoint: str,
        capacity: int,
        alternates: Sequence[str],
    ) -> str:
        """The remote's claim; from a store that names the owner before its last writes
        (``StagedClaimingPrefixIndex``), the owner, those writes left to a background task
        (at most ``max_late`` at once; past that they are awaited here)."""
        if not isinstance(remote, StagedClaimingPrefixIndex):
            return await remote.claim(hashes, endpoint, capacity, alternates)
        owner, rest = await remote.claim_owner(hashes, endpoint, capacity, alternates)
        if rest is None:
            return owner
        if len(self._claim_rests) >= self._max_late:
            await self._run_claim_rest(rest)
            return owner
        task = asyncio.ensure_future(self._run_claim_rest(rest))
        self._claim_rests.add(task)
        task.add_done_callback(self._claim_rests.discard)
        return owner

    async def _run_claim_rest(self, rest: Callable[[], Awaitable[None]]) -> None:
        """A claim's last writes, under ``write_timeout``; a failure counts as a claim's."""
        try:
            async with asyncio.timeout(self._write_timeout):
                await rest()
        except SharedStateReplyError as exc:
            self._reply_error(_CLAIM, exc)
        except Exception as exc:
            self._failed(_CLAIM, exc)

    def _claimed(self, hashes: Sequence[int], endpoint: str, capacity: int) -> None:
        """A claim the remote recorded for ``endpoint``: the local index and the journal."""
        self._observer.counter(SHARED_STATE_WRITES, _NO_LABELS)
        self.local.add_sync(hashes, endpoint, capacity)
        self._answers_capacity = capacity
        self._remember((tuple(hashes), endpoint, capacity))
        self._note_sent(tuple(hashes), endpoint, self._clock())

    def _claim_late(
        self,
        remote: ClaimingPrefixIndex,
        hashes: Sequence[int],
        endpoint: str,
        capacity: int,
        alternates: Sequence[str],
    ) -> None:
        """Send a claim nobody waits for (at most ``max_late`` at once; past that the chain
        is recorded as by ``add``). It carries the alternates as a waited-for claim does:
        the new chains of a burst still spread, though their first requests stay put."""
        if len(self._late_claims) >= self._max_late:
            self._add_now(hashes, endpoint, capacity)
            return
        call = asyncio.ensure_future(
            self._remote_claim(remote, hashes, endpoint, capacity, alternates)
        )
        self._watch_late_claim(call, hashes, endpoint, capacity)

    def _watch_late_claim(
        self, call: asyncio.Future[str], hashes: Sequence[int], endpoint: str, capacity: int
    ) -> None:
        self._late_claims.add(call)
        call.add_done_callback(functools.partial(self._late_claim, hashes, endpoint, capacity))

    def _late_claim(
        self, hashes: Sequence[int], endpoint: str, capacity: int, call: asyncio.Future[str]
    ) -> None:
        """A claim answered after ``endpoint`` got its request (see ``claim``); an error is
        not this request's (retrieved, not raised)."""
        self._late_claims.discard(call)
        if call.cancelled() or call.exception() is not None:
            self._add_now(hashes, endpoint, capacity)
            return
        owner = call.result()
        if owner == endpoint:
            self._claimed(hashes, endpoint, capacity)
        else:
            self._learn(hashes, {owner: len(hashes)})

    def _add_now(self, hashes: Sequence[int], endpoint: str, capacity: int) -> None:
        """``add`` outside a coroutine: recorded locally, queued for the remote."""
        self.local.add_sync(hashes, endpoint, capacity)
        self._answers_capacity = capacity
        write = (tuple(hashes), endpoint, capacity)
        self._remember(write)
        if (self._degraded and not self._slow) or len(self._pending) >= self._max_pending:
            self._observer.counter(SHARED_STATE_DROPPED_WRITES, _NO_LABELS)
            return
        self._pending.append(write)
        self._wake.set()

    async def remove_endpoint(self, endpoint: str) -> None:
        self.local.remove_endpoint_sync(endpoint)
        self._answers.remove_endpoint_sync(endpoint)
        self._forget(endpoint)
        if self._degraded:
            self._removed_while_degraded.add(endpoint)
            return
        await self._remote_remove(endpoint)

    def size(self) -> int:
        return self.local.size()

    # Lifecycle
    async def start(self) -> None:
        if self._running:
            return
        self._running = True
        self._gauge.set(_COMPONENT, self._degraded)
        self._writer = asyncio.get_running_loop().create_task(self._write_loop())
        if not self._degraded and self._warm_connections:
            await self._warm()
        if self._degraded:
            self._start_probe()

    async def _warm(self) -> None:
        try:
            async with asyncio.timeout(self._probe_timeout):
                # One call alone first: a cluster client learns the slot map on its first
                # call, and several first calls at once can fail in it.
                await self.remote.match(_PROBE_HASHES)
                more = self._warm_connections - 1
                await asyncio.gather(*(self.remote.match(_PROBE_HASHES) for _ in range(more)))
        except SharedStateReplyError as exc:
            self._reply_error(_MATCH, exc)
        except Exception as exc:  # the first requests would find the same: degrade now
            self._failed(_MATCH, exc)

    async def flush(self) -> None:
        """Wait until every queued write was sent or dropped (between start and stop)."""
        while self._running and (self._pending or self._sending):
            self._drained.clear()
            await self._drained.wait()

    async def stop(self) -> None:
        """Send what is queued (for at most ``write_timeout``), then stop the tasks."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self._write_timeout):
                await self.flush()
        self._running = False
        self._drained.set()
        tasks = [t for t in (self._writer, self._probe, self._rebuild) if t is not None]
        for task in tasks:
            task.cancel()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self._write_timeout):
                await asyncio.gather(*self._claim_rests, return_exceptions=True)
        late: list[asyncio.Future[Any]] = [*self._late, *self._late_claims, *self._claim_rests]
        for call in late:
            call.cancel()
        await asyncio.gather(*tasks, *late, return_exceptions=True)
        self._writer = self._probe = self._rebuild = None

    # Health
    def _failed(self, labels: Mapping[str, str], exc: BaseException) -> None:
        self._observer.counter(SHARED_STATE_ERRORS, labels)
        self._degrade(f"{labels['operation']} failed: {exc!r}")

    def _reply_error(self, labels: Mapping[str, str], exc: BaseException) -> None:
        """An error reply or garbage: counted; logged at once, then at most once a minute
        with the count since, so a poisoned key cannot flood the log or flap the state."""
        self._observer.counter(SHARED_STATE_ERRORS, labels)
        self._reply_errors += 1
        now = self._clock()
        if now - self._reply_warned_at >= _REPLY_WARNING_INTERVAL:
            logger.warning(
                "shared prefix index: %d error replies (%s fell back to local state), last: %s",
                self._reply_errors,
                labels["operation"],
                exc,
            )
            self._reply_errors = 0
            self._reply_warned_at = now

    def _refused(self, exc: BaseException, write: _Write) -> None:
        """The remote refuses writes (out of memory): counted; logged once per change. The
        write is kept (the last ``max_pending``; older ones are dropped and counted) and
        sent again once a write is accepted."""
        self._observer.counter(SHARED_STATE_ERRORS, _ADD)
        refused = self._refused_writes
        if len(refused) >= self._max_pending:
            refused.popleft()
            self._observer.counter(SHARED_STATE_DROPPED_WRITES, _NO_LABELS)
        refused.append(write)
        if not self._writes_refused:
            self._writes_refused = True
            logger.warning(
                "shared prefix index: redis refuses writes, new prefixes stay local "
                "(matches still read it): %s",
                exc,
            )

    def _degrade(self, reason: str, *, slow: bool = False) -> None:
        self._misses = 0
        if not slow:
            self._sent.clear()  # the remote may come back without them
        if self._degraded and (slow or not self._slow):
            return
        worse = self._degraded  # degraded for slowness, and now failing
        self._degraded = True
        self._slow = slow
        if not slow:
            dropped = len(self._pending)
            self._pending.clear()
            if dropped:
                self._observer.counter(SHARED_STATE_DROPPED_WRITES, _NO_LABELS, dropped)
        if worse:
            logger.warning("shared prefix index failing while degraded: %s", reason)
            return
        logger.warning("shared prefix index degraded, routing on local state: %s", reason)
        self._gauge.set(_COMPONENT, True)
        if self._running:
            self._start_probe()

    def _start_probe(self) -> None:
        if self._probe is None or self._probe.done():
            self._probe = asyncio.get_running_loop().create_task(self._probe_loop())

    async def _probe_loop(self) -> None:
        # Degraded again soon after healing (a store that answers probes but fails requests):
        # keep the backoff reached so far, so the state flaps at most once per probe_max.
        if self._clock() - self._healed_at < self._probe_max:
            delay = min(self._probe_delay * 2, self._probe_max)
        else:
            delay = self._probe_initial
        while self._degraded:
            self._probe_delay = delay
            await self._sleep(delay)
            start = self._clock()
            try:
                # Its own timeout, not the routing budget: the first call after an outage
                # also reconnects, and a busy machine must heal too.
                async with asyncio.timeout(self._probe_timeout):
                    await self.remote.match(_PROBE_HASHES)
            except SharedStateReplyError:
                pass  # an error reply: the store is up
            except Exception:  # still down: wait longer
                delay = min(delay * 2, self._probe_max)
                continue
            took = self._clock() - start
            self._observer.histogram(SHARED_STATE_ROUNDTRIP, _PROBE, took)
            if self._slow and took > self._budget:
                # Degraded for being slow: heal only once a round trip fits the budget.
                delay = min(delay * 2, self._probe_max)
                continue
            self._recover()

    def _recover(self) -> None:
        self._degraded = False
        self._misses = 0
        self._healed_at = self._clock()
        removals = sorted(self._removed_while_degraded)
        self._removed_while_degraded.clear()
        # Degraded for slowness only, the writes kept going: nothing to re-send.
        writes = [] if self._slow else [w for w in self._journal if self.local.holds(w[1])]
        self._slow = False
        logger.info(
            "shared prefix index healthy again; re-sending %d adds and %d removals",
            len(writes),
            len(removals),
        )
        self._gauge.set(_COMPONENT, False)
        if self._running:
            self._rebuild = asyncio.get_running_loop().create_task(
                self._rebuild_remote(removals, writes)
            )

    async def _rebuild_remote(self, removals: list[str], writes: list[_Write]) -> None:
        for endpoint in removals:
            if self._degraded or not await self._remote_remove(endpoint):
                return
        for write in writes:
            if self._degraded or not await self._remote_add(write):
                return
            await asyncio.sleep(0)  # let requests run between re-sent writes

    # Writes
    async def _write_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending and (not self._degraded or self._slow):
                self._sending = True
                try:
                    await self._remote_add(self._pending.popleft(), tail=True)
                finally:
                    self._sending = False
            self._drained.set()

    def _held_sent(self, hashes: tuple[int, ...], endpoint: str) -> tuple[int, float]:
        """How many leading ``hashes`` this process sent the remote for ``endpoint`` in full
        within the last ``resend_interval`` (0: send them all), and when."""
        now = self._clock()
        sent = self._sent.get((endpoint, hashes[0])) if hashes and self._tails else None
        if sent is None or now - sent[1] >= self._resend_interval:
            return 0, now
        previous, at = sent
        held, limit = 0, min(len(previous), len(hashes))
        while held < limit and previous[held] == hashes[held]:
            held += 1
        return held, at if held else now

    def _note_sent(self, hashes: tuple[int, ...], endpoint: str, start_sent_at: float) -> None:
        """``hashes`` reached the remote for ``endpoint``; their start was last sent in
        full at ``start_sent_at`` (so it is re-sent once per ``resend_interval``, and its
        recency there stays within that of the truth)."""
        if not hashes or not self._tails:
            return
        key = (endpoint, hashes[0])
        self._sent.pop(key, None)
        self._sent[key] = (hashes, start_sent_at)
        if len(self._sent) > _SENT_LIMIT:
            del self._sent[next(iter(self._sent))]

    async def _remote_add(self, write: _Write, *, tail: bool = False) -> bool:
        hashes, endpoint, capacity = write
        held, start_sent_at = self._held_sent(hashes, endpoint) if tail else (0, self._clock())
        start = self._clock()
        remote = self.remote
        try:
            async with asyncio.timeout(self._write_timeout):
                if held >= len(hashes) and held:
                    pass  # the remote has all of it, sent within resend_interval
                elif held and isinstance(remote, TailAddingPrefixIndex):
                    await remote.add_tail(hashes, held, endpoint, capacity)
                else:
                    await remote.add(hashes, endpoint, capacity)
        except SharedStateWriteRefusedError as exc:
            self._refused(exc, write)
            return False
        except SharedStateReplyError as exc:
            self._reply_error(_ADD, exc)
            return True  # that write is lost; the next ones may land
        except Exception as exc:
            self._failed(_ADD, exc)
            return False
        if held < len(hashes) or not held:
            self._observer.histogram(SHARED_STATE_ROUNDTRIP, _ADD, self._clock() - start)
        self._note_sent(hashes, endpoint, start_sent_at)
        self._observer.counter(SHARED_STATE_WRITES, _NO_LABELS)
        if self._writes_refused:
            self._writes_refused = False
            again = [w for w in self._refused_writes if self.local.holds(w[1])]
            self._refused_writes.clear()
            room = self._max_pending - len(self._pending)
            if len(again) > room:
                self._observer.counter(SHARED_STATE_DROPPED_WRITES, _NO_LABELS, len(again) - room)
                again = again[len(again) - room :] if room > 0 else []
            self._pending.extend(again)
            if again:
                self._wake.set()
            logger.info(
                "shared prefix index: redis accepts writes again; re-sending %d refused writes",
                len(again),
            )
        return True

    async def _remote_remove(self, endpoint: str) -> bool:
        start = self._clock()
        try:
            async with asyncio.timeout(self._write_timeout):
                await self.remote.remove_endpoint(endpoint)
        except SharedStateReplyError as exc:
            self._reply_error(_REMOVE, exc)
            return True
        except Exception as exc:
            self._failed(_REMOVE, exc)
            self._removed_while_degraded.add(endpoint)
            return False
        self._observer.histogram(SHARED_STATE_ROUNDTRIP, _REMOVE, self._clock() - start)
        return True

    # The journal of recent adds, for the rebuild
    def _remember(self, write: _Write) -> None:
        limit = self._journal_limit
        if not limit:
            return
        journal = self._journal
        journal.append(write)
        self._journal_size += len(write[0])
        while self._journal_size > limit and journal:
            self._journal_size -= len(journal.popleft()[0])

    def _forget(self, endpoint: str) -> None:
        if any(w[1] == endpoint for w in self._journal):
            kept = [w for w in self._journal if w[1] != endpoint]
            self._journal = deque(kept)
            self._journal_size = sum(len(w[0]) for w in kept)
        if any(w[1] == endpoint for w in self._pending):
            self._pending = deque(w for w in self._pending if w[1] != endpoint)


def _merged(first: Mapping[str, int], second: Mapping[str, int]) -> dict[str, int]:
    """Per endpoint, the larger count of the two."""
    merged = dict(first)
    for endpoint, count in second.items():
        if count > merged.get(endpoint, 0):
            merged[endpoint] = count
    return merged


def _answered(call: asyncio.Future[Any]) -> bool:
    """Done with a result (not cancelled, no exception)."""
    return call.done() and not call.cancelled() and call.exception() is None
