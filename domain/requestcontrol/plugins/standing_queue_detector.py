"""``standing-queue-detector``: saturation with no threshold to set, learned from the servers.

A model server runs a batch of requests at once (vLLM's ``max_num_seqs``, or fewer when its
KV cache is full) and queues the rest. A request sent while the server queues gains nothing
from being there rather than in the EPP, where priority, fairness and TTL still apply. This
detector learns from the scraped metrics how many requests each server runs at once, so the
EPP can hold the rest, without a per-deployment threshold:

- **What a server runs at once.** On each fresh scrape (a new ``update_time``) of an endpoint:
  when its waiting queue is not empty, what it runs is as much as it can; the learned batch
  is the largest running count of such scrapes within the last ``interval``. It rises at
  once on a scrape that shows more running than learned, queue or not; it falls only when
  the queue has been seen for half an interval or more (so a scrape taken while a finished
  request's slot was being refilled does not lower it). An endpoint that has
  never queued has no learned batch.
- **Capacity** (``CapacityDetector``): the sum over the candidates of their learned batch plus
  ``queuePerServer`` (1): each server keeps that many waiting, so its batch refills without
  waiting for the EPP and the detector sees whether the server could run more (it then
  runs it, and the batch learned grows). A candidate not learned yet counts as the mean of
  those learned; when none is learned the capacity is unknown (no limit), until the servers'
  first queue. Flow control gates on the requests it has in flight over the pool against it.
- **Saturation**: the larger of the in-flight requests on the candidates (the
  ``InFlightLoad`` attribute, as ``concurrency-detector``) over that capacity, and the share
  of the candidates whose queue has stood above ``queuePerServer`` for a whole ``interval``
  (CoDel's test for a standing queue, on the server's queue: a burst that drains within an
  interval is not saturation, load from outside this EPP that keeps the servers' queues long
  is).
- **Stale metrics** (older than ``metricsStalenessThreshold``): an endpoint keeps what it
  learned and does not count as a standing queue; nothing it reports meanwhile is learned.
  A server that stops answering thus keeps its share of the pool's capacity, which its
  unanswered requests hold until they end.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from domain.datalayer.attributes import IN_FLIGHT_LOAD, InFlightLoad
from domain.datastore.endpoint import EndpointMetrics
from domain.plugins.base import Duration, Plugin, PluginRegistry, TypedName
from domain.plugins.handle import Handle
from domain.plugins.hooks import ConsumerPlugin
from domain.scheduling.types import Candidate

__all__ = [
    "TYPE",
    "StandingQueueDetector",
    "StandingQueueDetectorParameters",
    "register",
]

TYPE = "standing-queue-detector"

_INF = float("inf")
#: Endpoints not seen for this many intervals are forgotten (a pool's churn is bounded).
_FORGET_INTERVALS = 120.0
_DEFAULT_INTERVAL = Duration(0.5)
_DEFAULT_STALENESS = Duration(0.2)  # as utilization-detector's


@dataclass(frozen=True, slots=True, kw_only=True)
class StandingQueueDetectorParameters:
    """``interval`` (a duration > 0), ``queuePerServer`` (>= 0) and
    ``metricsStalenessThreshold`` (a duration > 0)."""

    interval: Duration = _DEFAULT_INTERVAL
    queue_per_server: int = 1
    metrics_staleness_threshold: Duration = _DEFAULT_STALENESS

    def __post_init__(self) -> None:
        if not self.interval > 0:
            raise ValueError(f"interval: must be > 0, got {self.interval}s")
        if not self.queue_per_server >= 0:
            raise ValueError(f"queuePerServer: must be >= 0, got {self.queue_per_server}")
        if not self.metrics_staleness_threshold > 0:
            raise ValueError(
                f"metricsStalenessThreshold: must be > 0, got {self.metrics_staleness_threshold}s"
            )


class _Server:
    """What one endpoint's scrapes taught: its batch and whether its queue stands."""

    __slots__ = ("batch", "queued", "queued_since", "seen", "update_time")

    def __init__(self) -> None:
        self.update_time = -_INF
        self.seen = -_INF
        self.batch: int | None = None
        # (scrape time, running) of the scrapes within the interval that showed a queue
        self.queued: deque[tuple[float, int]] = deque()
        self.queued_since: float | None = None


