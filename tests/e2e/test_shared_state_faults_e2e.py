"""Three EPP replicas behind one Envoy on a Redis that fails, and on the other URL forms.

- Fault: the redis-server is SIGKILLed during traffic, then restarted empty on the same
  port. Every request is answered 200, every replica stays SERVING, logs the change once
  each way and shows it on its degraded gauge, and once Redis is back the replicas share
  again: a new prefix sent through all of them lands on one model server.
- A Redis Cluster (``redis+cluster://``) and TLS (``rediss://`` with the test CA): the same
  prefix through all replicas lands on one model server.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import aiohttp
import pytest

from tests.e2e.test_shared_state_e2e import _prompt, _until_written
from tests.simulator import INSTANCE_HEADER
from tests.support.redis import RedisCluster, RedisServer, make_tls_files, redis_available
from tests.support.stack import Stack, StackOptions, free_port
from tests.support.stack import metric_sum as _counter
from tests.support.stack import replica_metrics_urls as _metrics_urls

pytestmark = pytest.mark.e2e

REPLICAS = 3
DEGRADED = "inference_extension_shared_state_degraded"
WRITES = "inference_extension_shared_state_writes_total"
#: The log lines of a change, per replica: the prefix index's and the shared load's.
DEGRADE_LINES = ("shared prefix index degraded", "shared load: redis failed")
HEAL_LINES = ("shared prefix index healthy again", "shared load: redis answers again")


def _require_redis() -> None:
    if not redis_available():
        pytest.fail("redis-server and redis-cli are not on PATH: run `make install`")


def _options(url: str, base_ip: str) -> StackOptions:
    return StackOptions(
        simulators=3,
        simulator_base_ip=base_ip,
        epp_replicas=REPLICAS,
        epp_args=[
            "--redis-url",
            url,
            "--redis-key-prefix",
            f"epp:e2e-{uuid.uuid4().hex[:8]}",
            # A loaded test machine can pause a process for more than the 5 ms default;
            # deadline misses would add their own degrade lines and make the test flaky.
            "--redis-deadline",
            "200ms",
            "--redis-claim-deadline",
            "200ms",
        ],
    )


def _gauges(stack: Stack) -> list[float]:
    return [_counter(url, DEGRADED) for url in _metrics_urls(stack)]


def _all_serving(stack: Stack) -> bool:
    return all(
        Stack._serving(epp, health)
        for epp, (_, health, _) in zip(stack.epps, stack.replica_ports, strict=True)
    )


async def _one_server_per_prefix(
    stack: Stack, prefixes: list[int], per_prefix: int
) -> dict[int, str]:
    """Send each prefix ``per_prefix`` times (round robin over the replicas, each request's
    write awaited before the next), assert each prefix was served by one server, and
    return it per prefix."""
    urls = _metrics_urls(stack)
    written = sum(_counter(u, WRITES) for u in urls)
    served: dict[int, set[str]] = {p: set() for p in prefixes}
    async with aiohttp.ClientSession() as session:
        for question in range(per_prefix):
            for prefix in prefixes:
                async with session.post(
                    f"{stack.url}/v1/completions", data=_prompt(prefix, question)
                ) as response:
                    await response.read()
                    assert response.status == 200, await response.text()
                    served[prefix].add(response.headers[INSTANCE_HEADER])
                written += 1
                await _until_written(urls, int(written))
    assert all(len(servers) == 1 for servers in served.values()), served
    return {prefix: servers.pop() for prefix, servers in served.items()}


class Traffic:
    """Requests sent one after another until stopped; every status kept."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.statuses: list[int] = []
        self._stop = asyncio.Event()

    async def run(self) -> None:
        async with aiohttp.ClientSession() as session:
            question = 0
            while not self._stop.is_set():
                question += 1
                async with session.post(
                    f"{self.stack.url}/v1/completions", data=_prompt(1000 + question % 3, question)
                ) as response:
                    await response.read()
                    self.statuses.append(response.status)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Traffic]:
        task = asyncio.create_task(self.run())
        try:
            yield self
        finally:
            self._stop.set()
            await task

    async def more(self, count: int, what: str) -> None:
        """Wait until ``count`` more requests were answered."""
        sent = len(self.statuses)
        await self.until(lambda: len(self.statuses) >= sent + count, what)

    async def until(self, condition: Callable[[], bool], what: str, within: float = 30.0) -> None:
        """Wait, with traffic flowing, until ``condition()`` holds."""
        deadline = time.monotonic() + within
        while not await asyncio.to_thread(condition):
            assert time.monotonic() < deadline, f"not within {within}s: {what}"
            await asyncio.sleep(0.05)


def _lines(stack: Stack, text: str) -> list[int]:
    """How many log lines of each replica contain ``text``."""
    return [sum(text in line for line in epp.log().splitlines()) for epp in stack.epps]


