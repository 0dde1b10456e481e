"""The collectors: one task per endpoint polls every data source in turn.

A collector polls its endpoint's sources one after another, each poll bounded by
``poll_timeout``, and hands each result to that source's extractors. Each source is polled
every ``interval`` seconds, or every ``SourceBinding.interval`` when the binding has its
own. A source whose poll keeps failing is retried with exponential backoff and jitter (the
time from one attempt's start to the next doubles from the source's interval after each
failure, up to ``max_backoff``, default 1 s, or twice the source's interval if that is
longer: each delay is drawn between half and all of that), and is polled at its interval
again once a poll succeeds; an extractor's error does not slow the polls down, except
``OversizedDataError`` (data too large to read), which counts as a failed poll. An
endpoint's error state is logged when it changes (first failure, a different failure,
recovery), never on every poll, and every failed poll of a source is counted in
``SCRAPE_ERRORS{endpoint}``. Endpoint add/delete events start and stop collectors and reach
the endpoint extractors; once a deleted endpoint's collector has stopped, every source that
holds per-endpoint state (``SourceWithEndpointState``) is told to ``forget`` it, so nothing
(a keep-alive connection) stays behind for it.

Notification sources (``NotificationSource``) each run as one task from ``start`` to
``stop``; every change they report reaches their extractors' ``extract_notification`` in
order. An extractor's failures are logged when its error state changes; a source that ends
with an error is logged once (it is not restarted: sources retry on their own).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from domain.datalayer.interfaces import (
    EndpointExtractor,
    Extractor,
    IncompleteDataError,
    NotificationExtractor,
    OversizedDataError,
)
from domain.datastore.endpoint import Endpoint
from domain.datastore.store import Datastore
from ports.datalayer import (
    NotificationEvent,
    NotificationSource,
    PollingDataSource,
    SourceWithEndpointState,
)
from ports.endpoints import EndpointEvent, EndpointEventKind
from ports.metric_catalogue import SCRAPE_ERRORS
from ports.observer import NoopObserver, Observer

__all__ = ["Collectors", "NotificationBinding", "SourceBinding"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SourceBinding:
    """A polling source and the extractors fed with its results, in order. ``interval``:
    seconds between two polls of the source (``None`` or 0: the collectors' interval)."""

    source: PollingDataSource
    extractors: tuple[Extractor, ...]
    interval: float | None = None


@dataclass(slots=True)
class _Backoff:
    """One source's retry state in one collector."""

    failures: int = 0
    retry_at: float = 0.0
    error: str | None = None
    incomplete: bool = False  # the error is what an extractor could not read
    due: float = 0.0  # when the source is next polled (its interval after the last poll)


@dataclass(frozen=True, slots=True)
class NotificationBinding:
    """A notification source and the extractors fed with its events, in order."""

    source: NotificationSource
    extractors: tuple[NotificationExtractor, ...]


class Collectors:
    """Runs one collector task per endpoint of the datastore."""

    def __init__(
        self,
        *,
        datastore: Datastore,
        bindings: Sequence[SourceBinding],
        interval: float,
        poll_timeout: float = 1.0,
        endpoint_extractors: Sequence[EndpointExtractor] = (),
        notifications: Sequence[NotificationBinding] = (),
        clock: Callable[[], float] = time.monotonic,
        observer: Observer | None = None,
        on_update: Callable[[], None] | None = None,
        max_backoff: float = 1.0,
        rng: random.Random | None = None,
    ) -> None:
        self._datastore = datastore
        self._max_backoff = max(max_backoff, interval)
        self._rng = rng if rng is not None else random.Random()
        self._on_update = on_update
        self._observer: Observer = observer if observer is not None else NoopObserver()
        self._bindings = tuple(bindings)
        self._interval = interval
        self._periods = tuple(b.interval or interval for b in self._bindings)
        for binding, period in zip(self._bindings, self._periods, strict=True):
            if period != interval:
                logger.info("data source %s: polled every %gs", binding.source.typed_name, period)
        self._poll_timeout = poll_timeout
        self._endpoint_extractors = tuple(endpoint_extractors)
        self._notifications = tuple(notifications)
        self._notification_tasks: list[asyncio.Task[None]] = []
        self._clock = clock
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._retiring: set[asyncio.Task[None]] = set()
        self._errors: dict[str, str] = {}
        self._incomplete: set[str] = set()
        self._started = False
        datastore.subscribe(self._on_event)

    def start(self) -> None:
        """Start collectors for the endpoints already known; later ones start on their own."""
        self._started = True
        loop = asyncio.get_running_loop()
        for binding in self._notifications:
            self._notification_tasks.append(
                loop.create_task(
                    self._notify(binding), name=f"notifications {binding.source.typed_name}"
                )
            )
        for endpoint in self._datastore.endpoints():
            self._ensure(endpoint)

    async def stop(self) -> None:
        self._started = False
        tasks = [*self._tasks.values(), *self._notification_tasks, *self._retiring]
        self._tasks.clear()
        self._notification_tasks.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for binding in self._bindings:
            await binding.source.close()

    @property
    def running(self) -> int:
        return len(self._tasks)

    def error_of(self, endpoint_name: str) -> str | None:
        """The endpoint's current collection error, if its last poll failed."""
        return self._errors.get(endpoint_name)

    def _on_event(self, event: EndpointEvent, endpoint: Endpoint) -> None:
        for extractor in self._endpoint_extractors:
            try:
                extractor.extract_endpoint(event, endpoint)
            except Exception:
                logger.exception("endpoint extractor %s failed", extractor.typed_name)
        if event.kind is EndpointEventKind.DELETE:
            task = self._tasks.pop(endpoint.name, None)
            if task is not None:
                task.cancel()
                retire = asyncio.get_running_loop().create_task(
                    self._retire(endpoint, task), name=f"retire {endpoint.name}"
                )
                self._retiring.add(retire)
                retire.add_done_callback(self._retiring.discard)
            self._errors.pop(endpoint.name, None)
            self._incomplete.discard(endpoint.name)
        elif self._started:
            self._ensure(endpoint)

    async def _retire(self, endpoint: Endpoint, task: asyncio.Task[None]) -> None:
        """Waits for the deleted endpoint's collector to end, then has the sources forget it
        (unless it was added again meanwhile)."""
        with contextlib.suppress(asyncio.CancelledError):
            await task
        if endpoint.name in self._tasks:
            return
        for binding in self._bindings:
            source = binding.source
            if isinstance(source, SourceWithEndpointState):
                try:
                    source.forget(endpoint.info)
                except Exception:
                    logger.exception("data source %s failed to forget", source.typed_name)

    async def _notify(self, binding: NotificationBinding) -> None:
        errors: dict[str, str] = {}

        def deliver(event: NotificationEvent) -> None:
            for extractor in binding.extractors:
                name = str(extractor.typed_name)
                error: str | None = None
                try:
                    extractor.extract_notification(event)
                except ValueError as exc:
                    error = str(exc) or "ValueError"
                except Exception as exc:  # a plugin bug must not stop the source
                    error = f"unexpected {type(exc).__name__}: {exc}"
                if error == errors.get(name):
                    continue
                if error is None:
                    errors.pop(name, None)
                    logger.info("notification extractor %s recovered", name)
                else:
                    errors[name] = error
                    logger.warning(
                        "notification extractor %s failing on %s: %s", name, event.gvk, error
                    )

        try:
            await binding.source.run(deliver)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("notification source %s stopped", binding.source.typed_name)

    def _ensure(self, endpoint: Endpoint) -> None:
        if not self._bindings or endpoint.name in self._tasks:
            return
        self._tasks[endpoint.name] = asyncio.get_running_loop().create_task(
            self._collect(endpoint), name=f"collector {endpoint.name}"
        )

    async def _collect(self, endpoint: Endpoint) -> None:
        states = [_Backoff() for _ in self._bindings]
        start = self._clock()
        for state in states:
            state.due = start
        while True:
            await self._poll_once(endpoint, states)
            # each source's next poll: its due time, or its retry time while it fails
            wake = min(max(s.due, s.retry_at) if s.failures else s.due for s in states)
            await asyncio.sleep(max(0.0, wake - self._clock()))

    def backoff_delay(self, failures: int, interval: float | None = None) -> float:
        """The wait before the next poll of a source that failed ``failures`` times in a
        row: between half and all of ``min(max_backoff, interval * 2**failures)``, where
        ``interval`` is the source's (default: the collectors'); a source polled less often
        than ``max_backoff / 2`` is retried at most twice its interval apart."""
        base = self._interval if interval is None else interval
        ceiling = min(max(self._max_backoff, 2.0 * base), base * 2.0 ** min(failures, 32))
        return ceiling * (0.5 + 0.5 * self._rng.random())

    async def _poll_once(self, endpoint: Endpoint, states: Sequence[_Backoff]) -> None:
        for binding, state, period in zip(self._bindings, states, self._periods, strict=True):
            now = self._clock()
            if now < state.due:
                continue  # not its turn (a source with a longer interval)
            if state.failures and now < state.retry_at:
                continue  # backing off: its last error stands
            state.due += period
            error: str | None = None
            incomplete = False
            polled = False
            started = self._clock()
            try:
                async with asyncio.timeout(self._poll_timeout):
                    data = await binding.source.poll(endpoint.info)
                polled = True
                now = self._clock()
                for extractor in binding.extractors:
                    extractor.extract(data, endpoint, now)
                if self._on_update is not None:
                    self._on_update()
            except TimeoutError:
                error = f"{binding.source.typed_name}: timed out after {self._poll_timeout}s"
            except IncompleteDataError as exc:
                if self._on_update is not None:
                    self._on_update()
                error = f"{binding.source.typed_name}: {exc}"
                incomplete = True
            except OversizedDataError as exc:
                error = f"{binding.source.typed_name}: {exc}"
                polled = False  # retried with backoff: each attempt costs as much again
            except (OSError, ValueError) as exc:
                error = f"{binding.source.typed_name}: {exc or type(exc).__name__}"
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a plugin bug must not kill the collector
                error = f"{binding.source.typed_name}: unexpected {type(exc).__name__}: {exc}"
            state.error = error
            state.incomplete = incomplete
            if polled:
                state.failures = 0
            else:
                state.failures += 1
                state.retry_at = started + self.backoff_delay(state.failures, period)
            finished = self._clock()
            if state.due < finished:  # fell behind: skip missed polls instead of bursting
                state.due = finished
            if error is not None and not incomplete:
                self._observer.counter(SCRAPE_ERRORS, {"endpoint": endpoint.name})
        failing = next((s for s in states if s.error is not None), None)
        if failing is None:
            self._record(endpoint.name, None, incomplete=False)
        else:
            self._record(endpoint.name, failing.error, incomplete=failing.incomplete)

    def _record(self, name: str, failure: str | None, *, incomplete: bool) -> None:
        previous = self._errors.get(name)
        if failure == previous:
            return
        was_incomplete = name in self._incomplete
        if failure is None:
            self._errors.pop(name, None)
            self._incomplete.discard(name)
            if was_incomplete:
                logger.info("endpoint %s: metrics complete again", name)
            else:
                logger.info("endpoint %s: metrics collection recovered", name)
            return
        self._errors[name] = failure
        if incomplete:
            self._incomplete.add(name)
            logger.warning(
                "endpoint %s: metrics incomplete (what was found is applied): %s", name, failure
            )
        else:
            self._incomplete.discard(name)
            logger.warning("endpoint %s: metrics collection failing: %s", name, failure)