class StandingQueueDetector(ConsumerPlugin):
    """SaturationDetector and CapacityDetector over what the servers run and queue."""

    def __init__(
        self,
        typed_name: TypedName,
        parameters: StandingQueueDetectorParameters,
        clock: Callable[[], float],
    ) -> None:
        self._typed_name = typed_name
        self._clock = clock
        self._interval = float(parameters.interval)
        self._allowance = parameters.queue_per_server
        self._staleness = float(parameters.metrics_staleness_threshold)
        self._servers: dict[str, _Server] = {}
        self._next_forget = -_INF

    @property
    def typed_name(self) -> TypedName:
        return self._typed_name

    def consumes(self) -> Sequence[str]:
        return (IN_FLIGHT_LOAD,)

    def learned_batch(self, name: str) -> int | None:
        """The batch learned for endpoint ``name`` (None: never queued, or unknown)."""
        server = self._servers.get(name)
        return server.batch if server is not None else None

    # learning
    def _observe(self, name: str, metrics: EndpointMetrics | None, now: float) -> _Server | None:
        """The endpoint's state after learning from ``metrics`` if they are fresh and new;
        None when the endpoint's metrics are missing or stale."""
        server = self._servers.get(name)
        if server is None:
            server = self._servers[name] = _Server()
        server.seen = now
        if metrics is None or now - metrics.update_time > self._staleness:
            server.queued_since = None
            return None
        at = metrics.update_time
        if at <= server.update_time:
            return server
        server.update_time = at
        running = metrics.running_requests_size
        queued = server.queued
        horizon = at - self._interval
        while queued and queued[0][0] < horizon:
            queued.popleft()
        batch = server.batch
        if metrics.waiting_queue_size > 0:
            queued.append((at, running))
            most = max(r for _, r in queued)
            # lower only on a queue seen over half an interval or more, never on one scrape
            if batch is None or most >= batch or at - queued[0][0] >= self._interval / 2:
                server.batch = most
        elif batch is not None and running > batch:
            server.batch = running
        if metrics.waiting_queue_size > self._allowance:
            if server.queued_since is None:
                server.queued_since = at
        else:
            server.queued_since = None
        return server

    def _forget(self, now: float) -> None:
        if now < self._next_forget:
            return
        horizon = self._interval * _FORGET_INTERVALS
        self._next_forget = now + horizon
        for name in [n for n, s in self._servers.items() if now - s.seen > horizon]:
            del self._servers[name]

    def _capacity(self, names: Sequence[str]) -> float:
        allowance = self._allowance
        learned = [
            batch + allowance for name in names if (batch := self._servers[name].batch) is not None
        ]
        if not learned:
            return _INF
        unknown = len(names) - len(learned)
        return sum(learned) + unknown * (sum(learned) / len(learned))

    # SaturationDetector
    def saturation(self, candidates: Sequence[Candidate]) -> float:
        if not candidates:
            return 1.0
        now = self._clock()
        self._forget(now)
        names = [candidate.name for candidate in candidates]
        servers = [
            self._observe(name, candidate.metrics, now)
            for name, candidate in zip(names, candidates, strict=True)
        ]
        interval = self._interval
        standing = sum(
            1
            for server in servers
            if server is not None
            and server.queued_since is not None
            and server.update_time - server.queued_since >= interval
        )
        value = standing / len(candidates)
        capacity = self._capacity(names)
        if capacity < _INF:
            in_flight = 0
            for candidate in candidates:
                load = candidate.attributes.get(IN_FLIGHT_LOAD)
                if isinstance(load, InFlightLoad):
                    in_flight += load.requests
            value = max(value, in_flight / capacity)
        return value

    # CapacityDetector
    def capacity(self, candidates: Sequence[Candidate]) -> float:
        names = [candidate.name for candidate in candidates]
        now = self._clock()
        for name, candidate in zip(names, candidates, strict=True):
            self._observe(name, candidate.metrics, now)
        return self._capacity(names)


def _factory(name: str, parameters: Any, handle: Handle) -> Plugin:
    return StandingQueueDetector(TypedName(TYPE, name), parameters, handle.clock)


def register(registry: PluginRegistry) -> None:
    registry.register(
        TYPE,
        _factory,
        parameters=StandingQueueDetectorParameters,
        description="saturation from the batch each server runs, learned from its queue",
    )
