"""Several EPP replicas behind one Envoy, sharing their state on one real redis-server.

Envoy's ``epp`` cluster lists three EPP processes, round robin, so consecutive requests are
routed by different replicas. With ``--redis-url`` they share the prefix index: every
request of one long prompt prefix lands on the model server the first one went to. Without
it each replica learns alone, and the same traffic spreads (the control).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Sequence

import aiohttp
import orjson
import pytest

from tests.simulator import DEFAULT_MODEL, INSTANCE_HEADER
from tests.support.redis import RedisServer
from tests.support.stack import Stack, StackOptions
from tests.support.stack import metric_sum as _counter
from tests.support.stack import replica_metrics_urls as _metrics_urls

pytestmark = pytest.mark.e2e

REPLICAS = 3
#: Distinct long prefixes, each sent through every replica.
PREFIXES = 4
PER_PREFIX = 6


def _prompt(prefix: int, question: int) -> bytes:
    system = f"[tenant {prefix}] You answer questions about Kubernetes, briefly and exactly. "
    prompt = system * 40 + f"Question {question}: what is object number {question}?"
    return orjson.dumps({"model": DEFAULT_MODEL, "prompt": prompt, "max_tokens": 1})


async def _send_all(stack: Stack, *, shared: bool) -> dict[int, list[str]]:
    """Send every prefix's requests one at a time; which server served each, per prefix.
    With shared state, each request's write to Redis is awaited before the next request
    (the EPPs' acknowledged-writes counters), so no request races the previous one's add."""
    urls = _metrics_urls(stack)
    served: dict[int, list[str]] = {p: [] for p in range(PREFIXES)}
    sent = 0
    async with aiohttp.ClientSession() as session:
        for question in range(PER_PREFIX):
            for prefix in range(PREFIXES):
                async with session.post(
                    f"{stack.url}/v1/completions", data=_prompt(prefix, question)
                ) as response:
                    await response.read()
                    assert response.status == 200, await response.text()
                    served[prefix].append(response.headers[INSTANCE_HEADER])
                sent += 1
                if shared:
                    await _until_written(urls, sent)
    return served


async def _until_written(urls: Sequence[str], count: int) -> None:
    deadline = time.monotonic() + 10.0
    name = "inference_extension_shared_state_writes_total"
    while True:
        written = await asyncio.to_thread(lambda: sum(_counter(u, name) for u in urls))
        if written >= count:
            return
        assert time.monotonic() < deadline, f"{written} of {count} writes reached redis"
        await asyncio.sleep(0.01)


def _requests_per_replica(stack: Stack) -> list[float]:
    return [_counter(url, "inference_objective_request_total") for url in _metrics_urls(stack)]


async def test_replicas_sharing_redis_send_one_prefix_to_one_server(redis: RedisServer) -> None:
    options = StackOptions(
        simulators=3,
        simulator_base_ip="127.0.0.62",
        epp_replicas=REPLICAS,
        epp_args=[
            "--redis-url",
            redis.url,
            "--redis-key-prefix",
            f"epp:e2e-{uuid.uuid4().hex[:8]}",
            # A loaded test machine can pause a process for more than the 5 ms default;
            # a miss would route on the replica's own index (or keep a pick without its
            # claim) and make the test flaky.
            "--redis-deadline",
            "1s",
            "--redis-claim-deadline",
            "1s",
        ],
    )
    with Stack.run(options) as stack:
        served = await _send_all(stack, shared=True)
        per_replica = _requests_per_replica(stack)
        burst = await _send_burst(stack)
    assert all(count > 0 for count in per_replica), per_replica  # every replica routed
    assert sum(per_replica) == PREFIXES * PER_PREFIX
    for prefix, servers in served.items():
        assert len(set(servers)) == 1, (prefix, servers)
    # New prefixes sent all at once through every replica: each replica matched before any
    # had written, and the claim made them agree.
    for prefix, servers in burst.items():
        assert len(set(servers)) == 1, (prefix, servers)


async def _send_burst(stack: Stack) -> dict[int, list[str]]:
    """Every request of 4 x ``PREFIXES`` new prefixes at once; which server served each."""
    served: dict[int, list[str]] = {p: [] for p in range(100, 100 + 4 * PREFIXES)}
    async with aiohttp.ClientSession() as session:

        async def send(prefix: int, question: int) -> None:
            url = f"{stack.url}/v1/completions"
            async with session.post(url, data=_prompt(prefix, question)) as response:
                await response.read()
                assert response.status == 200, await response.text()
                served[prefix].append(response.headers[INSTANCE_HEADER])

        await asyncio.gather(*(send(p, q) for q in range(PER_PREFIX) for p in served))
    return served


async def test_replicas_alone_spread_one_prefix_over_servers() -> None:
    """The control: the same traffic without --redis-url. Each replica's first request of
    a prefix is its own choice (random among equal scores), so all of a prefix's requests
    land on one server only if every replica guessed the same; with 4 prefixes and 3
    replicas, "no prefix split" has a probability of about (1/9)^4."""
    options = StackOptions(simulators=3, simulator_base_ip="127.0.0.72", epp_replicas=REPLICAS)
    with Stack.run(options) as stack:
        served = await _send_all(stack, shared=False)
        per_replica = _requests_per_replica(stack)
    assert all(count > 0 for count in per_replica), per_replica
    assert any(len(set(servers)) > 1 for servers in served.values()), served


SESSION_CONFIG = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: session-affinity-filter
  parameters: {strategy: session_id}
- type: random-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: session-affinity-filter
  - pluginRef: random-picker
"""


async def test_replicas_sharing_redis_share_session_bindings(redis: RedisServer) -> None:
    """x-session-id bindings live in Redis: a session's requests, routed by every replica in
    turn, all go where its first one went (the picker alone is random)."""
    options = StackOptions(
        simulators=3,
        simulator_base_ip="127.0.0.82",
        epp_replicas=REPLICAS,
        epp_args=[
            "--config-text",
            SESSION_CONFIG,
            "--redis-url",
            redis.url,
            "--redis-key-prefix",
            f"epp:e2e-{uuid.uuid4().hex[:8]}",
            "--redis-deadline",
            "500ms",  # a loaded test machine can pause a process longer than 5 ms
            "--redis-claim-deadline",
            "500ms",
        ],
    )
    body = orjson.dumps({"model": DEFAULT_MODEL, "prompt": "hi", "max_tokens": 1})
    with Stack.run(options) as stack:
        served: dict[str, list[str]] = {}
        async with aiohttp.ClientSession() as session:
            for _ in range(3 * REPLICAS):
                for chat in ("chat-1", "chat-2", "chat-3"):
                    async with session.post(
                        f"{stack.url}/v1/completions", data=body, headers={"x-session-id": chat}
                    ) as response:
                        await response.read()
                        assert response.status == 200, await response.text()
                        served.setdefault(chat, []).append(response.headers[INSTANCE_HEADER])
        per_replica = _requests_per_replica(stack)
    assert all(count > 0 for count in per_replica), per_replica
    for chat, servers in served.items():
        assert len(set(servers)) == 1, (chat, servers)
