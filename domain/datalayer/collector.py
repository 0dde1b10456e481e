"""The collectors: one task per endpoint polls every data source in turn.

Each tick (``interval``) a collector polls its endpoint's sources one after another, each
poll bounded by ``poll_timeout``, and hands each result to that source's extractors. An
endpoint's error state is logged when it changes (first failure, a different failure,
recovery), never on every poll, and every failed poll of a source is counted in
``SCRAPE_ERRORS{endpoint}``. Endpoint add/delete events start and stop collectors and reach
the endpoint extractors.

Notification sources (``NotificationSource``) each run as one task from ``start`` to
``stop``; every change they report reaches their extractors' ``extract_notification`` in
order. An extractor's failures are logged when its error state changes; a source that ends
with an error is logged once (it is not restarted: sources retry on their own).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from domain.datalayer.interfaces import EndpointExtractor, Extractor, NotificationExtractor
from domain.datastore.endpoint import Endpoint
from domain.datastore.store import Datastore
from ports.datalayer import NotificationEvent, NotificationSource, PollingDataSource
from ports.endpoints import EndpointEvent, EndpointEventKind
from ports.metric_catalogue import SCRAPE_ERRORS
from ports.observer import NoopObserver, Observer

__all__ = ["Collectors", "NotificationBinding", "SourceBinding"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SourceBinding:
    """A polling source and the extractors fed with its results, in order."""

    source: PollingDataSource
    extractors: tuple[Extractor, ...]


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
    ) -> None:
        self._datastore = datastore
        self._on_update = on_update
        self._observer: Observer = observer if observer is not None else NoopObserver()
        self._bindings = tuple(bindings)
        self._interval = interval
        self._poll_timeout = poll_timeout
        self._endpoint_extractors = tuple(endpoint_extractors)
        self._notifications = tuple(notifications)
        self._notification_tasks: list[asyncio.Task[None]] = []
        self._clock = clock
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._errors: dict[str, str] = {}
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
        tasks = [*self._tasks.values(), *self._notification_tasks]
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
            self._errors.pop(endpoint.name, None)
        elif self._started:
            self._ensure(endpoint)

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
        next_tick = self._clock()
        while True:
            await self._poll_once(endpoint)
            next_tick += self._interval
            delay = next_tick - self._clock()
            if delay < 0:  # fell behind: skip missed ticks instead of bursting
                next_tick = self._clock()
                delay = 0.0
            await asyncio.sleep(delay)

    async def _poll_once(self, endpoint: Endpoint) -> None:
        failure: str | None = None
        for binding in self._bindings:
            error: str | None = None
            try:
                async with asyncio.timeout(self._poll_timeout):
                    data = await binding.source.poll(endpoint.info)
                now = self._clock()
                for extractor in binding.extractors:
                    extractor.extract(data, endpoint, now)
                if self._on_update is not None:
                    self._on_update()
            except TimeoutError:
                error = f"{binding.source.typed_name}: timed out after {self._poll_timeout}s"
            except (OSError, ValueError) as exc:
                error = f"{binding.source.typed_name}: {exc or type(exc).__name__}"
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a plugin bug must not kill the collector
                error = f"{binding.source.typed_name}: unexpected {type(exc).__name__}: {exc}"
            if error is not None:
                failure = error
                self._observer.counter(SCRAPE_ERRORS, {"endpoint": endpoint.name})
        self._record(endpoint.name, failure)

    def _record(self, name: str, failure: str | None) -> None:
        previous = self._errors.get(name)
        if failure == previous:
            return
        if failure is None:
            self._errors.pop(name, None)
            logger.info("endpoint %s: metrics collection recovered", name)
        else:
            self._errors[name] = failure
            logger.warning("endpoint %s: metrics collection failing: %s", name, failure)
