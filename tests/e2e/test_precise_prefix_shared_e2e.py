"""Precise prefix-cache routing by two EPP replicas sharing one KV-block index on Redis.

Two replicas behind one Envoy (round robin) run ``precise-prefix-cache-producer`` with
``--redis-url``: both follow the simulators' KV events and route a repeated prompt to the
server holding it; the pool's copy of the index lands in Redis, written once per event by
the one replica holding each endpoint's writer lease, not by both. A replica that starts
later routes warm from that copy on its first request, and a replica that stops hands its
writer leases over at once. With speculative entries on, a burst of new prompts sent
through three replicas at once puts each prompt on one server (the shared claim).
"""

from __future__ import annotations

import asyncio
import time
import urllib.request
import uuid
from pathlib import Path

import aiohttp
import pytest

from tests.e2e.test_precise_prefix_e2e import SEED, SYSTEM, _config, _post, _prefix_score
from tests.simulator import DEFAULT_MODEL, INSTANCE_HEADER
from tests.support.redis import RedisServer
from tests.support.stack import (
    Stack,
    StackOptions,
    free_port,
    metric_sum,
    replica_metrics_urls,
    wait_for,
)
from tests.support.tokenizer import write_tokenizer_json

pytestmark = pytest.mark.e2e

BASE_IP = "127.0.0.56"


def _simulator_args(tokenizer: Path, port: int) -> list[str]:
    """Simulators publishing KV events on ``port``, hashing as the EPP's config says."""
    return [
        "--kv-events-port", str(port),
        "--tokenizer", str(tokenizer),
        "--hash-seed", SEED,
        "--block-size", "16",
    ]  # fmt: skip


async def test_replicas_share_the_kv_block_index_on_redis(
    tmp_path: Path, redis: RedisServer
) -> None:
    tokenizer = write_tokenizer_json(tmp_path / "tokenizer.json")
    port = free_port(BASE_IP)
    prefix = f"epp:e2e-{uuid.uuid4().hex[:8]}"
    options = StackOptions(
        simulators=3,
        simulator_base_ip=BASE_IP,
        simulator_args=_simulator_args(tokenizer, port),
        epp_replicas=2,
        epp_args=[
            "--config-text", _config(tokenizer, port),
            "--explain-decisions",
            "--redis-url", redis.url,
            "--redis-key-prefix", prefix,
        ],
    )  # fmt: skip
    with Stack.run(options) as stack:
        async with aiohttp.ClientSession() as session:
            # until both replicas' subscribers are connected, events can be missed
            deadline = time.monotonic() + 30
            streak, home = 0, ""
            while streak < 4:  # round robin: both replicas, twice each
                assert time.monotonic() < deadline, "the replicas never agreed on the holder"
                served, decision = await _post(session, stack.url, SYSTEM)
                full = _prefix_score(decision, stack.simulator_addresses[served]) == 1.0
                streak = streak + 1 if full and served == home else 0
                home = served if full else ""
            # more events: prompts of their own, each a stored run on its server
            for i in range(12):
                other = " ".join(f"note{i} about cache block {j}" for j in range(20))
                await _post(session, stack.url, other)
        # the copy in Redis: the holder's blocks, and one writer per endpoint with events
        deadline = time.monotonic() + 10
        while True:
            leases = redis.cli("--scan", "--pattern", f"{prefix}:kv:*:w").split()
            copies = redis.cli("--scan", "--pattern", f"{prefix}:kv:*:o").split()
            sizes = [int(redis.cli("ZCARD", key)) for key in copies]
            if leases and sizes and max(sizes) >= len(SYSTEM) // 64:
                break
            assert time.monotonic() < deadline, (leases, copies, sizes)
            await asyncio.sleep(0.05)
        owners = {redis.cli("HGET", key, "owner").strip() for key in leases}
        assert len(owners) <= 2
        assert all(owners)
        # the copies hold what the replicas' own indexes hold: every event was written
        urls = replica_metrics_urls(stack)
        deadline = time.monotonic() + 10
        while True:
            copies = redis.cli("--scan", "--pattern", f"{prefix}:kv:*:o").split()
            stored = sum(int(redis.cli("ZCARD", key)) for key in copies)
            local = metric_sum(urls[0], "inference_extension_kv_index_entries")
            if stored == local:
                break
            assert time.monotonic() < deadline, (stored, local)
            await asyncio.sleep(0.05)
        # dedup: the writes are about one replica's events (plus one rewrite per lease
        # taken), not both replicas' events
        events = [metric_sum(u, "inference_extension_kv_events_total") for u in urls]
        writes = sum(metric_sum(u, "inference_extension_shared_state_writes_total") for u in urls)
        assert min(events) >= 12, events
        assert 0 < writes <= max(events) + 2 * len(leases), (writes, events, leases)
        # the index's metrics with the shared copy: entries, events, lag, leases, writes
        for url in urls:
            assert metric_sum(url, "inference_extension_kv_index_entries") > 0
            assert metric_sum(url, "inference_extension_kv_events_lag_seconds_count") >= 12
            assert _exported(url, "inference_extension_kv_index_pending_writes")
            assert _exported(url, "inference_extension_kv_index_loaded_blocks_total")
        held = sum(metric_sum(u, "inference_extension_kv_index_writer_leases") for u in urls)
        assert held == len(leases) == 3
        # and gaps: a server loses a batch for good, every replica sees the hole
        sim = stack.simulator_urls[home]
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{sim}/sim/kv-events/drop?count=1&replayable=false") as r:
                assert r.status == 200
            for i in range(2):  # a lost batch, then one that shows the gap
                body = {"model": DEFAULT_MODEL, "prompt": f"gap {i} " * 40, "max_tokens": 1}
                async with session.post(f"{sim}/v1/completions", json=body) as r:
                    assert r.status == 200
        wait_for(
            lambda: all(
                metric_sum(u, "inference_extension_kv_events_gaps_total") >= 1 for u in urls
            ),
            timeout=10,
            what="the gap on both replicas",
        )


