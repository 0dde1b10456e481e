"""Admission control: a bounded set of running requests and a FIFO of waiting ones."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass


@dataclass(eq=False, slots=True)
class RequestState:
    """One request as the scheduler and the engine see it (compared by identity)."""

    request_id: str
    model: str
    prompt_tokens: int
    max_tokens: int
    lora_adapter: str | None = None
    generated_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        """Tokens currently held in the KV cache for this request."""
        return self.prompt_tokens + self.generated_tokens


class Scheduler:
    """Grants at most ``max_num_seqs`` running slots; other requests wait in arrival order."""

    def __init__(self, max_num_seqs: int) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        self._max_num_seqs = max_num_seqs
        # dict keeps insertion order, which makes label values deterministic
        self._running: dict[RequestState, None] = {}
        self._waiting: deque[tuple[RequestState, asyncio.Future[None]]] = deque()

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> tuple[RequestState, ...]:
        return tuple(self._running)

    @property
    def waiting(self) -> tuple[RequestState, ...]:
        return tuple(state for state, _ in self._waiting)

    @asynccontextmanager
    async def slot(self, state: RequestState) -> AsyncIterator[None]:
        """Hold a running slot for ``state`` for the duration of the ``async with`` block."""
        if not self._waiting and len(self._running) < self._max_num_seqs:
            self._running[state] = None
        else:
            granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiting.append((state, granted))
            try:
                await granted
            except asyncio.CancelledError:
                if granted.done() and not granted.cancelled():
                    # the slot was granted just as the waiter got cancelled
                    self._release(state)
                else:
                    self._forget_waiter(state)
                raise
        try:
            yield
        finally:
            self._release(state)

    def _release(self, state: RequestState) -> None:
        self._running.pop(state, None)
        self._promote()

    def _forget_waiter(self, state: RequestState) -> None:
        self._waiting = deque(entry for entry in self._waiting if entry[0] is not state)

    def _promote(self) -> None:
        while self._waiting and len(self._running) < self._max_num_seqs:
            state, granted = self._waiting.popleft()
            if granted.done():
                continue
            self._running[state] = None
            granted.set_result(None)
