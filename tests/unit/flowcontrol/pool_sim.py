"""A discrete-event simulation of flow control over several processes, for the domain's
fairness tests: controllers on a ``LoadBoard`` whose copies of the others' counts are
refreshed every ``staleness`` seconds (as the Redis adapter's background round trips do),
servers with a fixed number of slots, and closed-loop or open-loop tenants. Time is a
``FakeClock``: the results do not depend on the machine."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from domain.flowcontrol import (
    BandConfig,
    FlowControlConfig,
    FlowController,
    FlowKey,
    FlowRequest,
    QueueOutcome,
)
from domain.flowcontrol.plugins.max_min_fairness import MaxMinFairnessPolicy
from domain.flowcontrol.plugins.round_robin_fairness import RoundRobinFairnessPolicy
from domain.plugins.base import EmptyParameters, TypedName
from domain.sharedstate import BoardMember, LoadBoard
from ports.shared_state import NO_POOL_FLOWS, FlowCounts, PoolFlows
from tests.unit.flowcontrol.harness import FakeClock, FakeTimers, settle

MAX_MIN = "max-min-fairness-policy"
ROUND_ROBIN = "round-robin-fairness-policy"


class StaleView:
    """A ``SharedAdmission`` whose copy of the others' counts changes only at ``sync``
    (writes reach the board at once; reads are as old as the last sync)."""

    def __init__(self, member: BoardMember, period: float) -> None:
        self._member = member
        self._period = period  # between two syncs
        self._copy: PoolFlows = NO_POOL_FLOWS
        self._watchers: list[Callable[[], None]] = []

    def publish_flow(self, priority: int, flow: str, counts: FlowCounts) -> None:
        self._member.publish_flow(priority, flow, counts)

    def flows(self) -> PoolFlows:
        return self._copy

    def visible_after(self) -> float:
        return self._period

    def watch(self, callback: Callable[[], None]) -> None:
        self._watchers.append(callback)

    def sync(self) -> None:
        current = self._member.flows()
        if current is not self._copy:
            self._copy = current
            for callback in self._watchers:
                callback()


@dataclass
class Tenant:
    """``users`` closed-loop users, or Poisson arrivals at ``rate`` per second."""

    name: str
    users: int = 0
    rate: float = 0.0


@dataclass
class Outcome:
    """What one run saw over its measured window."""

    seconds: float
    completed: dict[str, int] = field(default_factory=dict)
    sent: dict[str, int] = field(default_factory=dict)
    waits: dict[str, list[float]] = field(default_factory=dict)
    over_limit: float = 0.0  # share of dispatches that found the slots full
    peak: int = 0  # most requests running at once, warm-up included

    def rate(self, tenant: str) -> float:
        return self.completed.get(tenant, 0) / self.seconds

    def share(self, tenant: str) -> float:
        total = sum(self.completed.values())
        return self.completed.get(tenant, 0) / total if total else 0.0


class PoolSim:
    """``processes`` flow controllers on one fake clock, each one's saturation the pool's
    requests in flight as it knows them (its own plus its copy of the others') over
    ``slots``, as the app's capacity-based saturation. ``shared=False``: nothing shared,
    each controller sees only its own. Requests go to a process at random and hold a slot
    for a time drawn from ``service``; releases go to the process that dispatched."""

    def __init__(
        self,
        *,
        processes: int,
        staleness: float,
        fairness: str = MAX_MIN,
        shared: bool = True,
        slots: int = 24,
        service: tuple[float, float] = (0.4, 1.2),
        seed: int = 1,
        receivers: int | None = None,
    ) -> None:
        #: the requests go to the first ``receivers`` processes (all by default)
        self.receivers = receivers or processes
        self.clock = FakeClock()
        self.timers = FakeTimers(self.clock)
        self.board = LoadBoard(clock=self.clock, admission_lease=3600.0, lease=3600.0)
        self.slots = slots
        self.service = service
        self.staleness = staleness
        self.rng = random.Random(seed)
        self.running = 0
        self.dispatches = 0
        self.crowded = 0
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._ids = itertools.count()
        self.views: list[StaleView] = []
        self.controllers: list[FlowController] = []
        plugins = {
            MAX_MIN: MaxMinFairnessPolicy(TypedName(MAX_MIN, MAX_MIN), EmptyParameters()),
            ROUND_ROBIN: RoundRobinFairnessPolicy(
                TypedName(ROUND_ROBIN, ROUND_ROBIN), EmptyParameters()
            ),
        }
        for index in range(processes):
            pool: StaleView | BoardMember | None = None
            if shared and processes > 1:
                member = self.board.member(f"p{index}")
                member.renew()  # live, as a started process
                if staleness > 0:
                    view = StaleView(member, staleness)
                    self.views.append(view)
                    pool = view
                else:
                    pool = member
            controller = FlowController(
                FlowControlConfig(default_priority_band=BandConfig(fairness_policy_ref=fairness)),
                saturation=self._saturation(index),
                plugins=plugins,
                clock=self.clock,
                timers=self.timers,
                pool=pool,
            )
            controller.start()
            self.controllers.append(controller)
        # the processes have been up a while: each is live and its copy taken
        for view in self.views:
            view.sync()
        for index, view in enumerate(self.views):
            # each process's round trips on their own phase
            self._at(staleness * (index + 1) / (len(self.views) + 1), self._syncer(view))
        self._seed = seed
        self._window: tuple[float, float] = (0.0, 0.0)
        self.outcome = Outcome(seconds=1.0)
        self._tasks: set[asyncio.Task[None]] = set()

    def _saturation(self, index: int) -> Callable[[], float]:
        def saturation() -> float:
            return self.controllers[index].pool_in_flight() / self.slots

        return saturation

    def _syncer(self, view: StaleView) -> Callable[[], None]:
        def sync() -> None:
            view.sync()
            self._at(self.clock.now + self.staleness, sync)

        return sync

    def _at(self, when: float, callback: Callable[[], None]) -> None:
        heapq.heappush(self._events, (when, next(self._seq), callback))

    def _measured(self, when: float) -> bool:
        return self._window[0] <= when < self._window[1]

    def _send(self, tenant: Tenant) -> None:
        index = self.rng.randrange(self.receivers)
        task = asyncio.ensure_future(self._request(tenant, index))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _request(self, tenant: Tenant, index: int) -> None:
        controller = self.controllers[index]
        sent = self.clock.now
        if self._measured(sent):
            self.outcome.sent[tenant.name] = self.outcome.sent.get(tenant.name, 0) + 1
        key = FlowKey(tenant.name, 0)
        result = await controller.enqueue_and_wait(
            FlowRequest(request_id=f"r{next(self._ids)}", flow_key=key, received_at=sent)
        )
        assert result.outcome is QueueOutcome.DISPATCHED, result
        now = self.clock.now
        if self._measured(now):
            self.outcome.waits.setdefault(tenant.name, []).append(now - sent)
        self.dispatches += 1
        if self.running >= self.slots:
            self.crowded += 1
        self.running += 1
        self.outcome.peak = max(self.outcome.peak, self.running)

        def complete() -> None:
            self.running -= 1
            controller.release(key)
            if self._measured(self.clock.now):
                done = self.outcome.completed
                done[tenant.name] = done.get(tenant.name, 0) + 1
            if tenant.users:
                self._send(tenant)

        self._at(now + self.rng.uniform(*self.service), complete)

    def _arrivals(self, tenant: Tenant, until: float) -> None:
        # the tenant's own generator: the same arrivals whoever else runs
        rng = random.Random(f"{self._seed} {tenant.name}")

        def arrive() -> None:
            self._send(tenant)
            nxt = self.clock.now + rng.expovariate(tenant.rate)
            if nxt < until:
                self._at(nxt, arrive)

        self._at(self.clock.now + rng.expovariate(tenant.rate), arrive)

    async def run(self, tenants: list[Tenant], *, warmup: float, seconds: float) -> Outcome:
        """Runs ``tenants`` for ``warmup`` then ``seconds`` measured seconds, then drops
        what is left (one run per simulation)."""
        start = self.clock.now + warmup
        end = start + seconds
        self._window = (start, end)
        self.outcome = Outcome(seconds=seconds)
        self.dispatches = self.crowded = 0
        for tenant in tenants:
            if tenant.users:
                for _ in range(tenant.users):
                    self._send(tenant)
            else:
                self._arrivals(tenant, end)
        await self._settle()
        while self._events and self._events[0][0] < end:
            event_at = self._events[0][0]
            timer_at = self.timers.next_at()
            if timer_at is not None and timer_at <= event_at:
                self.timers.advance(max(0.0, timer_at - self.clock.now))
            else:
                _, _, callback = heapq.heappop(self._events)
                self.timers.advance(max(0.0, event_at - self.clock.now))
                callback()
            await self._settle()
        self.outcome.over_limit = self.crowded / self.dispatches if self.dispatches else 0.0
        await self.close()
        return self.outcome

    async def close(self) -> None:
        """Drops what is still queued or running (the clients go away)."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._events.clear()

    async def _settle(self) -> None:
        for _ in range(3):
            self.timers.run_soon()
            await settle()