def _exported(url: str, name: str) -> bool:
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    return any(line.startswith((f"{name} ", f"{name}{{")) for line in text.splitlines())


async def test_a_new_replica_routes_warm_at_once_and_a_stopped_one_hands_over(
    tmp_path: Path, redis: RedisServer
) -> None:
    tokenizer = write_tokenizer_json(tmp_path / "tokenizer.json")
    port = free_port(BASE_IP)
    prefix = f"epp:e2e-{uuid.uuid4().hex[:8]}"
    epp_args = [
        "--config-text", _config(tokenizer, port),
        "--explain-decisions",
        "--redis-url", redis.url,
        "--redis-key-prefix", prefix,
    ]  # fmt: skip
    first_options = StackOptions(
        simulators=3,
        simulator_base_ip=BASE_IP,
        simulator_args=_simulator_args(tokenizer, port),
        epp_args=epp_args,
    )  # fmt: skip
    with Stack.run(first_options) as first:
        async with aiohttp.ClientSession() as session:
            # until the subscribers are connected, events can be missed
            deadline = time.monotonic() + 30
            streak, holder = 0, ""
            while streak < 2:
                assert time.monotonic() < deadline, "the replica never found the holder"
                served, decision = await _post(session, first.url, SYSTEM)
                full = _prefix_score(decision, first.simulator_addresses[served]) == 1.0
                streak = streak + 1 if full and served == holder else 0
                holder = served if full else ""

        def leases() -> dict[str, str]:
            keys = redis.cli("--scan", "--pattern", f"{prefix}:kv:*:w").split()
            return {key: redis.cli("HGET", key, "owner").strip() for key in keys}

        def copied() -> bool:
            copies = redis.cli("--scan", "--pattern", f"{prefix}:kv:*:o").split()
            return (
                max((int(redis.cli("ZCARD", key)) for key in copies), default=0)
                >= len(SYSTEM) // 64
            )

        wait_for(lambda: len(leases()) == 3 and copied(), timeout=10, what="the shared copy")
        first_owner = set(leases().values())
        assert len(first_owner) == 1
        assert all(first_owner)
        # a new replica, on the same servers and Redis, with its own Envoy
        second_options = StackOptions(
            simulators=0,
            extra_endpoints=list(first.simulator_addresses.values()),
            epp_args=epp_args,
        )
        with Stack.run(second_options) as second:
            async with aiohttp.ClientSession() as session:
                served, decision = await _post(session, second.url, SYSTEM)  # its first
            # warm: it sees the holder's blocks, and goes to a server holding them all (the
            # warm-up may have left the prompt on a second server too: either is warm)
            assert _prefix_score(decision, first.simulator_addresses[holder]) == 1.0, decision
            assert _prefix_score(decision, first.simulator_addresses[served]) == 1.0, decision
            loaded = metric_sum(
                second.epp_metrics_url, "inference_extension_kv_index_loaded_blocks_total"
            )
            assert loaded >= len(SYSTEM) // 64
            # the first replica stops: its leases are released and the second one takes
            # them at its next claim (every 3.3 s), not once they lapse (10 s)
            assert first.epp is not None
            assert first.epp.stop() == 0
            stopped = time.monotonic()

            def taken_over() -> bool:
                owners = set(leases().values())
                return len(owners) == 1 and "" not in owners and not owners & first_owner

            wait_for(taken_over, timeout=10, what="the second replica to take the leases")
            assert time.monotonic() - stopped < 6.0