async def test_redis_killed_and_restarted_empty_during_traffic() -> None:
    _require_redis()
    redis = RedisServer(port=free_port())
    redis.start()
    try:
        with Stack.run(_options(redis.url, "127.0.0.82")) as stack:
            traffic = Traffic(stack)
            async with traffic.running():
                await traffic.until(lambda: len(traffic.statuses) >= 5, "traffic flows")
                assert _gauges(stack) == [0.0] * REPLICAS

                redis.kill()
                await traffic.until(
                    lambda: _gauges(stack) == [1.0] * REPLICAS, "every replica degraded"
                )
                await traffic.more(10, "traffic while down")
                assert await asyncio.to_thread(_all_serving, stack)

                redis.start()  # same port, empty
                await traffic.until(
                    lambda: _gauges(stack) == [0.0] * REPLICAS, "every replica healed"
                )
                # The shared load heals on its own timer (its retry backs off up to 1 s).
                await traffic.until(
                    lambda: min(_lines(stack, HEAL_LINES[1])) >= 1, "every replica's load healed"
                )
                await traffic.more(5, "traffic after the heal")
                assert await asyncio.to_thread(_all_serving, stack)
            assert traffic.statuses, "no request sent"
            assert set(traffic.statuses) == {200}, traffic.statuses
            changes = [
                [line for line in epp.log().splitlines() if "shared" in line] for epp in stack.epps
            ]
            for text in (*DEGRADE_LINES, *HEAL_LINES):
                assert _lines(stack, text) == [1] * REPLICAS, (text, changes)
            # Sharing again: a new prefix through every replica lands on one server.
            await _one_server_per_prefix(stack, [2000, 2001], per_prefix=4)
    finally:
        redis.close()


async def test_a_cluster_master_killed_during_traffic_fails_over_to_its_replica() -> None:
    """3 masters with a replica each; one master is SIGKILLed. The cluster answers
    ``CLUSTERDOWN`` until the replica is promoted (the 2 s node timeout, then an election):
    the replicas degrade and route on local state, every request is answered, and they heal
    on the promoted replica, which kept the data: the prefixes placed before still go to
    their servers."""
    _require_redis()
    cluster = RedisCluster(replicas=1)
    cluster.start()
    try:
        with Stack.run(_options(cluster.url, "127.0.0.112")) as stack:
            placed = await _one_server_per_prefix(stack, [5000, 5001], per_prefix=2)
            traffic = Traffic(stack)
            async with traffic.running():
                await traffic.until(lambda: len(traffic.statuses) >= 5, "traffic flows")
                victim = next(n for n in cluster.nodes if cluster.role(n) == "master")
                replica_roles = [cluster.role(n) for n in cluster.nodes]
                victim.kill()
                await traffic.until(
                    lambda: (
                        [cluster.role(n) for n in cluster.nodes if n is not victim].count("master")
                        == replica_roles.count("master")
                    ),
                    "a replica promoted",
                )
                await traffic.until(
                    lambda: _gauges(stack) == [0.0] * REPLICAS, "every replica healthy"
                )
                await traffic.more(5, "traffic after failover")
                assert await asyncio.to_thread(_all_serving, stack)
            assert set(traffic.statuses) == {200}, traffic.statuses
            # Every replica saw the outage (CLUSTERDOWN) and healed from it.
            for text in (DEGRADE_LINES[0], HEAL_LINES[0]):
                assert min(_lines(stack, text)) >= 1, (text, _lines(stack, text))
            # The promoted replica kept what was placed: the old prefixes go where they went.
            after = await _one_server_per_prefix(stack, [5000, 5001, 5002], per_prefix=2)
            assert {p: after[p] for p in placed} == placed
    finally:
        cluster.close()


@pytest.fixture(scope="module")
def redis_cluster() -> Iterator[RedisCluster]:
    _require_redis()
    cluster = RedisCluster()
    cluster.start()
    yield cluster
    cluster.close()


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RedisServer, Path]]:
    _require_redis()
    files = make_tls_files(Path(tmp_path_factory.mktemp("redis-tls")))
    server = RedisServer(tls=files)
    server.start()
    yield server, files.ca_cert
    server.close()


async def test_replicas_on_a_redis_cluster_share_prefixes(redis_cluster: RedisCluster) -> None:
    with Stack.run(_options(redis_cluster.url, "127.0.0.92")) as stack:
        await _one_server_per_prefix(stack, [3000, 3001], per_prefix=3)
        assert _gauges(stack) == [0.0] * REPLICAS


async def test_replicas_on_tls_redis_share_prefixes(tls_redis: tuple[RedisServer, Path]) -> None:
    server, ca = tls_redis
    url = f"rediss://{server.address}?ssl_ca_certs={ca}"
    with Stack.run(_options(url, "127.0.0.102")) as stack:
        await _one_server_per_prefix(stack, [4000, 4001], per_prefix=3)
        assert _gauges(stack) == [0.0] * REPLICAS
