"""The processes of one pool for the shared-state contract suites: members of an in-memory
board, or ``RedisSharedLoad`` instances on one store (each is a ``SharedLoad`` and a
``SharedAdmission``), and a polling wait."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from adapters.redis import RedisClient, RedisSharedLoad
from domain.sharedstate import BoardMember, LoadBoard

__all__ = ["LEASE", "SEEN_WITHIN", "STALENESS", "Process", "Processes", "until"]

#: What every process of the suites is: both ports, one object.
Process = BoardMember | RedisSharedLoad

LEASE = 0.6
STALENESS = 0.02
#: Long enough for a few refreshes on a busy 2-core machine.
SEEN_WITHIN = 3.0


class Processes:
    """Makes started "processes" on one shared store; stops them all at the end."""

    def __init__(self, client: RedisClient | None, prefix: str) -> None:
        self.client = client
        self._prefix = prefix
        self._board = LoadBoard()
        self.started: list[Process] = []
        self._members = 0

    def make(self, *, lease: float = LEASE) -> Process:
        """A process, not started."""
        if self.client is None:
            self._members += 1
            return self._board.member(f"p{self._members}", lease=lease, staleness=STALENESS)
        return RedisSharedLoad(
            self.client, key_prefix=self._prefix, lease=lease, staleness=STALENESS
        )

    async def process(self, *, lease: float = LEASE) -> Process:
        load = self.make(lease=lease)
        await load.start()
        self.started.append(load)
        return load

    async def crash(self, load: Process) -> None:
        """The process dies: it stops renewing and never withdraws."""
        if isinstance(load, BoardMember):
            await load._halt()  # a crash, as no public method would ever do it
            return
        assert isinstance(load, RedisSharedLoad)
        task = load._task  # a crash, as no public method would ever do it
        load._task = None
        assert task is not None
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def until(condition: Callable[[], bool], what: str, within: float = SEEN_WITHIN) -> float:
    """Wait for ``condition`` (polled every 5 ms); returns the seconds it took."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > within:
            raise AssertionError(f"not within {within}s: {what}")
        await asyncio.sleep(0.005)
    return time.monotonic() - started
