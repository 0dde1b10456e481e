"""Test doubles for flow control: a manual clock and timers, a recording observer, and a
harness that drives a ``FlowController`` deterministically."""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections import deque
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field

from domain.flowcontrol import (
    FlowControlConfig,
    FlowController,
    FlowKey,
    FlowRequest,
    FlowResult,
)
from ports.metric_catalogue import CounterMetric, GaugeMetric, HistogramMetric, Metric
from ports.observer import NoopSpan, Span

START = 1000.0


class FakeClock:
    """Monotonic seconds that move only when told."""

    def __init__(self, now: float = START) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class FakeHandle:
    def __init__(self, callback: Callable[[], None]) -> None:
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class FakeTimers:
    """``Timers`` on a ``FakeClock``: callbacks run only in ``run_soon`` / ``advance``."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self._timers: list[tuple[float, int, FakeHandle]] = []
        self._soon: deque[FakeHandle] = deque()
        self._seq = itertools.count()

    def call_at(self, when: float, callback: Callable[[], None]) -> FakeHandle:
        handle = FakeHandle(callback)
        heapq.heappush(self._timers, (when, next(self._seq), handle))
        return handle

    def call_soon(self, callback: Callable[[], None]) -> FakeHandle:
        handle = FakeHandle(callback)
        self._soon.append(handle)
        return handle

    def pending(self) -> int:
        """Armed, not cancelled timers (``call_at``)."""
        return sum(1 for _, _, handle in self._timers if not handle.cancelled)

    def next_at(self) -> float | None:
        live = [when for when, _, handle in self._timers if not handle.cancelled]
        return min(live) if live else None

    def run_soon(self) -> None:
        while self._soon:
            handle = self._soon.popleft()
            if not handle.cancelled:
                handle.callback()

    def advance(self, seconds: float) -> None:
        """Moves the clock by ``seconds``, running each due timer at its own time."""
        target = self.clock.now + seconds
        self.run_soon()
        while self._timers and self._timers[0][0] <= target:
            when, _, handle = heapq.heappop(self._timers)
            if handle.cancelled:
                continue
            self.clock.now = max(self.clock.now, when)
            handle.callback()
            self.run_soon()
        self.clock.now = target


@dataclass
class Record:
    kind: str
    metric: Metric
    labels: dict[str, str]
    value: float


@dataclass
class RecordingObserver:
    """Keeps every metric call; ``hook`` (if set) sees each record as it arrives. A report
    whose label names are not its catalogue entry's fails the test at once."""

    records: list[Record] = field(default_factory=list)
    hook: Callable[[Record], None] | None = None

    def _add(self, kind: str, metric: Metric, labels: Mapping[str, str], value: float) -> None:
        if sorted(labels) != sorted(metric.labels):
            raise AssertionError(
                f"{metric.name} reported with labels {sorted(labels)}, "
                f"declared {sorted(metric.labels)}"
            )
        record = Record(kind, metric, dict(labels), value)
        self.records.append(record)
        if self.hook is not None:
            self.hook(record)

    def counter(self, metric: CounterMetric, labels: Mapping[str, str], value: float = 1.0) -> None:
        self._add("counter", metric, labels, value)

    def histogram(self, metric: HistogramMetric, labels: Mapping[str, str], value: float) -> None:
        self._add("histogram", metric, labels, value)

    def gauge(self, metric: GaugeMetric, labels: Mapping[str, str], value: float) -> None:
        self._add("gauge", metric, labels, value)

    def start_span(
        self,
        name: str,
        *,
        parent: Span | None = None,
        carrier: Mapping[str, str] | None = None,
        attributes: Mapping[str, str | int | float | bool] | None = None,
    ) -> Span:
        return NoopSpan()

    def named(self, metric: Metric) -> list[Record]:
        return [r for r in self.records if r.metric is metric]

    def last_gauges(self, metric: GaugeMetric) -> dict[tuple[tuple[str, str], ...], float]:
        """The last value of each label set of gauge ``metric``."""
        values: MutableMapping[tuple[tuple[str, str], ...], float] = {}
        for record in self.named(metric):
            values[tuple(sorted(record.labels.items()))] = record.value
        return dict(values)


async def settle(rounds: int = 4) -> None:
    """Lets ready tasks run (a few loop iterations; no time passes)."""
    for _ in range(rounds):
        await asyncio.sleep(0)


class Harness:
    """A started controller on a fake clock, with a settable saturation."""

    def __init__(
        self,
        config: FlowControlConfig | None = None,
        *,
        saturation: float = 0.0,
        plugins: Mapping[str, object] | None = None,
        pool_name: str = "pool",
        fairness_label_limit: int = 1000,
    ) -> None:
        self.clock = FakeClock()
        self.timers = FakeTimers(self.clock)
        self.saturation = saturation
        self.saturation_reads = 0
        self.observer = RecordingObserver()
        self.config = config or FlowControlConfig()
        self.controller = FlowController(
            self.config,
            saturation=self._read,
            plugins=plugins,
            observer=self.observer,
            clock=self.clock,
            timers=self.timers,
            pool_name=pool_name,
            fairness_label_limit=fairness_label_limit,
        )
        self.controller.start()
        self._ids = itertools.count()

    def _read(self) -> float:
        self.saturation_reads += 1
        return self.saturation

    def request(
        self,
        *,
        priority: int = 0,
        flow: str = "flow",
        size: int = 1,
        ttl: float = 0.0,
        slo_ttft_ms: float | None = None,
        received_at: float | None = None,
        request_id: str | None = None,
        model: str = "m",
    ) -> FlowRequest:
        return FlowRequest(
            request_id=request_id or f"r{next(self._ids)}",
            flow_key=FlowKey(flow, priority),
            byte_size=size,
            received_at=self.clock.now if received_at is None else received_at,
            ttl=ttl,
            slo_ttft_ms=slo_ttft_ms,
            model_name=model,
            target_model_name=model,
        )

    async def submit(self, request: FlowRequest) -> asyncio.Task[FlowResult]:
        """Starts ``enqueue_and_wait`` in a task and lets it reach its first wait."""
        task = asyncio.create_task(self.controller.enqueue_and_wait(request))
        await settle()
        return task

    async def submit_many(self, requests: list[FlowRequest]) -> list[asyncio.Task[FlowResult]]:
        return [await self.submit(r) for r in requests]

    async def notify(self) -> None:
        self.controller.notify()
        self.timers.run_soon()
        await settle()

    async def advance(self, seconds: float) -> None:
        self.timers.advance(seconds)
        await settle()

    async def tick(self) -> None:
        """One fallback dispatch tick."""
        await self.advance(self.config.dispatch_interval)
