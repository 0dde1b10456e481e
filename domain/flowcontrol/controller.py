"""``FlowController``: priority bands, fair queues, saturation-gated dispatch.

One controller serves one inference pool, on one asyncio event loop. Its whole state is
touched from that loop only (no locks). See the package docstring for the contract; the
mechanics are:

- **Enqueue.** A request joins the band of its priority (created on first use from the
  default band config) and the queue of its flow (fairness id). Capacity is checked
  first: global bytes and requests, then the band's. A request that does not fit may
  displace queued requests of strictly lower priority (only global capacity can be freed
  that way: a band holds a single priority). Otherwise it is ``RejectedCapacity``.
- **Fast path.** When nothing at all is queued, the request fits, and the pool is below
  its band's ceiling, it is dispatched on the spot: no queue entry, no task switch.
- **Dispatch cycle.** Read saturation; take the highest band that has queued requests;
  if saturation is at or above that band's ceiling (usage-limit policy), or the band is
  sheddable (priority < 0) and saturation >= 1.0, stop: nothing lower may go (no priority
  inversion). Otherwise the band's fairness policy picks a flow and its head is
  dispatched. Saturation is re-read before every dispatch.
- **What runs a cycle.** Every enqueue runs one cycle of at most one dispatch (as the
  reference: enqueue, then a cycle). ``notify()`` schedules one cycle (coalesced, via
  ``call_soon``) of at most ``max_dispatch_per_cycle``. A fallback tick runs a cycle of
  at most one; it is armed only while requests wait: every ``dispatch_interval`` while
  requests go, backing off (doubling, up to ``max_dispatch_interval``) while ticks find
  the pool blocked, so a long saturation costs a few wake-ups a second. Rationale: the
  saturation function may not move until the next metrics refresh, so dispatching a
  whole backlog on one reading would flood the pool. A notify() says "capacity may have
  changed", which earns a bounded burst, each dispatch still gated by a fresh reading;
  without news, the backlog drains no faster than the reference's one request per tick.
- **TTL.** Each queued request with a TTL has a deadline (received + TTL) in an indexed
  heap; one timer is armed for the earliest deadline. Expiry ends the request
  ``EvictedTTL`` when the timer fires (at its deadline, subject to loop timer precision).
- **Garbage collection.** A sweep every ``min(flow_gc_timeout, band_gc_timeout) / 2``,
  armed only while flows or on-demand bands exist, drops flows empty for
  ``flow_gc_timeout`` and on-demand bands empty for ``band_gc_timeout``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from domain.flowcontrol import metrics
from domain.flowcontrol.config import (
    DEFAULT_FAIRNESS_POLICY,
    DEFAULT_ORDERING_POLICY,
    DEFAULT_USAGE_LIMIT_POLICY,
    BandConfig,
    FlowControlConfig,
)
from domain.flowcontrol.deadlines import DeadlineHeap
from domain.flowcontrol.interfaces import (
    FairnessPolicy,
    LoopTimers,
    OrderingPolicy,
    TimerHandle,
    Timers,
    UsageLimitPolicy,
)
from domain.flowcontrol.plugins.fcfs_ordering import FcfsOrderingPolicy
from domain.flowcontrol.plugins.global_strict_fairness import GlobalStrictFairnessPolicy
from domain.flowcontrol.plugins.static_usage_limit import (
    StaticUsageLimitParameters,
    StaticUsageLimitPolicy,
)
from domain.flowcontrol.pool import MAX_PUBLISHED_FLOWS, OVERFLOW_KEY, flow_key
from domain.flowcontrol.queues import ListQueue, MaxMinHeap, QueueItem
from domain.flowcontrol.types import (
    FlowControlError,
    FlowControlReason,
    FlowKey,
    FlowRequest,
    FlowResult,
    QueueOutcome,
    RequestEvictedError,
    RequestRejectedError,
)
from domain.plugins.base import EmptyParameters, TypedName
from ports.metric_catalogue import (
    FLOW_CONTROL_DISPATCH_CYCLE_DURATION,
    FLOW_CONTROL_DISPLACED,
    FLOW_CONTROL_ENQUEUE_DURATION,
    FLOW_CONTROL_POOL_SATURATION,
    FLOW_CONTROL_QUEUE_BYTES,
    FLOW_CONTROL_QUEUE_DURATION,
    FLOW_CONTROL_QUEUE_SIZE,
)
from ports.observer import NoopObserver, Observer
from ports.shared_state import NO_POOL_FLOWS, FlowCounts, PoolFlows, SharedAdmission

__all__ = ["BandStats", "FlowControlStats", "FlowController"]

logger = logging.getLogger(__name__)

_INF = math.inf
_NO_LABELS: Mapping[str, str] = MappingProxyType({})

_DISPATCHED = QueueOutcome.DISPATCHED
_NOT_YET = QueueOutcome.NOT_YET_FINALIZED
_ZERO = FlowCounts()
#: At most this many recent dispatches kept for the pool's estimate (``pool_in_flight``).
_MAX_RECENT = 4096
_NO_COUNTS: Mapping[str, FlowCounts] = MappingProxyType({})


def _default_policy(name: str) -> object | None:
    """The in-tree default policies, for when the plugins given do not include them."""
    if name == DEFAULT_ORDERING_POLICY:
        return FcfsOrderingPolicy(TypedName(name, name), EmptyParameters())
    if name == DEFAULT_FAIRNESS_POLICY:
        return GlobalStrictFairnessPolicy(TypedName(name, name), EmptyParameters())
    if name == DEFAULT_USAGE_LIMIT_POLICY:
        return StaticUsageLimitPolicy(TypedName(name, name), StaticUsageLimitParameters())
    return None


@dataclass(frozen=True, slots=True, kw_only=True)
class BandStats:
    """One priority band: what it holds and its limits (0 = unlimited)."""

    priority: int
    queued_requests: int
    queued_bytes: int
    flows: int
    active_flows: int
    max_bytes: int
    max_requests: int
    configured: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class FlowControlStats:
    """A snapshot of the controller. ``bands`` run from the highest priority down;
    ``tracked_deadlines`` counts queued requests with a TTL timer entry."""

    running: bool
    queued_requests: int
    queued_bytes: int
    tracked_deadlines: int
    saturation: float | None
    bands: tuple[BandStats, ...]
    #: requests dispatched and not yet released (``FlowController.release``)
    in_flight: int = 0

    def band(self, priority: int) -> BandStats | None:
        for band in self.bands:
            if band.priority == priority:
                return band
        return None


class _Series:
    """Queue-size/bytes gauge values of one label set."""

    __slots__ = ("bytes", "count", "key", "labels")

    def __init__(self, key: tuple[str, int, str, str, str], labels: Mapping[str, str]) -> None:
        self.key = key
        self.labels = labels
        self.count = 0
        self.bytes = 0


class _Flow:
    __slots__ = ("band", "flow_id", "idle_since", "in_flight", "pool_key", "queue", "shared")

    def __init__(self, flow_id: str, band: _Band, queue: ListQueue | MaxMinHeap) -> None:
        self.flow_id = flow_id
        self.band = band
        self.queue = queue
        self.idle_since = 0.0
        #: dispatched and not yet released
        self.in_flight = 0
        #: the key this flow is published under while busy (``OVERFLOW_KEY`` beyond the
        #: cap), None while idle; ``shared``: what it contributes to the published counts
        self.pool_key: str | None = None
        self.shared = _ZERO


class _Band:
    __slots__ = (
        "arrival_ordered",
        "bytes",
        "configured",
        "count",
        "fairness",
        "fairness_state",
        "flows",
        "heap_queues",
        "idle_since",
        "index",
        "label",
        "max_bytes",
        "max_requests",
        "newest",
        "oldest",
        "ordering",
        "others",
        "overflow",
        "priority",
        "queues",
        "request_ttl",
        "shared_flows",
    )

    def __init__(
        self,
        priority: int,
        config: BandConfig,
        ordering: OrderingPolicy,
        fairness: FairnessPolicy,
        *,
        configured: bool,
        now: float,
    ) -> None:
        self.priority = priority
        self.label = str(priority)
        self.max_bytes = config.max_bytes
        self.max_requests = config.max_requests
        self.request_ttl = config.request_ttl
        self.ordering = ordering
        self.heap_queues = bool(ordering.requires_priority_queue)
        self.arrival_ordered = not self.heap_queues
        self.fairness = fairness
        self.fairness_state = fairness.new_state()
        self.configured = configured
        self.flows: dict[str, _Flow] = {}
        self.queues: dict[str, ListQueue | MaxMinHeap] = {}
        self.count = 0
        self.bytes = 0
        self.oldest: QueueItem | None = None
        self.newest: QueueItem | None = None
        self.idle_since = now
        self.index = 0
        #: the other processes' flows of this band (shared key -> counts), as of the
        #: current cycle; ``shared_flows``: this band's flows by their shared key
        self.others: Mapping[str, FlowCounts] = _NO_COUNTS
        self.shared_flows: dict[str, _Flow] = {}
        #: the summed counts of this band's flows published under ``OVERFLOW_KEY``
        self.overflow = _ZERO

    # BandView: the pool's side
    def pool_in_flight(self, flow_id: str) -> int:
        flow = self.flows.get(flow_id)
        if flow is None:
            other = self.others.get(flow_key(flow_id))
            return other.in_flight if other is not None else 0
        own = flow.in_flight
        if not self.others:
            return own
        other = self.others.get(flow.pool_key or flow_key(flow_id))
        return own + other.in_flight if other is not None else own

    def waiting_elsewhere(self) -> Iterator[tuple[str, int]]:
        shared = self.shared_flows
        for key, counts in self.others.items():
            if counts.waiting <= 0:
                continue
            if key == OVERFLOW_KEY:
                yield key, counts.in_flight + self.overflow.in_flight
                continue
            local = shared.get(key)
            if local is None:
                yield key, counts.in_flight
            elif not len(local.queue):
                yield key, counts.in_flight + local.in_flight


class FlowController:
    """Holds requests until the pool has room for them, by priority and fairness.

    ``saturation`` returns the pool's current saturation (0 idle, 1.0 saturated). Policy
    names in ``config`` are looked up in ``plugins`` (plugins by name, e.g. the loaded
    config's); the three default policy names fall back to in-tree instances when absent.
    Raises ``ValueError`` when a named policy is missing or of the wrong kind.
    ``clock`` is the time base of ``FlowRequest.received_at`` (monotonic seconds);
    ``timers`` defaults to the running asyncio loop. ``pool`` shares this controller's
    flows with the pool's other processes (``domain.flowcontrol.pool``); without it the
    controller sees only its own.
    """

    def __init__(
        self,
        config: FlowControlConfig,
        *,
        saturation: Callable[[], float],
        plugins: Mapping[str, object] | None = None,
        observer: Observer | None = None,
        clock: Callable[[], float] = time.monotonic,
        timers: Timers | None = None,
        pool_name: str = "",
        fairness_label_limit: int = 1000,
        pool: SharedAdmission | None = None,
    ) -> None:
        self._config = config
        self._saturation_fn = saturation
        self._plugins: Mapping[str, object] = plugins if plugins is not None else {}
        self._observer: Observer = observer if observer is not None else NoopObserver()
        self._clock = clock
        self._timers: Timers = timers if timers is not None else LoopTimers(clock)
        self._pool_name = pool_name
        self._fairness_label = metrics.BoundedLabel(fairness_label_limit)
        self._pool_labels: Mapping[str, str] = MappingProxyType({"inference_pool": pool_name})
        self._default_ttl = config.default_request_ttl
        self._interval = config.dispatch_interval
        self._gc_period = min(config.flow_gc_timeout, config.band_gc_timeout) / 2.0

        self._resolved: dict[str, object] = {}
        self._usage: UsageLimitPolicy = self._resolve(
            config.usage_limit_policy_plugin_ref,
            UsageLimitPolicy,
            "usage-limit policy",
            "usageLimitPolicyPluginRef",
        )
        # Fail fast on the templates' policies: bands made on demand must not fail later.
        self._band_policies(config.default_priority_band, "defaultPriorityBand")
        if config.default_negative_priority_band is not None:
            self._band_policies(
                config.default_negative_priority_band, "defaultNegativePriorityBand"
            )

        self._bands: dict[int, _Band] = {}
        self._order: list[_Band] = []  # highest priority first
        self._priorities: tuple[int, ...] = ()
        self._bands_version = 0
        self._queued = 0
        self._bytes = 0
        self._seq = 0
        self._ttl = DeadlineHeap()
        self._series: dict[tuple[str, int, str, str, str], _Series] = {}
        self._running = False
        self._flow_count = 0
        self._in_flight = 0
        #: the other processes of the pool (None: this one alone)
        self._pool = pool
        self._pool_flows: PoolFlows = NO_POOL_FLOWS
        self._published = 0
        #: when this process dispatched, within the pool's ``visible_after`` (oldest first)
        self._recent: deque[float] = deque(maxlen=_MAX_RECENT)
        if pool is not None:
            pool.watch(self.notify)

        self._ttl_handle: TimerHandle | None = None
        self._ttl_at = _INF
        self._tick_handle: TimerHandle | None = None
        self._tick_at = _INF
        self._tick_delay = config.dispatch_interval
        self._notify_handle: TimerHandle | None = None
        self._gc_handle: TimerHandle | None = None

        self._last_saturation: float | None = None
        self._saturation_failing = False
        self._ceil_saturation = _INF
        self._ceil_version = -1
        self._ceilings: list[float] = []

        now = clock()
        for index, band_config in enumerate(config.priority_bands):
            self._add_band(
                band_config.priority,
                band_config,
                configured=True,
                now=now,
                path=f"priorityBands[{index}]",
            )

    # -- lifecycle -----------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._running

    def start(self) -> None:
        """Accepts requests from now on. Idempotent."""
        self._running = True

    async def stop(self) -> None:
        """Stops accepting requests and ends every queued one ``RejectedOther`` ("flow
        controller is not running"). Idempotent; ``start()`` may be called again."""
        self._running = False
        for handle in (self._tick_handle, self._notify_handle, self._gc_handle, self._ttl_handle):
            if handle is not None:
                handle.cancel()
        self._tick_handle = self._notify_handle = self._gc_handle = self._ttl_handle = None
        self._ttl_at = self._tick_at = _INF
        self._tick_delay = self._interval
        now = self._clock()
        for band in self._order:
            while (item := band.oldest) is not None:
                self._unqueue(item, now)
                self._finalize(
                    item,
                    QueueOutcome.REJECTED_OTHER,
                    RequestRejectedError(FlowControlReason.NOT_RUNNING),
                    now,
                )
        for band in list(self._order):
            for flow in band.flows.values():
                # What was dispatched is forgotten: its releases find no flow.
                flow.in_flight = 0
                self._publish(flow)
            self._flow_count -= len(band.flows)
            band.flows.clear()
            band.shared_flows.clear()
            if not band.configured:
                self._remove_band(band)
        self._in_flight = 0

    # -- the request path ----------------------------------------------------------------

    async def enqueue_and_wait(self, request: FlowRequest) -> FlowResult:
        """Submits ``request`` and returns its one final outcome.

        Never raises for request-level problems (they are outcomes). If the awaiting task
        is cancelled, the request is removed at once, ends ``EvictedContextCancelled``,
        and ``CancelledError`` propagates.
        """
        start = self._clock()
        if not self._running:
            return self._refuse(
                request, start, QueueOutcome.REJECTED_OTHER, FlowControlReason.NOT_RUNNING
            )
        queued = self._enqueue(request, start)
        if isinstance(queued, FlowResult):
            return queued
        item = queued
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        item.waiter = waiter
        try:
            await waiter
        except asyncio.CancelledError:
            item.waiter = None
            if item.outcome is _NOT_YET:
                now = self._clock()
                self._unqueue(item, now)
                self._finalize(
                    item,
                    QueueOutcome.EVICTED_CONTEXT_CANCELLED,
                    RequestEvictedError(FlowControlReason.CONTEXT_CANCELLED),
                    now,
                )
            raise
        item.waiter = None
        return FlowResult(
            outcome=item.outcome, error=item.error, queue_time=item.finished_at - start
        )

    def notify(self) -> None:
        """Something may have freed capacity (metrics refreshed, a request completed).

        Schedules one dispatch cycle of up to ``max_dispatch_per_cycle`` on the loop;
        calls before it runs are coalesced. A no-op while nothing is queued. Call from
        the event loop's thread.
        """
        if self._notify_handle is None and self._queued and self._running:
            self._notify_handle = self._timers.call_soon(self._on_notify)

    def release(self, key: FlowKey) -> None:
        """A request of flow ``key`` that this controller dispatched is done (completed,
        failed or abandoned): it no longer counts in flight, and a dispatch cycle is
        scheduled (as ``notify``). Call once per dispatched request."""
        band = self._bands.get(key.priority)
        if band is None:
            return
        flow = band.flows.get(key.id)
        if flow is None or flow.in_flight <= 0:
            return  # dispatched before a stop(): not counted any more
        flow.in_flight -= 1
        self._in_flight -= 1
        if not flow.in_flight and not len(flow.queue):
            flow.idle_since = now = self._clock()
            if not band.count:
                band.idle_since = now
        if flow.pool_key is not None:
            self._publish(flow)
        self.notify()

    @property
    def in_flight(self) -> int:
        """Requests this controller dispatched and has not been told are done."""
        return self._in_flight

    def pool_in_flight(self) -> int:
        """``in_flight`` plus the other processes' (as of their last shared counts) plus,
        for each other live process, as many as this one dispatched in the time a dispatch
        takes to show in the others' counts (``visible_after``): in that time each process
        assumes the others take the free room as fast as it does, so that idle processes
        receiving a burst together share the room instead of each filling all of it."""
        pool = self._pool
        if pool is None:
            return self._in_flight
        flows = pool.flows()
        if not flows.processes:
            return self._in_flight + flows.in_flight
        return self._in_flight + flows.in_flight + flows.processes * self._unseen(pool)

    def _unseen(self, pool: SharedAdmission) -> int:
        """This process's dispatches the others may not see yet."""
        recent = self._recent
        if recent:
            horizon = self._clock() - pool.visible_after()
            while recent and recent[0] <= horizon:
                recent.popleft()
        return len(recent)

    def stats(self) -> FlowControlStats:
        return FlowControlStats(
            running=self._running,
            queued_requests=self._queued,
            queued_bytes=self._bytes,
            tracked_deadlines=len(self._ttl),
            saturation=self._last_saturation,
            bands=tuple(
                BandStats(
                    priority=band.priority,
                    queued_requests=band.count,
                    queued_bytes=band.bytes,
                    flows=len(band.flows),
                    active_flows=len(band.queues),
                    max_bytes=band.max_bytes,
                    max_requests=band.max_requests,
                    configured=band.configured,
                )
                for band in self._order
            ),
            in_flight=self._in_flight,
        )

    # -- enqueue ---------------------------------------------------------------------------

    def _enqueue(self, request: FlowRequest, start: float) -> QueueItem | FlowResult:
        item: QueueItem | None = None
        try:
            priority = request.flow_key.priority
            band = self._bands.get(priority)
            if band is None:
                template = self._config.default_priority_band
                if priority < 0 and self._config.default_negative_priority_band is not None:
                    template = self._config.default_negative_priority_band
                band = self._add_band(priority, template, configured=False, now=start)
            size = request.byte_size if request.byte_size > 0 else 0
            blocked = False
            if not self._queued:
                if not self._fits(band, size):
                    return self._refuse(
                        request,
                        start,
                        QueueOutcome.REJECTED_CAPACITY,
                        FlowControlReason.QUEUE_AT_CAPACITY,
                    )
                saturation = self._read_saturation()
                if self._may_dispatch(band, saturation) and self._uncontended(band):
                    band.idle_since = start
                    return self._dispatch_now(request, band, start)
                blocked = True  # the pool has no room for the only request: no cycle

            if request.ttl > 0:
                ttl = request.ttl
            else:
                ttl = self._default_ttl if band.request_ttl is None else band.request_ttl
            self._seq = seq = self._seq + 1
            item = QueueItem(
                request,
                byte_size=size,
                seq=seq,
                enqueued_at=start,
                expires_at=request.received_at + ttl if ttl > 0 else _INF,
            )
            key = band.ordering.order_key(item)
            item.order = (key[0], key[1], seq)
            if not self._fits(band, size) and not (
                self._config.displacement and self._displace(band, size, start)
            ):
                return self._refuse(
                    request,
                    start,
                    QueueOutcome.REJECTED_CAPACITY,
                    FlowControlReason.QUEUE_AT_CAPACITY,
                )
            self._insert(band, item, start)
        except Exception:
            logger.exception("flow control: cannot enqueue request %s", request.request_id)
            if item is not None and item.owner is not None:
                self._unqueue(item, self._clock())
            return self._refuse(
                request, start, QueueOutcome.REJECTED_OTHER, FlowControlReason.INTERNAL
            )
        self._record_enqueue(request, band.label, _NOT_YET, start)
        assert item is not None
        if blocked:
            self._arm_tick()
        else:
            self._run_cycle(1, from_tick=False)
        if item.outcome is _DISPATCHED:
            return FlowResult(outcome=_DISPATCHED, queue_time=item.finished_at - start)
        return item

    def _fits(self, band: _Band, size: int) -> bool:
        config = self._config
        if config.max_bytes and self._bytes + size > config.max_bytes:
            return False
        if config.max_requests and self._queued + 1 > config.max_requests:
            return False
        if band.max_bytes and band.bytes + size > band.max_bytes:
            return False
        return not (band.max_requests and band.count + 1 > band.max_requests)

    def _displace(self, band: _Band, size: int, now: float) -> bool:
        """Evicts queued requests of strictly lower priority than ``band``, lowest
        priority first and newest first within a priority, until ``size`` bytes and one
        request fit globally. Evicts nothing and returns False when that cannot work."""
        if band.max_bytes and band.bytes + size > band.max_bytes:
            return False
        if band.max_requests and band.count + 1 > band.max_requests:
            return False
        config = self._config
        need_bytes = self._bytes + size - config.max_bytes if config.max_bytes else 0
        need_requests = self._queued + 1 - config.max_requests if config.max_requests else 0
        lower = self._order[band.index + 1 :]
        if sum(b.bytes for b in lower) < need_bytes or sum(b.count for b in lower) < (
            need_requests
        ):
            return False
        observer = self._observer
        for victim_band in reversed(lower):
            labels = {"priority": victim_band.label}
            while (need_bytes > 0 or need_requests > 0) and (
                victim := victim_band.newest
            ) is not None:
                self._unqueue(victim, now)
                need_bytes -= victim.byte_size
                need_requests -= 1
                logger.debug(
                    "flow control: request %s displaced for a priority %d request",
                    victim.request.request_id,
                    band.priority,
                )
                self._finalize(
                    victim,
                    QueueOutcome.EVICTED_OTHER,
                    RequestEvictedError(FlowControlReason.DISPLACED),
                    now,
                )
                observer.counter(FLOW_CONTROL_DISPLACED, labels)
            if need_bytes <= 0 and need_requests <= 0:
                break
        return True

    def _flow(self, band: _Band, flow_id: str) -> _Flow:
        """The band's flow ``flow_id``, made on first use."""
        flow = band.flows.get(flow_id)
        if flow is None:
            queue = MaxMinHeap(flow_id) if band.heap_queues else ListQueue(flow_id)
            flow = _Flow(flow_id, band, queue)
            band.flows[flow_id] = flow
            if self._pool is not None:
                band.shared_flows[flow_key(flow_id)] = flow
            self._flow_count += 1
            self._arm_gc()
        return flow

    def _insert(self, band: _Band, item: QueueItem, now: float) -> None:
        request = item.request
        flow_id = request.flow_key.id
        flow = self._flow(band, flow_id)
        queue = flow.queue
        if not len(queue):
            band.queues[flow_id] = queue
        queue.push(item)
        item.owner = flow
        newest = band.newest
        item.band_prev = newest
        if newest is None:
            band.oldest = item
        else:
            newest.band_next = item
        band.newest = item
        size = item.byte_size
        band.count += 1
        band.bytes += size
        self._queued += 1
        self._bytes += size
        if item.expires_at != _INF:
            self._ttl.push(item)
            if item.expires_at < self._ttl_at:
                self._arm_ttl(item.expires_at)
        self._series_add(item, band)
        if self._pool is not None:
            self._publish(flow)

    def _unqueue(self, item: QueueItem, now: float) -> None:
        """Removes a queued item from every structure (it is not finalized here)."""
        flow: _Flow = item.owner
        band = flow.band
        queue = flow.queue
        queue.remove(item)
        if not len(queue):
            del band.queues[flow.flow_id]
            flow.idle_since = now
        if self._pool is not None:
            self._publish(flow)
        prev = item.band_prev
        nxt = item.band_next
        if prev is None:
            band.oldest = nxt
        else:
            prev.band_next = nxt
        if nxt is None:
            band.newest = prev
        else:
            nxt.band_prev = prev
        item.band_prev = item.band_next = None
        item.owner = None
        size = item.byte_size
        band.count -= 1
        band.bytes -= size
        if not band.count:
            band.idle_since = now
        self._queued -= 1
        self._bytes -= size
        if item.ttl_index >= 0:
            ttl = self._ttl
            ttl.remove(item)
            if not len(ttl) and self._ttl_handle is not None:
                self._ttl_handle.cancel()
                self._ttl_handle = None
                self._ttl_at = _INF
        self._series_remove(item)

    def _finalize(
        self,
        item: QueueItem,
        outcome: QueueOutcome,
        error: FlowControlError | None,
        now: float,
    ) -> None:
        item.outcome = outcome
        item.error = error
        item.finished_at = now
        self._record_final(item.request, outcome, now - item.enqueued_at)
        waiter = item.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _dispatch_now(self, request: FlowRequest, band: _Band, start: float) -> FlowResult:
        self._count_dispatch(self._flow(band, request.flow_key.id))
        self._record_enqueue(request, band.label, _DISPATCHED, start)
        elapsed = self._clock() - start
        self._record_final(request, _DISPATCHED, elapsed)
        return FlowResult(outcome=_DISPATCHED, queue_time=elapsed)

    def _refuse(
        self,
        request: FlowRequest,
        start: float,
        outcome: QueueOutcome,
        reason: FlowControlReason,
    ) -> FlowResult:
        priority = request.flow_key.priority
        band = self._bands.get(priority)
        label = band.label if band is not None else str(priority)
        self._record_enqueue(request, label, outcome, start)
        elapsed = self._clock() - start
        self._record_final(request, outcome, elapsed)
        return FlowResult(outcome=outcome, error=RequestRejectedError(reason), queue_time=elapsed)

    # -- dispatch --------------------------------------------------------------------------

    def _read_saturation(self) -> float:
        try:
            value = float(self._saturation_fn())
        except Exception:
            if not self._saturation_failing:
                logger.exception("flow control: saturation unavailable, treating as 1.0")
                self._saturation_failing = True
            value = 1.0
        else:
            self._saturation_failing = False
        if math.isnan(value):
            value = 1.0
        if value != self._last_saturation:
            self._last_saturation = value
            self._observer.gauge(FLOW_CONTROL_POOL_SATURATION, self._pool_labels, value)
        return value

    def _may_dispatch(self, band: _Band, saturation: float) -> bool:
        if band.priority < 0 and saturation >= 1.0:
            return False
        if saturation != self._ceil_saturation or self._ceil_version != self._bands_version:
            limits = list(self._usage.compute_limit(saturation, self._priorities))
            if len(limits) != len(self._priorities):
                raise ValueError(
                    f"usage-limit policy {self._usage.typed_name} returned {len(limits)} "
                    f"ceilings for {len(self._priorities)} bands"
                )
            self._ceilings = limits
            self._ceil_saturation = saturation
            self._ceil_version = self._bands_version
        return saturation < self._ceilings[band.index]

    def _run_cycle(self, budget: int, *, from_tick: bool) -> None:
        if not self._queued:
            return
        clock = self._clock
        start = clock()
        dispatched = 0
        try:
            dispatched = self._dispatch(budget)
        except Exception:
            logger.exception("flow control: dispatch cycle failed")
        self._observer.histogram(FLOW_CONTROL_DISPATCH_CYCLE_DURATION, _NO_LABELS, clock() - start)
        if dispatched:
            self._tick_delay = self._interval
        elif from_tick:
            self._tick_delay = min(self._tick_delay * 2.0, self._config.max_dispatch_interval)
        self._arm_tick()

    def _dispatch(self, budget: int) -> int:
        """Dispatches up to ``budget`` requests; returns how many went."""
        dispatched = 0
        while dispatched < budget and self._queued:
            band = next(b for b in self._order if b.count)
            if not self._may_dispatch(band, self._read_saturation()):
                break
            if self._pool is not None:
                flows = self._pool.flows()
                if flows.top_waiting is not None and flows.top_waiting > band.priority:
                    break  # another process's higher band takes the room first
                band.others = flows.bands.get(band.priority, _NO_COUNTS)
            queue = band.fairness.pick_flow(band.fairness_state, band)
            if queue is None:
                break  # the policy holds the band back for now
            item = None
            owned = band.queues.get(queue.flow_id)
            if owned is not None and owned is queue:
                item = owned.peek_head()
            if item is None:
                logger.error(
                    "flow control: fairness policy %s picked no queued flow of band %d",
                    band.fairness.typed_name,
                    band.priority,
                )
                break
            now = self._clock()
            flow: _Flow = item.owner
            self._unqueue(item, now)
            waiter = item.waiter
            if waiter is not None and waiter.cancelled():
                # The client is gone and its task has not run yet: do not spend a slot.
                self._finalize(
                    item,
                    QueueOutcome.EVICTED_CONTEXT_CANCELLED,
                    RequestEvictedError(FlowControlReason.CONTEXT_CANCELLED),
                    now,
                )
                continue
            self._count_dispatch(flow)
            self._finalize(item, _DISPATCHED, None, now)
            dispatched += 1
        return dispatched

    def _uncontended(self, band: _Band) -> bool:
        """No other process holds requests waiting in ``band`` or a higher one (a new
        request may then skip the queue and its fairness policy)."""
        if self._pool is None:
            return True
        top = self._pool.flows().top_waiting
        return top is None or top < band.priority

    def _count_dispatch(self, flow: _Flow) -> None:
        flow.in_flight += 1
        self._in_flight += 1
        if self._pool is not None:
            if self._pool.visible_after() > 0:
                self._recent.append(self._clock())
            self._publish(flow)

    def _publish(self, flow: _Flow) -> None:
        """Publish ``flow``'s counts if they changed (see ``domain.flowcontrol.pool``)."""
        pool = self._pool
        if pool is None:
            return
        in_flight = flow.in_flight
        waiting = len(flow.queue)
        old = flow.shared
        if old.in_flight == in_flight and old.waiting == waiting:
            return
        new = FlowCounts(in_flight, waiting) if in_flight or waiting else _ZERO
        key = flow.pool_key
        if key is None:
            if self._published < MAX_PUBLISHED_FLOWS:
                key = flow_key(flow.flow_id)
                self._published += 1
            else:
                key = OVERFLOW_KEY
            flow.pool_key = key
        flow.shared = new
        band = flow.band
        if key == OVERFLOW_KEY:
            total = band.overflow
            band.overflow = FlowCounts(
                total.in_flight + new.in_flight - old.in_flight,
                total.waiting + new.waiting - old.waiting,
            )
            pool.publish_flow(band.priority, OVERFLOW_KEY, band.overflow)
        else:
            pool.publish_flow(band.priority, key, new)
        if new is _ZERO:
            if key != OVERFLOW_KEY:
                self._published -= 1
            flow.pool_key = None

    # -- timers ----------------------------------------------------------------------------

    def _arm_tick(self) -> None:
        """Arms the fallback tick while requests wait (earlier if the delay shrank)."""
        if not self._queued or not self._running:
            return
        when = self._clock() + self._tick_delay
        handle = self._tick_handle
        if handle is not None:
            if self._tick_at <= when:
                return
            handle.cancel()
        self._tick_at = when
        self._tick_handle = self._timers.call_at(when, self._on_tick)

    def _on_tick(self) -> None:
        self._tick_handle = None
        self._tick_at = _INF
        if self._queued and self._running:
            self._run_cycle(1, from_tick=True)
        else:
            self._tick_delay = self._interval

    def _on_notify(self) -> None:
        self._notify_handle = None
        if self._running:
            self._run_cycle(self._config.max_dispatch_per_cycle, from_tick=False)

    def _arm_ttl(self, when: float) -> None:
        if self._ttl_handle is not None:
            self._ttl_handle.cancel()
        self._ttl_at = when
        self._ttl_handle = self._timers.call_at(when, self._on_ttl)

    def _on_ttl(self) -> None:
        self._ttl_handle = None
        self._ttl_at = _INF
        now = self._clock()
        ttl = self._ttl
        while (item := ttl.peek()) is not None and item.expires_at <= now:
            self._unqueue(item, now)
            self._finalize(
                item,
                QueueOutcome.EVICTED_TTL,
                RequestEvictedError(FlowControlReason.TTL_EXPIRED),
                now,
            )
        if item is not None and self._running:
            self._arm_ttl(item.expires_at)

    def _arm_gc(self) -> None:
        if self._gc_handle is None and self._running:
            self._gc_handle = self._timers.call_at(self._clock() + self._gc_period, self._on_gc)

    def _on_gc(self) -> None:
        self._gc_handle = None
        self.collect_garbage()
        if self._flow_count or any(not band.configured for band in self._order):
            self._arm_gc()

    def collect_garbage(self) -> None:
        """Drops flows empty for ``flow_gc_timeout`` and on-demand bands empty (and
        flow-less) for ``band_gc_timeout``. Runs by itself; public for tests."""
        now = self._clock()
        flow_timeout = self._config.flow_gc_timeout
        band_timeout = self._config.band_gc_timeout
        for band in list(self._order):
            idle = [
                flow_id
                for flow_id, flow in band.flows.items()
                if not len(flow.queue)
                and not flow.in_flight
                and now - flow.idle_since >= flow_timeout
            ]
            for flow_id in idle:
                del band.flows[flow_id]
                band.shared_flows.pop(flow_key(flow_id), None)
            self._flow_count -= len(idle)
            if (
                not band.configured
                and not band.count
                and not band.flows
                and now - band.idle_since >= band_timeout
            ):
                self._remove_band(band)

    # -- bands -----------------------------------------------------------------------------

    def _resolve(self, name: str, kind: type[Any], what: str, path: str) -> Any:
        found = self._resolved.get(name)
        if found is None:
            found = self._plugins.get(name)
            if found is None:
                found = _default_policy(name)
            if found is None:
                raise ValueError(f'{path}: no plugin named "{name}" for the {what}')
            self._resolved[name] = found
        if not isinstance(found, kind):
            raise ValueError(f'{path}: plugin "{name}" is not a {what}')
        return found

    def _band_policies(self, config: BandConfig, path: str) -> tuple[Any, Any]:
        ordering = self._resolve(
            config.ordering_policy_ref,
            OrderingPolicy,
            "ordering policy",
            f"{path}.orderingPolicyRef",
        )
        fairness = self._resolve(
            config.fairness_policy_ref,
            FairnessPolicy,
            "fairness policy",
            f"{path}.fairnessPolicyRef",
        )
        return ordering, fairness

    def _add_band(
        self,
        priority: int,
        config: BandConfig,
        *,
        configured: bool,
        now: float,
        path: str = "defaultPriorityBand",
    ) -> _Band:
        ordering, fairness = self._band_policies(config, path)
        band = _Band(priority, config, ordering, fairness, configured=configured, now=now)
        self._bands[priority] = band
        self._order.append(band)
        self._reindex()
        if not configured:
            self._arm_gc()
        return band

    def _remove_band(self, band: _Band) -> None:
        del self._bands[band.priority]
        self._order.remove(band)
        self._reindex()

    def _reindex(self) -> None:
        self._order.sort(key=lambda b: -b.priority)
        for index, band in enumerate(self._order):
            band.index = index
        self._priorities = tuple(band.priority for band in self._order)
        self._bands_version += 1

    # -- metrics ---------------------------------------------------------------------------

    def _record_enqueue(
        self, request: FlowRequest, priority: str, outcome: QueueOutcome, start: float
    ) -> None:
        self._observer.histogram(
            FLOW_CONTROL_ENQUEUE_DURATION,
            {
                "fairness_id": self._fairness_label(request.flow_key.id),
                "priority": priority,
                "outcome": outcome.label,
            },
            self._clock() - start,
        )

    def _record_final(self, request: FlowRequest, outcome: QueueOutcome, seconds: float) -> None:
        priority = request.flow_key.priority
        band = self._bands.get(priority)
        self._observer.histogram(
            FLOW_CONTROL_QUEUE_DURATION,
            {
                "fairness_id": self._fairness_label(request.flow_key.id),
                "priority": band.label if band is not None else str(priority),
                "outcome": outcome.label,
                "inference_pool": request.inference_pool or self._pool_name,
                "model_name": request.model_name,
                "target_model_name": request.target_model_name,
            },
            seconds,
        )

    def _series_add(self, item: QueueItem, band: _Band) -> None:
        request = item.request
        fairness = self._fairness_label(request.flow_key.id)
        pool = request.inference_pool or self._pool_name
        key = (fairness, band.priority, pool, request.model_name, request.target_model_name)
        series = self._series.get(key)
        if series is None:
            labels = {
                "fairness_id": fairness,
                "priority": band.label,
                "inference_pool": pool,
                "model_name": request.model_name,
                "target_model_name": request.target_model_name,
            }
            series = self._series[key] = _Series(key, labels)
        series.count += 1
        series.bytes += item.byte_size
        item.series = series
        observer = self._observer
        observer.gauge(FLOW_CONTROL_QUEUE_SIZE, series.labels, series.count)
        observer.gauge(FLOW_CONTROL_QUEUE_BYTES, series.labels, series.bytes)

    def _series_remove(self, item: QueueItem) -> None:
        series: _Series = item.series
        item.series = None
        series.count -= 1
        series.bytes -= item.byte_size
        observer = self._observer
        observer.gauge(FLOW_CONTROL_QUEUE_SIZE, series.labels, series.count)
        observer.gauge(FLOW_CONTROL_QUEUE_BYTES, series.labels, series.bytes)
        if not series.count:
            del self._series[series.key]
