"""``make demo-ha``: three EPP replicas sharing their state on one Redis, behind one Envoy.

Starts a ``redis-server`` on loopback (``make install`` installs it), three simulated model
servers, three EPP processes on that Redis (``--redis-url``) and Envoy, whose ``epp``
cluster round-robins the ext_proc streams over the replicas. Sends the requests of a few
conversations (each with its own long system prompt) one at a time, so consecutive
requests of one conversation are routed by different replicas, and prints for each which
replica routed it, which server it went to and why. The summary shows that each
conversation stayed on one server although three processes routed it: they share one
prefix index. Stops everything it started (also on Ctrl-C).

Before each request the demo waits until the previous request's prefix reached Redis (the
replicas' acknowledged-writes counters): the write is sent after the reply to Envoy, so a
request arriving within that write's round trip would not see it yet (docs/shared-state.md).
The replicas run with ``--redis-deadline 100ms`` (and ``--redis-claim-deadline``) so that a
loaded laptop's pauses do not turn the demo's shared reads into local ones (the defaults, 5
and 20 ms, are for a server).

    .venv/bin/python -m tests.demo_ha [--rounds 4]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp
import orjson

from tests.demo import DECISION_HEADER, QUESTIONS, SYSTEMS, _why
from tests.simulator import DEFAULT_MODEL, DESTINATION_SEEN_HEADER, INSTANCE_HEADER
from tests.support.redis import RedisServer, redis_available
from tests.support.stack import Stack, StackOptions
from tests.support.stack import metric_sum as _metric
from tests.support.stack import replica_metrics_urls as _metrics_urls

REPLICAS = 3
REQUEST_TOTAL = "inference_objective_request_total"
WRITES = "inference_extension_shared_state_writes_total"
DEGRADED = "inference_extension_shared_state_degraded"


@dataclass(frozen=True)
class Routed:
    number: int
    conversation: int
    replica: int  # 1-based; 0 when no replica's counter moved
    status: int
    instance: str
    destination: str
    why: str


def _body(conversation: int, question: int) -> bytes:
    prompt = SYSTEMS[conversation] + QUESTIONS[question % len(QUESTIONS)]
    return orjson.dumps({"model": DEFAULT_MODEL, "prompt": prompt, "max_tokens": 8})


async def _counts(urls: Sequence[str], name: str) -> list[float]:
    return await asyncio.to_thread(lambda: [_metric(url, name) for url in urls])


async def _until_written(urls: Sequence[str], count: float) -> None:
    """Wait until the replicas acknowledged ``count`` writes to Redis (at most 10 s)."""
    deadline = time.monotonic() + 10.0
    while sum(await _counts(urls, WRITES)) < count:
        if time.monotonic() > deadline:
            print("  (a write did not reach Redis within 10 s; going on)", flush=True)
            return
        await asyncio.sleep(0.01)


async def _traffic(stack: Stack, rounds: int) -> list[Routed]:
    urls = _metrics_urls(stack)
    routed: list[Routed] = []
    before = await _counts(urls, REQUEST_TOTAL)
    async with aiohttp.ClientSession() as session:
        for question in range(rounds):
            for conversation in range(len(SYSTEMS)):
                written = sum(await _counts(urls, WRITES))
                async with session.post(
                    f"{stack.url}/v1/completions", data=_body(conversation, question)
                ) as response:
                    text = await response.text()
                    status = response.status
                    headers = response.headers
                after = await _counts(urls, REQUEST_TOTAL)
                moved = [i for i, (a, b) in enumerate(zip(after, before, strict=True)) if a > b]
                before = after
                outcome = Routed(
                    number=len(routed),
                    conversation=conversation,
                    replica=moved[0] + 1 if len(moved) == 1 else 0,
                    status=status,
                    instance=headers.get(INSTANCE_HEADER, "-"),
                    destination=headers.get(DESTINATION_SEEN_HEADER, "-"),
                    why=(
                        _why(headers.get(DECISION_HEADER, ""))
                        if status == 200
                        else text.strip()[:60]
                    ),
                )
                earlier = [r for r in routed if r.conversation == conversation]
                note = ""
                if earlier and outcome.replica not in {r.replica for r in earlier}:
                    note = (
                        f"  <- replica {outcome.replica}'s first request of this conversation;"
                        f" its prefix was placed by replica {earlier[0].replica}, read from Redis"
                    )
                routed.append(outcome)
                print(
                    f"{outcome.number:>3}  conversation {conversation}  "
                    f"replica {outcome.replica or '?'}  {status:>6}  {outcome.instance:<10} "
                    f"{outcome.destination:<16} {outcome.why}{note}",
                    flush=True,
                )
                if status == 200:
                    await _until_written(urls, written + 1)
    return routed


def _summary(stack: Stack, routed: Sequence[Routed]) -> bool:
    """Print per conversation the replicas that routed it and the servers it went to;
    True when every request succeeded and each conversation stayed on one server."""
    print()
    print("Summary")
    ok = True
    for conversation in range(len(SYSTEMS)):
        mine = [r for r in routed if r.conversation == conversation]
        replicas = sorted({r.replica for r in mine})
        servers = sorted({r.instance for r in mine if r.status == 200})
        one = len(servers) == 1 and all(r.status == 200 for r in mine)
        ok = ok and one
        print(
            f"  conversation {conversation}: {len(mine)} requests routed by replicas"
            f" {', '.join(str(r) for r in replicas)} -> served by {', '.join(servers) or '-'}"
            f" ({'one server' if one else 'SPLIT'})"
        )
    statuses: dict[int, int] = {}
    for r in routed:
        statuses[r.status] = statuses.get(r.status, 0) + 1
    per_replica = [sum(1 for r in routed if r.replica == i + 1) for i in range(REPLICAS)]
    print(f"  statuses: {dict(sorted(statuses.items()))}; requests per replica: {per_replica}")
    urls = _metrics_urls(stack)
    degraded = sum(_metric(url, DEGRADED) for url in urls)
    writes = sum(_metric(url, WRITES) for url in urls)
    print(f"  shared-state writes acknowledged: {writes:.0f}; replicas degraded: {degraded:.0f}")
    verdict = "yes" if ok else "NO"
    print(f"  every conversation stayed on one server across {REPLICAS} replicas: {verdict}")
    return ok


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rounds", type=int, default=4, help="requests per conversation (default 4)"
    )
    args = parser.parse_args(argv)
    if not redis_available():
        print(
            "make demo-ha needs redis-server and redis-cli on PATH: run `make install` "
            "(it installs Debian's redis-server and redis-tools), or install Redis >= 7.",
            file=sys.stderr,
        )
        return 1
    print("Starting redis-server, 3 simulated model servers, 3 EPP replicas and Envoy ...")
    redis = RedisServer()
    redis.start()
    try:
        options = StackOptions(
            simulators=3,
            simulator_base_ip="127.0.0.92",
            epp_replicas=REPLICAS,
            epp_args=[
                "--explain-decisions",
                "--redis-url",
                redis.url,
                "--redis-key-prefix",
                f"epp:demo-ha-{uuid.uuid4().hex[:8]}",
                "--redis-deadline",
                "100ms",
                "--redis-claim-deadline",
                "100ms",
            ],
        )
        with Stack.run(options) as stack:
            print(f"  redis-server on {redis.address}")
            print(f"  Envoy listening on {stack.url}, round robin over the replicas:")
            for i, (grpc, health, metrics) in enumerate(stack.replica_ports, start=1):
                print(
                    f"    replica {i}: ext_proc 127.0.0.1:{grpc}, health {health},"
                    f" metrics {metrics}"
                )
            for name, address in stack.simulator_addresses.items():
                print(f"  model server {name} at {address}")
            print()
            print(
                f"{'#':>3}  {'request':<14}  {'routed by':<9}  {'status':>6}  {'served by':<10} "
                f"{'EPP chose':<16} why"
            )
            routed = asyncio.run(_traffic(stack, args.rounds))
            ok = _summary(stack, routed)
            print("Stopping everything ...")
    finally:
        redis.close()
    print("Done.")
    return 0 if ok else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("\nInterrupted; everything started has been stopped.")
        sys.exit(130)
