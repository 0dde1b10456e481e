"""Micro-benchmark (not a test): the round trip of ``RedisPrefixIndex.match`` on loopback.

Starts its own redis-server and 3-master cluster (``tests.support.redis``), fills each with
chains of 32 and 256 blocks held by 4 endpoints (plus unrelated chains), then times
``match`` on full chains: wall-clock latency per call (p50, p90, p99, max) over ``--calls``
sequential calls after a warm-up, alternating single/cluster in rounds so both see the same
machine load, and this process's CPU time per call. Also times ``add`` of one chain.

    PYTHONPATH=. .venv/bin/python -m tests.bench.redis_prefix_match [--calls 2000] [--rounds 4]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import time
from collections.abc import Awaitable, Callable, Iterator

from adapters.redis import RedisPrefixIndex, connect
from tests.support.redis import RedisCluster, RedisServer


def chain(rng: random.Random, length: int) -> list[int]:
    return [rng.getrandbits(64) for _ in range(length)]


async def timed(call: Callable[[], Awaitable[object]], calls: int) -> tuple[list[float], float]:
    """Latencies (µs) of ``calls`` sequential awaits, and CPU µs per call."""
    latencies: list[float] = []
    cpu = time.process_time()
    for _ in range(calls):
        start = time.perf_counter()
        await call()
        latencies.append((time.perf_counter() - start) * 1e6)
    return latencies, (time.process_time() - cpu) / calls * 1e6


def summary(latencies: list[float]) -> str:
    q = statistics.quantiles(latencies, n=100, method="inclusive")
    return f"p50 {q[49]:7.0f}  p90 {q[89]:7.0f}  p99 {q[98]:7.0f}  max {max(latencies):7.0f} µs"


async def run(single_url: str, cluster_url: str, calls: int, rounds: int) -> None:
    rng = random.Random(1)
    chains = {n: [chain(rng, n) for _ in range(16)] for n in (32, 256)}
    indexes = {}
    clients = []
    for name, url in (("single ", single_url), ("cluster", cluster_url)):
        client = connect(url, socket_timeout=1.0)
        clients.append(client)
        index = RedisPrefixIndex(client, key_prefix="epp:bench")
        for group in chains.values():
            for i, hashes in enumerate(group):
                for endpoint in range(4):
                    await index.add(
                        hashes[: len(hashes) - endpoint * 3], f"pod-{i}-{endpoint}", 10**6
                    )
        indexes[name] = index
    results: dict[tuple[str, str], tuple[list[float], list[float]]] = {}
    for _ in range(rounds):
        for name, index in indexes.items():
            for length, group in chains.items():
                picks = iter(rng.choice(group) for _ in range(calls * 2))

                async def match(
                    index: RedisPrefixIndex = index, picks: Iterator[list[int]] = picks
                ) -> object:
                    return await index.match(next(picks))

                await timed(match, calls // 10)  # warm-up
                latencies, cpu = await timed(match, calls)
                lat, cpus = results.setdefault((name, f"match {length:3d} blocks"), ([], []))
                lat += latencies
                cpus.append(cpu)
            seq = iter(range(10**9))

            async def add(index: RedisPrefixIndex = index, seq: Iterator[int] = seq) -> None:
                await index.add(chains[32][0], f"adder-{next(seq) % 8}", 64)

            latencies, cpu = await timed(add, calls // 4)
            lat, cpus = results.setdefault((name, "add    32 blocks"), ([], []))
            lat += latencies
            cpus.append(cpu)
    for (name, what), (latencies, cpus) in sorted(results.items(), key=lambda kv: kv[0][1]):
        print(f"{name}  {what}:  {summary(latencies)}  CPU {min(cpus):5.0f} µs/call (client)")
    for client in clients:
        await client.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f}; {args.calls} calls x {args.rounds} rounds")
    single = RedisServer()
    cluster = RedisCluster()
    try:
        single.start()
        cluster.start()
        asyncio.run(run(single.url, cluster.url, args.calls, args.rounds))
    finally:
        single.close()
        cluster.close()


if __name__ == "__main__":
    main()
