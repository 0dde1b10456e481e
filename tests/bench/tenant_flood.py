"""Benchmark (not a test): what a flood of fairness ids costs the shared store.

``--processes`` (3) flow controllers, each publishing its flows to one real ``redis-server``
(``RedisSharedLoad``, ``tests.support.redis``), as the EPP replicas of one pool do with
flow control over the pool. The pool is saturated, so every request waits. Then
``--tenants`` (100,000) requests, each of its own fairness id (spread over the processes in
turn, every ``--long-every``-th id 200 bytes long), are queued; once every process's counts
reached Redis, every request is cancelled (the clients went away). Prints, before, at the
peak and after: Redis ``used_memory``, the number of keys, the fields of the flow hashes,
and the band total another process reads; and how long a process took to see the whole
flood and to see it gone.

    .venv/bin/python -m tests.bench.tenant_flood [--tenants 100000] [--processes 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from collections.abc import Callable

from redis.asyncio import Redis

from adapters.redis import RedisSharedLoad, connect
from domain.flowcontrol import BandConfig, FlowControlConfig, FlowController, FlowKey, FlowRequest
from domain.flowcontrol.plugins.max_min_fairness import MaxMinFairnessPolicy
from domain.plugins.base import EmptyParameters, TypedName
from tests.support.redis import RedisServer, redis_available

MAX_MIN = "max-min-fairness-policy"
PREFIX = "epp:flood"


async def redis_figures(raw: Redis) -> tuple[int, int, int]:
    """used_memory (bytes), keys, fields of the flow hashes."""
    info = await raw.info("memory")
    keys = await raw.dbsize()
    fields = 0
    async for key in raw.scan_iter(match=f"{PREFIX}:load:*:a:*"):
        fields += await raw.hlen(key)
    return int(info["used_memory"]), int(keys), fields


async def until(condition: Callable[[], bool], within: float) -> float:
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > within:
            raise SystemExit("the store did not converge in time")
        await asyncio.sleep(0.01)
    return time.monotonic() - started


async def run(args: argparse.Namespace) -> None:
    server = RedisServer()
    server.start()
    client = connect(server.url, socket_timeout=5.0)
    raw = Redis(host="127.0.0.1", port=server.port)
    loads = [RedisSharedLoad(client, key_prefix=PREFIX) for _ in range(args.processes + 1)]
    controllers: list[FlowController] = []
    for load in loads[:-1]:
        controller = FlowController(
            FlowControlConfig(
                default_priority_band=BandConfig(fairness_policy_ref=MAX_MIN),
                default_request_ttl=600.0,
            ),
            saturation=lambda: 1.0,  # saturated: every request waits
            plugins={MAX_MIN: MaxMinFairnessPolicy(TypedName(MAX_MIN, MAX_MIN), EmptyParameters())},
            pool=load,
        )
        controller.start()
        controllers.append(controller)
    observer = loads[-1]  # a process with no flows of its own: reads the others' sums
    try:
        for load in loads:
            await load.start()
        await asyncio.sleep(0.2)  # a benchmark: let the first round trips land
        before = await redis_figures(raw)
        tasks: list[asyncio.Task[object]] = []
        started = time.monotonic()
        for i in range(args.tenants):
            tenant = f"tenant-{i}" if i % args.long_every else f"{'x' * 190}-{i}"
            request = FlowRequest(
                request_id=f"r{i}", flow_key=FlowKey(tenant, 0), received_at=time.monotonic()
            )
            controller = controllers[i % len(controllers)]
            tasks.append(asyncio.create_task(controller.enqueue_and_wait(request)))
            if i % 1000 == 999:
                await asyncio.sleep(0)
        queued = time.monotonic() - started
        seen = await until(lambda: observer.flows().waiting.get(0, 0) == args.tenants, within=60)
        peak = await redis_figures(raw)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        gone = await until(lambda: not observer.flows().waiting, within=60)
        after = await redis_figures(raw)
        print(
            f"{args.tenants:,} fairness ids over {args.processes} processes (every"
            f" {args.long_every}th 200 bytes long), queued in {queued:.1f} s;"
            f" another process saw them all {seen:.2f} s later and saw them gone"
            f" {gone:.2f} s after the cancellation"
        )
        print(f"{'':>14}  {'used_memory':>12}  {'keys':>5}  {'flow-hash fields':>16}")
        for label, (memory, keys, fields) in (
            ("before", before),
            ("at the peak", peak),
            ("after", after),
        ):
            print(f"{label:>14}  {memory / 1024:>9.0f} KiB  {keys:>5}  {fields:>16}")
        print(f"peak - before: {(peak[0] - before[0]) / 1024:.0f} KiB")
        load_avg = os.getloadavg()
        print(
            f"load average {load_avg[0]:.1f}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
        )
    finally:
        for controller in controllers:
            await controller.stop()
        for load in loads:
            await load.stop()
        await client.aclose()
        await raw.aclose()
        server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tenants", type=int, default=100_000)
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--long-every", type=int, default=10)
    args = parser.parse_args()
    if not redis_available():
        raise SystemExit("redis-server and redis-cli are not on PATH: run `make install`")
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