async def test_a_burst_of_new_prompts_through_three_replicas_lands_on_one_server_each(
    tmp_path: Path, redis: RedisServer
) -> None:
    """Each new prompt is sent six times at once, round robin over three replicas: every
    replica matches it before any server has prefilled it (no events yet), and without
    the shared claim each replica's pick of equal scores is its own (a prompt stays on one
    server with a chance of 1 in 9; for all four, about 1 in 6,500)."""
    tokenizer = write_tokenizer_json(tmp_path / "tokenizer.json")
    port = free_port("127.0.0.136")
    options = StackOptions(
        simulators=3,
        simulator_base_ip="127.0.0.136",
        simulator_args=_simulator_args(tokenizer, port),
        epp_replicas=3,
        epp_args=[
            "--config-text", _config(tokenizer, port, speculative_ttl="2s"),
            "--redis-url", redis.url,
            "--redis-key-prefix", f"epp:e2e-{uuid.uuid4().hex[:8]}",
            # a loaded test machine can pause a process longer than the defaults
            "--redis-deadline", "500ms",
            "--redis-claim-deadline", "500ms",
        ],
    )  # fmt: skip
    prompts = {p: f"Burst {p} asks: {SYSTEM}" for p in range(4)}
    served: dict[int, list[str]] = {p: [] for p in prompts}
    with Stack.run(options) as stack:
        async with aiohttp.ClientSession() as session:

            async def send(prompt: int) -> None:
                body = {"model": DEFAULT_MODEL, "prompt": prompts[prompt], "max_tokens": 1}
                async with session.post(f"{stack.url}/v1/completions", json=body) as response:
                    assert response.status == 200, await response.text()
                    served[prompt].append(response.headers[INSTANCE_HEADER])

            await asyncio.gather(*(send(p) for _ in range(6) for p in prompts))
        per_replica = [
            metric_sum(url, "inference_objective_request_total")
            for url in replica_metrics_urls(stack)
        ]
    assert all(count > 0 for count in per_replica), per_replica  # every replica routed
    for prompt, servers in served.items():
        assert len(set(servers)) == 1, (prompt, servers)
