"""An in-memory ``SharedLoad``: several "processes" (instances) sharing one ``LocalLoadStore``.

The reference implementation for the SharedLoad contract suite: the same lease and
background-refresh structure as the Redis one, with a dict instead of a server. Each
instance writes its totals and renews its lease every ``staleness`` seconds in a background
task, and reads the sum of the other live instances into a local copy.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from ports.shared_state import EndpointLoad

__all__ = ["LocalLoadStore", "LocalSharedLoad"]


@dataclass(slots=True)
class _Entry:
    loads: dict[str, EndpointLoad] = field(default_factory=dict)
    lease_end: float = 0.0


@dataclass(slots=True)
class LocalLoadStore:
    """What every instance sees: process id → its published totals and lease end."""

    processes: dict[int, _Entry] = field(default_factory=dict)

    def live_others(self, own: int) -> dict[str, EndpointLoad]:
        now = time.monotonic()
        totals: dict[str, EndpointLoad] = {}
        for pid, entry in list(self.processes.items()):
            if entry.lease_end <= now:
                del self.processes[pid]
                continue
            if pid == own:
                continue
            for endpoint, load in entry.loads.items():
                seen = totals.get(endpoint, EndpointLoad())
                totals[endpoint] = EndpointLoad(
                    requests=seen.requests + load.requests, tokens=seen.tokens + load.tokens
                )
        return totals


_ids = itertools.count(1)


class LocalSharedLoad:
    """A ``SharedLoad`` on a ``LocalLoadStore``."""

    def __init__(self, store: LocalLoadStore, *, lease: float, staleness: float) -> None:
        self._store = store
        self._lease = lease
        self._staleness = staleness
        self._pid = next(_ids)
        self._own: dict[str, EndpointLoad] = {}
        self._copy: dict[str, EndpointLoad] = {}
        self._task: asyncio.Task[None] | None = None

    @property
    def staleness(self) -> float:
        return self._staleness

    def publish(self, endpoint: str, load: EndpointLoad) -> None:
        self._own[endpoint] = load

    def others(self) -> Mapping[str, EndpointLoad]:
        return self._copy

    def remove_endpoint(self, endpoint: str) -> None:
        self._own.pop(endpoint, None)

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        await self.halt()
        self._store.processes.pop(self._pid, None)

    async def halt(self) -> None:
        """Stop renewing without withdrawing, as a process that died would."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        while True:
            self._store.processes[self._pid] = _Entry(
                loads={e: v for e, v in self._own.items() if v.requests or v.tokens},
                lease_end=time.monotonic() + self._lease,
            )
            self._copy = self._store.live_others(self._pid)
            await asyncio.sleep(self._staleness)
