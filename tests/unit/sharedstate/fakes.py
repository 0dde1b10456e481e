"""Doubles for the shared-state tests: a remote prefix index that can be told to be slow,
fail or recover, and a sleep the test releases step by step."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence

from domain.prefixcache import InMemoryPrefixIndex
from ports.shared_state import SharedStateError, SharedStateReplyError, SharedStateWriteRefusedError

__all__ = ["FakeRemoteIndex", "StagedRemoteIndex", "StepSleep", "until"]


class FakeRemoteIndex:
    """A remote ``PrefixIndex`` over an in-memory index.

    ``failing``: every call raises ``SharedStateError``. ``slow``: the named operations
    (``match``, ``add``, ``claim``, ``remove_endpoint``) never answer (until cancelled).
    ``latency``: every call answers after that many seconds. ``garbage``: the named operations raise
    ``SharedStateReplyError`` (an error reply; the store is up). ``full``: ``add`` raises
    ``SharedStateWriteRefusedError`` (out of memory). ``calls`` lists every operation
    called, answered or not; ``answered`` those that returned.
    """

    def __init__(self) -> None:
        self.index = InMemoryPrefixIndex()
        self.failing = False
        self.slow: set[str] = set()
        self.latency = 0.0
        self.garbage: set[str] = set()
        self.full = False
        self.calls: list[str] = []
        self.answered: list[str] = []
        self.tails: list[int] = []  # add_tail's ``held``, per call

    async def _enter(self, operation: str) -> None:
        self.calls.append(operation)
        if self.failing:
            raise SharedStateError("connection refused")
        if operation in self.slow:
            await asyncio.Event().wait()
        if self.latency:
            await asyncio.sleep(self.latency)
        if operation in self.garbage:
            raise SharedStateReplyError("WRONGTYPE Operation against a key holding the wrong kind")
        if operation == "add" and self.full:
            raise SharedStateWriteRefusedError("OOM command not allowed")

    async def match(self, hashes: Sequence[int]) -> Mapping[str, int]:
        await self._enter("match")
        self.answered.append("match")
        return self.index.match_sync(hashes)

    async def add(self, hashes: Sequence[int], endpoint: str, capacity: int) -> None:
        await self._enter("add")
        self.index.add_sync(hashes, endpoint, capacity)

    async def add_tail(
        self, hashes: Sequence[int], held: int, endpoint: str, capacity: int
    ) -> None:
        await self._enter("add_tail")
        self.tails.append(held)
        self.index.add_sync(hashes[held:], endpoint, capacity)

    async def claim(
        self,
        hashes: Sequence[int],
        endpoint: str,
        capacity: int,
        alternates: Sequence[str] = (),
    ) -> str:
        await self._enter("claim")
        self.answered.append("claim")
        return self.index.claim_sync(hashes, endpoint, capacity, alternates)

    async def remove_endpoint(self, endpoint: str) -> None:
        await self._enter("remove_endpoint")
        self.index.remove_endpoint_sync(endpoint)

    def size(self) -> int:
        return -1


class StagedRemoteIndex(FakeRemoteIndex):
    """A ``FakeRemoteIndex`` that names a claim's owner first (``claim_owner``) and leaves
    a last step, the operation ``claim_rest`` (``slow``, ``garbage`` apply to it), to the
    caller; ``rests`` counts the steps handed out."""

    def __init__(self) -> None:
        super().__init__()
        self.rests = 0

    async def claim_owner(
        self,
        hashes: Sequence[int],
        endpoint: str,
        capacity: int,
        alternates: Sequence[str] = (),
    ) -> tuple[str, Callable[[], Awaitable[None]] | None]:
        owner = await self.claim(hashes, endpoint, capacity, alternates)
        self.rests += 1
        return owner, self._rest

    async def _rest(self) -> None:
        await self._enter("claim_rest")
        self.answered.append("claim_rest")


class StepSleep:
    """An injectable ``sleep``: records each delay and returns only when released."""

    def __init__(self) -> None:
        self.delays: list[float] = []
        self._waiters: list[asyncio.Future[None]] = []

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        await waiter

    @property
    def waiting(self) -> bool:
        return any(not w.done() for w in self._waiters)

    async def release(self) -> None:
        """Let the current sleeper go; return once it asked for its next sleep (or ended)."""
        await until(lambda: self.waiting)
        before = len(self.delays)
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._waiters.clear()
        for _ in range(100):
            if len(self.delays) > before:
                return
            await asyncio.sleep(0.001)


async def until(condition: Callable[[], bool], within: float = 2.0) -> None:
    """Wait for ``condition`` with a deadline."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not condition():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.001)
