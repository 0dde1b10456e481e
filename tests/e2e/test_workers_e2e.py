"""``--workers 2`` behind a real Envoy, on a real redis-server: one pod, two processes.

What a user sees: every request answered, both workers taking streams, one ``/metrics``
counting them all, one health port staying SERVING while a killed worker is restarted, and
each model server scraped as often as by a lone EPP.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import aiohttp
import orjson
import pytest
from grpc_health.v1 import health_pb2
from prometheus_client.parser import text_string_to_metric_families

from tests.simulator import DEFAULT_MODEL
from tests.support.redis import RedisServer
from tests.support.stack import Stack, StackOptions, wait_for

pytestmark = pytest.mark.e2e

SERVING = health_pb2.HealthCheckResponse.SERVING
WORKERS = 2
INTERVAL = 0.05  # --refresh-metrics-interval (the default)


@pytest.fixture(scope="module")
def stack(redis: RedisServer) -> Iterator[Stack]:
    options = StackOptions(
        simulators=3,
        simulator_base_ip="127.0.0.81",
        epp_args=["--redis-url", redis.url, "--workers", str(WORKERS), "--tracing=false"],
    )
    with Stack.run(options) as running:
        wait_for(
            lambda: all(w["ready"] for w in workers(running)),
            timeout=60,
            what="both workers to be ready",
        )
        yield running


def workers(stack: Stack) -> list[dict[str, Any]]:
    url = f"http://127.0.0.1:{stack.epp_metrics_port}/workers"
    with urllib.request.urlopen(url, timeout=5) as response:
        listing: list[dict[str, Any]] = orjson.loads(response.read())
    return listing


def requests_served(metrics_url: str) -> float:
    """The sum of ``inference_objective_request_total`` on a ``/metrics`` page."""
    with urllib.request.urlopen(metrics_url, timeout=5) as response:
        text = response.read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "inference_objective_request"
        for sample in family.samples
    )


def per_worker(stack: Stack) -> dict[int, float]:
    return {
        w["worker"]: requests_served(f"http://127.0.0.1:{w['metrics_port']}/metrics")
        for w in workers(stack)
    }


async def _send(url: str, count: int, concurrency: int = 8) -> list[int]:
    body = orjson.dumps({"model": DEFAULT_MODEL, "prompt": "workers " * 8, "max_tokens": 2})
    statuses: list[int] = []
    queue = list(range(count))
    async with aiohttp.ClientSession() as session:

        async def client() -> None:
            while queue:
                queue.pop()
                async with session.post(
                    f"{url}/v1/completions",
                    data=body,
                    headers={"content-type": "application/json"},
                    timeout=aiohttp.ClientTimeout(total=10),
                ) as response:
                    await response.read()
                    statuses.append(response.status)

        await asyncio.gather(*(client() for _ in range(concurrency)))
    return statuses


def test_every_request_succeeds_and_both_workers_take_streams(stack: Stack) -> None:
    before = per_worker(stack)
    statuses: list[int] = []

    def both_took_streams() -> bool:
        statuses.extend(asyncio.run(_send(stack.url, 100)))
        after = per_worker(stack)
        return all(after[w] > before.get(w, 0) for w in after) and len(after) == WORKERS

    # The supervisor hands connections out in turn; workers ask Envoy to reconnect every
    # second or so.
    wait_for(both_took_streams, timeout=60, what="streams on both workers")
    assert statuses
    assert set(statuses) == {200}


def test_one_metrics_port_sums_the_workers(stack: Stack) -> None:
    asyncio.run(_send(stack.url, 40))
    # No request is in flight now: the merged count is the workers' sum.
    separate = per_worker(stack)
    assert len(separate) == WORKERS
    assert requests_served(stack.epp_metrics_url) == sum(separate.values())


def test_model_servers_are_scraped_once_per_pod_not_per_worker(stack: Stack) -> None:
    sim_url = next(iter(stack.simulator_urls.values()))

    def scrapes() -> int:
        with urllib.request.urlopen(f"{sim_url}/sim/stats", timeout=5) as response:
            return int(orjson.loads(response.read())["metrics_scrapes"])

    wanted = 30
    start, started = scrapes(), time.monotonic()
    wait_for(lambda: scrapes() >= start + wanted, timeout=30, what=f"{wanted} scrapes")
    elapsed = time.monotonic() - started
    # One scraper polls at most once per interval (a slow machine only slows it down); two
    # would reach the count in half the time.
    assert elapsed >= 0.8 * (wanted - 1) * INTERVAL, f"{wanted} scrapes in {elapsed:.2f}s"


def test_a_worker_dying_in_a_loop_is_restarted_with_backoff_and_the_pod_stays_serving(
    stack: Stack,
) -> None:
    readiness: list[int | None] = []
    first = workers(stack)[1]
    killed: list[int] = []
    for _ in range(3):  # each new process of worker 1 is killed as soon as it is listed
        pid = wait_for(
            lambda: (workers(stack)[1]["pid"] not in (None, *killed)) and workers(stack)[1]["pid"],
            timeout=60,
            what="worker 1's next process",
        )
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)
        readiness.append(stack.epp_readiness())

    def restarted() -> bool:
        readiness.append(stack.epp_readiness())
        listing = workers(stack)[1]
        return bool(listing["pid"] not in (None, *killed) and listing["ready"])

    wait_for(restarted, timeout=90, what="worker 1 to be restarted and ready")
    assert set(readiness) == {SERVING}, readiness
    assert workers(stack)[1]["restarts"] == first["restarts"] + 3
    assert stack.epp is not None
    log = stack.epp.log()
    delays = re.findall(
        r"worker 1 \(pid \d+\) exited \(signal SIGKILL\) after [\d.]+s; "
        r"restarting in ([\d.]+)s",
        log,
    )
    assert [float(d) for d in delays[-3:]] == [0.5, 1.0, 2.0], delays
    assert set(asyncio.run(_send(stack.url, 20))) == {200}
