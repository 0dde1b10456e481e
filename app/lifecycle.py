"""One lifecycle for every process role: services started in order, stopped in reverse.

A ``Service`` is anything with a ``name`` and ``start``/``stop`` coroutines. ``Lifecycle``
starts its services in order; when one fails to start it stops the ones already started, in
reverse, and raises the failure. ``stop`` stops every started service in reverse order; a
service whose stop fails is logged and the others still stop. ``step`` and ``task`` make a
service of two callables or of a background coroutine.

``run_process`` is what the single process, the supervisor and each worker share: the
logging, the event loop (uvloop when asked for and installed), SIGTERM and SIGINT setting
the stop event, a ``StartupError`` turned into one log line and exit code 1, and the open
files (``app.descriptors``: the soft limit raised to the hard one, a line when none is left).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from app.descriptors import raise_open_file_limit, watch_descriptors
from app.flags import log_startup_notices
from app.logsetup import LogOptions, configure_logging
from app.settings import Settings

__all__ = ["Lifecycle", "Service", "StartupError", "run_process", "step", "task"]

logger = logging.getLogger(__name__)


class StartupError(Exception):
    """The process cannot start; the message says why (a config entry, a port, ...)."""


class Service(Protocol):
    """Something a process starts and stops."""

    @property
    def name(self) -> str: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


async def _nothing() -> None:
    return None


@dataclass(frozen=True, slots=True)
class _Step:
    name: str
    on_start: Callable[[], Awaitable[None]]
    on_stop: Callable[[], Awaitable[None]]

    async def start(self) -> None:
        await self.on_start()

    async def stop(self) -> None:
        await self.on_stop()


def step(
    name: str,
    start: Callable[[], Awaitable[None]] = _nothing,
    stop: Callable[[], Awaitable[None]] = _nothing,
) -> Service:
    """A service of two coroutine functions (either may be left out)."""
    return _Step(name, start, stop)


class _Task:
    """A background coroutine: started as a task, cancelled and awaited on stop."""

    def __init__(self, name: str, run: Callable[[], Coroutine[Any, Any, None]]) -> None:
        self.name = name
        self._run = run
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.task = asyncio.create_task(self._run(), name=self.name)

    async def stop(self) -> None:
        running, self.task = self.task, None
        if running is None:
            return
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running


def task(name: str, run: Callable[[], Coroutine[Any, Any, None]]) -> _Task:
    """A service that runs ``run()`` as a task from ``start`` to ``stop``; ``Lifecycle.wait``
    returns early when it ends on its own."""
    return _Task(name, run)


class Lifecycle:
    """Starts ``services`` in order and stops the started ones in reverse."""

    def __init__(self, services: Sequence[Service]) -> None:
        self._services = list(services)
        self._started: list[Service] = []

    @property
    def started(self) -> list[str]:
        return [service.name for service in self._started]

    async def start(self) -> None:
        """Starts every service; on a failure, stops the started ones and raises it."""
        for service in self._services:
            try:
                await service.start()
            except BaseException:
                await self.stop()
                raise
            self._started.append(service)

    async def stop(self) -> None:
        """Stops the started services in reverse order, each once; a failing stop is
        logged and the rest still stop."""
        while self._started:
            service = self._started.pop()
            try:
                await service.stop()
            except Exception:
                logger.exception("%s: stopping failed", service.name)

    async def stop_one(self, name: str) -> None:
        """Stops one started service now, out of order (the Lease before the drain)."""
        for service in list(self._started):
            if service.name == name:
                self._started.remove(service)
                await service.stop()

    async def wait(self, stop: asyncio.Event) -> None:
        """Until ``stop`` is set or a task service ends on its own (its error is raised)."""
        tasks = {s.task for s in self._started if isinstance(s, _Task) and s.task is not None}
        stopping = asyncio.create_task(stop.wait())
        try:
            done, _ = await asyncio.wait({*tasks, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
        for finished in done - {stopping}:
            finished.result()  # raises the background task's error


def run_process(
    settings: Settings,
    main: Callable[[asyncio.Event], Coroutine[Any, Any, int]],
    *,
    worker: str = "",
) -> int:
    """Logging, the event loop and signals for ``main(stop)``; its exit code. SIGTERM and
    SIGINT set ``stop``; a ``StartupError`` is logged as one line and exits 1. The flags'
    start-up notices are logged once per pod (not by each worker)."""
    configure_logging(LogOptions.from_settings(settings), worker=worker)
    if not worker or worker == "supervisor":
        log_startup_notices(settings)
    raise_open_file_limit()  # workers inherit the supervisor's: nothing to log there

    async def guarded() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        watch = asyncio.create_task(watch_descriptors(), name="open-files")
        try:
            return await main(stop)
        except StartupError as exc:
            logger.error("%s", exc)
            return 1
        finally:
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch

    if settings.uvloop and sys.platform != "win32":
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.run(guarded())
    return asyncio.run(guarded())
