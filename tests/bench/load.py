"""What the through-Envoy benchmarks share: a closed-loop load and a process's CPU time."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable

import aiohttp

__all__ = ["closed_loop", "cpu_seconds"]


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds process ``pid`` has used (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def closed_loop(
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    total: int,
    concurrency: int,
    headers: Callable[[], dict[str, str]] | None = None,
) -> tuple[float, list[float], int]:
    """``total`` completions POSTed to ``url`` by ``concurrency`` workers, each sending
    its next request when the last one is answered. ``headers`` makes each request's
    headers (default: JSON content type). Returns seconds taken, latencies (ms) and the
    count of answers other than 200."""
    latencies: list[float] = []
    errors = 0
    remaining = total

    async def worker() -> None:
        nonlocal remaining, errors
        while remaining > 0:
            remaining -= 1
            sent = headers() if headers is not None else {"content-type": "application/json"}
            started = time.perf_counter()
            async with session.post(f"{url}/v1/completions", data=body, headers=sent) as response:
                await response.read()
                if response.status != 200:
                    errors += 1
            latencies.append((time.perf_counter() - started) * 1000)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - started, latencies, errors
