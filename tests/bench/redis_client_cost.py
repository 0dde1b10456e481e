"""Benchmark (not a test): the client's CPU per Lua script call, redis-py against the
script channel (``adapters.redis.pipelined``), side by side on one redis-server.

Each mode runs ``--calls`` ``EVALSHA`` calls of a one-``GET`` script from ``concurrency``
coroutines at once (each awaiting its reply before the next call), alternating modes for
``--rounds`` rounds; prints the median CPU of this process per call (the server's CPU is
not counted) and calls/s, per concurrency. The routing path calls one script per request
(the prefix match) and the shared load's sync about once per five.

    .venv/bin/python -m tests.bench.redis_client_cost [--calls 20000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import statistics
import time
from collections.abc import Awaitable, Callable

import uvloop

from adapters.redis import connect
from adapters.redis.connection import PipelinedRedis
from tests.support.redis import RedisServer

_SCRIPT = "return redis.call('GET', KEYS[1])"


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _measure(
    call: Callable[[], Awaitable[object]], calls: int, concurrency: int
) -> tuple[float, float]:
    """CPU µs per call, and calls per second."""
    each = calls // concurrency

    async def caller() -> None:
        for _ in range(each):
            await call()

    cpu, started = _cpu(), time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(concurrency)))
    seconds = time.perf_counter() - started
    return (_cpu() - cpu) / (each * concurrency) * 1e6, each * concurrency / seconds


async def _main(args: argparse.Namespace, url: str) -> None:
    pooled = connect(url)  # its scripts go on its channel; pooled.evalsha goes through redis-py
    assert isinstance(pooled, PipelinedRedis)
    channel = pooled.script_channel
    sha = await pooled.script_load(_SCRIPT)
    modes: dict[str, Callable[[], Awaitable[object]]] = {
        "redis-py": lambda: pooled.evalsha(sha, 1, "k", "a"),
        "script channel": lambda: channel.call(("EVALSHA", sha, 1, "k", "a")),
    }
    try:
        for concurrency in args.concurrency:
            figures: dict[str, list[tuple[float, float]]] = {mode: [] for mode in modes}
            for call in modes.values():  # warm up
                await _measure(call, 1000, concurrency)
            for _ in range(args.rounds):
                for mode, call in modes.items():
                    figures[mode].append(await _measure(call, args.calls, concurrency))
            for mode, runs in figures.items():
                cpu = statistics.median(r[0] for r in runs)
                rate = statistics.median(r[1] for r in runs)
                print(
                    f"concurrency {concurrency:>3}  {mode:<15} {cpu:7.1f} µs CPU per call"
                    f"  {rate:9.0f} calls/s"
                )
    finally:
        await pooled.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20_000, help="calls per mode and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--concurrency", type=int, nargs="+", default=[1, 4, 16], help="callers at once"
    )
    args = parser.parse_args()
    server = RedisServer()
    server.start()
    try:
        uvloop.run(_main(args, server.url))
    finally:
        server.close()


if __name__ == "__main__":
    main()
