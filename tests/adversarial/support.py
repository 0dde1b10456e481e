"""Helpers of the adversarial probes: raw loopback servers, an event-loop lag meter and
a memory peak meter."""

from __future__ import annotations

import asyncio
import contextlib
import time
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "LoopLag",
    "MemoryPeak",
    "RawServer",
    "loop_lag",
    "peak_memory",
    "raw_server",
    "wait_for",
]

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@dataclass(slots=True)
class RawServer:
    """A TCP server on loopback; ``connections`` counts accepted connections and
    ``requests`` the request heads read with ``read_request``."""

    port: int = 0
    connections: int = 0
    requests: int = 0
    sent: int = 0
    request_times: list[float] = field(default_factory=list)

    async def read_request(self, reader: asyncio.StreamReader) -> bool:
        """Reads one request head; False when the client hung up."""
        try:
            await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            return False
        self.requests += 1
        self.request_times.append(time.monotonic())
        return True

    async def send(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        writer.write(data)
        await writer.drain()
        self.sent += len(data)


@contextlib.asynccontextmanager
async def raw_server(
    handler: Callable[[RawServer, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
) -> AsyncIterator[RawServer]:
    """Serves every connection with ``handler(server, reader, writer)`` until the block ends;
    a client that hangs up mid-answer ends its handler quietly."""
    state = RawServer()
    writers: set[asyncio.StreamWriter] = set()
    done = asyncio.Event()

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        state.connections += 1
        writers.add(writer)
        try:
            await handler(state, reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writers.discard(writer)
            writer.close()
            if not writers:
                done.set()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    state.port = server.sockets[0].getsockname()[1]
    try:
        yield state
    finally:
        server.close()
        if writers:  # hang up on every client: their handlers end on the closed transport
            done.clear()
            for writer in list(writers):
                writer.close()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(5.0):
                    await done.wait()
        await server.wait_closed()


@dataclass(slots=True)
class LoopLag:
    """The longest time the event loop did not run a 5 ms ticker (seconds), less the time
    the loop's thread sat on the CPU run queue meanwhile (Linux: other processes on a busy
    machine, not this process's work; elsewhere nothing is subtracted)."""

    worst: float = 0.0


_SCHEDSTAT = Path("/proc/thread-self/schedstat")


def _run_queue_wait() -> float:
    """Seconds this thread has spent runnable but not running, or 0 where unknown."""
    try:
        return int(_SCHEDSTAT.read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


@contextlib.asynccontextmanager
async def loop_lag(tick: float = 0.005) -> AsyncIterator[LoopLag]:
    """Measures how long the event loop was blocked at most while the block runs."""
    lag = LoopLag()

    async def ticker() -> None:
        while True:
            before = time.perf_counter()
            waited = _run_queue_wait()
            await asyncio.sleep(tick)
            gap = time.perf_counter() - before - tick - (_run_queue_wait() - waited)
            lag.worst = max(lag.worst, gap)

    task = asyncio.get_running_loop().create_task(ticker())
    try:
        yield lag
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@dataclass(slots=True)
class MemoryPeak:
    """The peak of Python allocations while the block ran, above the start (bytes)."""

    bytes: int = 0


@contextlib.contextmanager
def peak_memory() -> Iterator[MemoryPeak]:
    peak = MemoryPeak()
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    tracemalloc.reset_peak()
    base, _ = tracemalloc.get_traced_memory()
    try:
        yield peak
    finally:
        _, top = tracemalloc.get_traced_memory()
        peak.bytes = top - base
        if started:
            tracemalloc.stop()


async def wait_for(condition: Callable[[], bool], within: float, what: str) -> None:
    """Waits until ``condition()`` holds, checking every 10 ms; fails after ``within`` s."""
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {within}s: {what}")
        await asyncio.sleep(0.01)
