"""Three EPP replicas behind one Envoy, flow control over the pool on one redis-server
(``concurrency-detector`` and ``max-min-fairness-policy``), two tenants keeping the pool
saturated, while the shared store fails: Redis flushed, then SIGKILLed and restarted empty.
Every request is answered 200; each replica logs the shared load's failure and its heal
once each way; and with Redis back, every replica publishes its flows again (one flow
hash per replica in Redis while the traffic runs)."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable

import aiohttp
import orjson
import pytest
import yaml
from redis.asyncio import Redis

from app.config.loader import DEFAULT_CONFIG
from tests.e2e.test_shared_state_faults_e2e import _all_serving, _lines
from tests.simulator import DEFAULT_MODEL
from tests.support.redis import RedisServer, redis_available
from tests.support.stack import Stack, StackOptions, free_port, trusted_header

pytestmark = pytest.mark.e2e

REPLICAS = 3
FAIRNESS_HEADER = trusted_header("x-gateway-inference-fairness-id")
FAILED = "shared load: redis failed"
HEALED = "shared load: redis answers again"
MAX_MIN = "max-min-fairness-policy"


def _config() -> str:
    config = {
        "featureGates": ["flowControl"],
        "plugins": [
            *DEFAULT_CONFIG["plugins"],
            {"type": "concurrency-detector", "parameters": {"maxConcurrency": 2}},
            {"type": MAX_MIN},
        ],
        "schedulingProfiles": DEFAULT_CONFIG["schedulingProfiles"],
        "saturationDetector": {"pluginRef": "concurrency-detector"},
        "flowControl": {
            "defaultRequestTTL": "60s",
            "defaultPriorityBand": {"fairnessPolicyRef": MAX_MIN},
        },
    }
    return yaml.safe_dump(config)


class Tenants:
    """Closed-loop clients of two tenants until stopped; every status kept."""

    def __init__(self, stack: Stack, clients: int) -> None:
        self.stack = stack
        self.clients = clients
        self.statuses: list[int] = []
        self._stop = asyncio.Event()

    async def _client(self, session: aiohttp.ClientSession, tenant: str, index: int) -> None:
        question = 0
        while not self._stop.is_set():
            question += 1
            body = orjson.dumps(
                {
                    "model": DEFAULT_MODEL,
                    "prompt": f"{tenant} client {index} question {question}",
                    "max_tokens": 4,
                }
            )
            async with session.post(
                f"{self.stack.url}/v1/completions", data=body, headers={FAIRNESS_HEADER: tenant}
            ) as response:
                await response.read()
                self.statuses.append(response.status)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Tenants]:
        async with aiohttp.ClientSession() as session:
            tasks = [
                asyncio.create_task(self._client(session, tenant, i))
                for tenant in ("tenant-a", "tenant-b")
                for i in range(self.clients)
            ]
            try:
                yield self
            finally:
                self._stop.set()
                await asyncio.gather(*tasks)

    async def until(self, condition: Callable[[], bool], what: str, within: float = 30.0) -> None:
        deadline = time.monotonic() + within
        while not await asyncio.to_thread(condition):
            assert time.monotonic() < deadline, f"not within {within}s: {what}"
            await asyncio.sleep(0.05)

    async def more(self, count: int, what: str) -> None:
        sent = len(self.statuses)
        await self.until(lambda: len(self.statuses) >= sent + count, what)


async def _flow_hashes(redis: RedisServer, prefix: str) -> int:
    """How many processes' flow hashes Redis holds now (an operator's ``redis-cli``)."""
    client = Redis.from_url(redis.url)
    try:
        return len(await client.keys(f"{prefix}:load:*:a:*"))
    finally:
        await client.aclose()


async def test_flow_control_over_the_pool_survives_a_flush_and_a_restart() -> None:
    if not redis_available():
        pytest.fail("redis-server and redis-cli are not on PATH: run `make install`")
    redis = RedisServer(port=free_port())
    redis.start()
    prefix = f"epp:e2e-{uuid.uuid4().hex[:8]}"
    options = StackOptions(
        simulators=3,
        simulator_base_ip="127.0.0.83",
        epp_replicas=REPLICAS,
        epp_args=[
            "--config-text",
            _config(),
            "--redis-url",
            redis.url,
            "--redis-key-prefix",
            prefix,
            "--redis-deadline",
            "200ms",
            "--redis-claim-deadline",
            "200ms",
        ],
    )
    try:
        with Stack.run(options) as stack:
            tenants = Tenants(stack, clients=6)  # 12 in flight against the pool's 6
            async with tenants.running():
                await tenants.more(20, "traffic flows")

                async def every_replica_publishes() -> None:
                    deadline = time.monotonic() + 30
                    while await _flow_hashes(redis, prefix) < REPLICAS:
                        assert time.monotonic() < deadline, "not every replica's flows in Redis"
                        await asyncio.sleep(0.05)

                await every_replica_publishes()

                client = Redis.from_url(redis.url)
                await client.flushall()
                await client.aclose()
                await tenants.more(20, "traffic after the flush")
                await every_replica_publishes()  # written again without a restart

                redis.kill()
                await tenants.until(
                    lambda: min(_lines(stack, FAILED)) >= 1, "every replica saw Redis fail"
                )
                await tenants.more(20, "traffic while Redis is down")
                assert await asyncio.to_thread(_all_serving, stack)

                redis.start()  # same port, empty
                await tenants.until(lambda: min(_lines(stack, HEALED)) >= 1, "every replica healed")
                await every_replica_publishes()
                await tenants.more(20, "traffic after the heal")
            assert set(tenants.statuses) == {200}, sorted(set(tenants.statuses))
            assert _lines(stack, FAILED) == [1] * REPLICAS
            assert _lines(stack, HEALED) == [1] * REPLICAS
    finally:
        redis.close()
