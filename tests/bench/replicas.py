"""Benchmark (not a test): N EPP replicas behind one Envoy, with and without shared state.

Runs ``tests.bench.routing_quality``'s shared-prefix workload (same flags, same defaults)
through one Envoy whose ``epp`` cluster lists the EPP replicas, round robin per ext_proc
stream (``tests.support.stack``, ``epp_replicas``), each column on a fresh stack:

- ``1 replica``: one EPP, default profile, no ``--redis-url``;
- ``3 local``: three EPPs, each with its own in-process state;
- ``3 redis``: three EPPs on one real ``redis-server`` (``tests.support.redis``);
- ``3 cluster``: three EPPs on a 3-master Redis Cluster (``redis+cluster://``);
- ``3 redis, gate estimate`` (``redis-est``): ``3 redis`` with ``--redis-shared-admission=false``:
  ``kv-capacity-gate`` counts the other replicas' requests by their published uncached
  tokens instead of the pool's KV blocks;
- ``redisN`` (any N, e.g. ``redis8``): N EPPs on one ``redis-server``, the shipped default
  otherwise; ``--replicas 1,2,4,8`` runs ``redis1,redis2,redis4,redis8,pod2`` (the scaling
  curve of issue 39, item 6);
- ``podN`` (e.g. ``pod2``): one EPP with ``--workers N`` (a pod of N worker processes) on
  one ``redis-server``.

The requests come from ``--tenants`` (2) fairness ids (``x-gateway-inference-fairness-id``)
at equal offered load: the workload's requests dealt out in turn, each tenant with an equal
share of ``--concurrency``'s closed-loop users (``--tenants 0``: no header, one queue).

Prints routing_quality's table (hit rate from the simulators' own counters, simulated TTFT,
requests per instance, instances per group, ...) and, per column:

- requests per instance max/min;
- the scheduler's decision latency p50/p99 (``inference_extension_scheduler_e2e_duration_
  seconds``: the profiles' filters, scorers and picker; it does not include the PrepareData
  step where the prefix match waits for Redis);
- the shared prefix match's round trip p50/p99
  (``inference_extension_shared_state_roundtrip_seconds{operation="match"}``: what Redis adds
  to a decision; answered matches only, a miss costs the whole ``--redis-deadline``), and
  the deadline misses, errors, dropped writes and the degraded gauge, summed over replicas;
- EPP CPU seconds per 1,000 requests (user + system from ``/proc/<pid>/stat``, summed over
  the replicas and their worker processes, from the start of the traffic to its end:
  background refreshes included), and the replicas' CPU without traffic (seconds per
  second, over 2 s before it);
- each tenant's share of the requests completed while every tenant still had requests to
  send (equal load: 1/tenants each), and its client TTFT p90;
- Redis round trips per request: the redis-server's (every node's) reply writes
  (``total_writes_processed``, one per client per event-loop turn, so one per round trip
  unless a client's round trips overlap) and commands (``total_commands_processed``,
  counting the commands a script calls) over the traffic, divided by the requests
  answered; both include the background traffic (load sync, leases), whose rate without
  requests is given too (round trips per second, over the idle window), and the round
  trips per second of traffic per replica (a pod counts as one);
- how many ``GET /metrics`` each model server answered per second of traffic (every
  replica scrapes every server: 3 replicas, three times one's);
- Envoy's ext_proc faults (failed streams, message timeouts, rejected header mutations:
  counted, where a test would fail);
- the machine's 1-minute load average at the end of the column (other processes' load
  slows the simulators' wall-clock queues, and so the simulated TTFT).

Percentiles from the EPPs' histograms are interpolated within buckets (as Prometheus'
``histogram_quantile`` does), over all replicas' buckets summed. Timing figures are noisy
on a shared machine: compare the columns of one run.

``--repeat N`` runs the columns N times, interleaved, prints each run's table, then each
column's hit rate, simulated TTFT p90 and groups per server in every run, its medians
against the first column's, and the p90 of all its runs' requests taken together against
the first column's: one run's p90 moves by about 10% between runs of one column whose groups
landed the same way, so judge the 5% target on 8 runs or more.

``--fail-open`` runs another scenario instead: 3 replicas on one ``redis-server`` under the
same traffic; the server is SIGKILLed when a third of the requests have been sent and
restarted empty on the same port at two thirds. Prints, per phase (before, Redis down,
after), requests sent, statuses, hit rate and TTFT (the simulators' counter deltas between
the phase boundaries: requests still running at a boundary count in the next phase), the
shared-state metrics' deltas, and when the replicas switched to degraded and back.

    .venv/bin/python -m tests.bench.replicas [--quick] [--columns 1,local,redis,cluster]
        [--replicas 1,2,4,8]  # N EPPs on one redis-server, and pod2
        [--tenants 2]  # fairness ids at equal load (0: none)
        [--columns 1,redis,redis@50ms]  # a column with another --redis-deadline
        [--columns 1,cluster,cluster@5ms/50ms]  # ... and another --redis-claim-deadline
        [--repeat 3]  # medians of 3 interleaved runs
    .venv/bin/python -m tests.bench.replicas --fail-open [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import re
import statistics
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from app.config.loader import DEFAULT_CONFIG
from tests.bench.load import cpu_seconds
from tests.bench.pod import pod_pids
from tests.bench.routing_quality import (
    ClientRecord,
    Outcome,
    add_workload_arguments,
    build_workload,
    describe,
    finish_workload_arguments,
    percentile,
    print_table,
    send_one,
    sim_stats,
    simulator_args,
    stream_completion,
    summarise,
)
from tests.support.redis import RedisCluster, RedisServer, redis_available
from tests.support.stack import Stack, StackOptions, trusted_header

REPLICAS = 3
#: Column key → (label, replicas, redis kind or None).
COLUMNS: dict[str, tuple[str, int, str | None]] = {
    "1": ("1 replica", 1, None),
    "local": ("3 local", REPLICAS, None),
    "redis": ("3 redis", REPLICAS, "server"),
    "cluster": ("3 cluster", REPLICAS, "cluster"),
    "redis-est": ("3 redis, gate estimate", REPLICAS, "server"),
    "1-nogate": ("1 replica, no gate", 1, None),
    "redis-nogate": ("3 redis, no gate", REPLICAS, "server"),
    "redis-scrape1": ("3 redis, scrapes of 1", REPLICAS, "server"),
}
#: Column key → more EPP flags: ``redis-est`` keeps kv-capacity-gate (and flow control) per
#: process, counting the other replicas' requests by their published uncached tokens.
DEFAULT_COLUMNS = ("1", "local", "redis", "cluster", "redis-est")
#: ``1-nogate`` and ``redis-nogate`` run the default without ``kv-capacity-gate``: what the
#: gate itself costs the hit rate, apart from Redis.
NO_GATE_CONFIG = json.dumps(
    {
        **DEFAULT_CONFIG,
        "plugins": [p for p in DEFAULT_CONFIG["plugins"] if p["type"] != "kv-capacity-gate"],
    }
)
COLUMN_FLAGS: dict[str, list[str]] = {
    "redis-est": ["--redis-shared-admission=false"],
    "1-nogate": ["--config-text", NO_GATE_CONFIG],
    "redis-nogate": ["--config-text", NO_GATE_CONFIG],
    # each replica scrapes REPLICAS times less often: each server gets one replica's scrapes
    "redis-scrape1": ["--refresh-metrics-interval", f"{50 * REPLICAS}ms"],
}
#: ``redisN``: N EPPs on one redis-server; ``podN``: one EPP with ``--workers N`` on it.
SCALED = re.compile(r"(redis|pod)([1-9][0-9]*)")

FAIRNESS_HEADER = trusted_header("x-gateway-inference-fairness-id")


def column_spec(name: str) -> tuple[str, int, str | None, list[str]] | None:
    """(label, replicas, redis kind, more EPP flags) of column ``name``; None if unknown."""
    if name in COLUMNS:
        label, replicas, kind = COLUMNS[name]
        return label, replicas, kind, list(COLUMN_FLAGS.get(name, []))
    scaled = SCALED.fullmatch(name)
    if scaled is None:
        return None
    count = int(scaled[2])
    if scaled[1] == "redis":
        return f"{count} redis", count, "server", []
    return f"pod of {count}, redis", 1, "server", ["--workers", str(count)]


SCHEDULER = "inference_extension_scheduler_e2e_duration_seconds"
ROUNDTRIP = "inference_extension_shared_state_roundtrip_seconds"
MISSES = "inference_extension_shared_state_deadline_misses_total"
ERRORS = "inference_extension_shared_state_errors_total"
DROPPED = "inference_extension_shared_state_dropped_writes_total"
WRITES = "inference_extension_shared_state_writes_total"
CLAIMS = "inference_extension_shared_state_claims_total"
DEGRADED = "inference_extension_shared_state_degraded"
REQUESTS = "inference_objective_request_total"
KV_GATE_WAIT = "inference_extension_kv_capacity_gate_wait_seconds"
MATCHES = ROUNDTRIP + "_count"
#: Seconds the replicas' CPU is measured without traffic, before it.
IDLE_SECONDS = 2.0


# --- the EPPs' own figures ---


Samples = list[tuple[str, dict[str, str], float]]


def scrape(stack: Stack) -> list[Samples]:
    """Every sample of every replica's /metrics, one list per replica."""
    result = []
    for _, _, port in stack.replica_ports:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            text = response.read().decode()
        result.append(
            [
                (s.name, dict(s.labels), float(s.value))
                for family in text_string_to_metric_families(text)
                for s in family.samples
            ]
        )
    return result


def total(replicas: Sequence[Samples], name: str, **labels: str) -> float:
    """The sum of ``name``'s samples carrying ``labels``, over all replicas."""
    return sum(
        value
        for samples in replicas
        for sample, got, value in samples
        if sample == name and all(got.get(k) == v for k, v in labels.items())
    )


def present(replicas: Sequence[Samples], name: str) -> bool:
    return any(sample == name for samples in replicas for sample, _, _ in samples)


def quantile(replicas: Sequence[Samples], name: str, q: float, **labels: str) -> float:
    """``histogram_quantile(q, sum(name_bucket))`` over the replicas, in seconds."""
    buckets: dict[float, float] = {}
    for samples in replicas:
        for sample, got, value in samples:
            if sample == f"{name}_bucket" and all(got.get(k) == v for k, v in labels.items()):
                bound = float(got["le"])
                buckets[bound] = buckets.get(bound, 0.0) + value
    if not buckets:
        return math.nan
    bounds = sorted(buckets)
    count = buckets[bounds[-1]]
    if not count:
        return math.nan
    rank = q * count
    lower, below = 0.0, 0.0
    for bound in bounds:
        cumulative = buckets[bound]
        if cumulative >= rank:
            if math.isinf(bound):
                return lower  # above the highest finite bucket: its bound, as Prometheus
            inside = cumulative - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 0.0)
        lower, below = bound, cumulative
    return lower


def epp_cpu_seconds(stack: Stack) -> float:
    """User + system CPU seconds of every EPP process (and its workers) so far."""
    used = 0.0
    for epp in stack.epps:
        assert epp.process is not None
        for pid in pod_pids(epp.process.pid):
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                used += cpu_seconds(pid)
    return used


async def scrape_counts(urls: dict[str, str]) -> int:
    """GET /metrics the model servers have answered so far, summed."""
    return sum(d["metrics_scrapes"] for d in (await sim_stats(urls)).values())


# --- Redis ---


@contextlib.contextmanager
def redis_for(kind: str | None) -> Iterator[list[str]]:
    """The EPP flags for ``kind`` (none, one server, a cluster), with the Redis running."""
    if kind is None:
        yield []
        return
    if not redis_available():
        raise SystemExit("redis-server and redis-cli are not on PATH: run `make install`")
    store: RedisServer | RedisCluster = RedisServer() if kind == "server" else RedisCluster()
    try:
        store.start()
        yield ["--redis-url", store.url, "--redis-key-prefix", f"epp:bench-{uuid.uuid4().hex[:8]}"]
    finally:
        store.close()


def redis_commandstats(redis_args: Sequence[str]) -> dict[str, tuple[float, float]]:
    """Per command (``INFO commandstats``, scripts' inner commands included): calls and µs
    so far, summed over every node; empty without Redis."""
    if not redis_args:
        return {}
    import redis

    stats: dict[str, tuple[float, float]] = {}
    for address in redis_args[1].split("://", 1)[1].split(","):
        host, _, port = address.rpartition(":")
        node = redis.Redis(host=host, port=int(port), decode_responses=True)
        try:
            info = node.info("commandstats")
        finally:
            node.close()
        for name, value in info.items():
            if isinstance(value, dict):
                calls, usec = stats.get(name.removeprefix("cmdstat_"), (0.0, 0.0))
                stats[name.removeprefix("cmdstat_")] = (
                    calls + float(value["calls"]),
                    usec + float(value["usec"]),
                )
    return stats


def redis_counters(redis_args: Sequence[str]) -> tuple[float, float, float]:
    """(reply writes, commands, CPU seconds) every node of the Redis in ``redis_args`` has
    processed or used so far (``INFO stats``, ``INFO cpu``: the main thread's user +
    system time); NaN without Redis."""
    if not redis_args:
        return math.nan, math.nan, math.nan
    import redis

    writes = commands = used = 0.0
    for address in redis_args[1].split("://", 1)[1].split(","):
        host, _, port = address.rpartition(":")
        node = redis.Redis(host=host, port=int(port), decode_responses=True)
        try:
            info = node.info("stats")
            cpu = node.info("cpu")
        finally:
            node.close()
        writes += float(info["total_writes_processed"])
        commands += float(info["total_commands_processed"])
        used += float(cpu["used_cpu_user_main_thread"]) + float(cpu["used_cpu_sys_main_thread"])
    return writes, commands, used


# --- tenants ---


@dataclass
class Tenant:
    """One fairness id's requests: its own record and when each answered request ended."""

    name: str
    rec: ClientRecord = field(default_factory=ClientRecord)
    done: list[float] = field(default_factory=list)


async def drive_tenants(
    url: str,
    workload: Sequence[tuple[int, str]],
    concurrency: int,
    max_tokens: int,
    tenants: int,
) -> tuple[list[Tenant], float]:
    """``workload`` dealt out in turn to ``tenants`` fairness ids (0: one, without the
    header), each sent by an equal share of ``concurrency`` closed-loop users."""
    count = max(1, tenants)
    crowd = [Tenant(f"tenant-{chr(ord('a') + i)}" if tenants else "-") for i in range(count)]
    queues: list[asyncio.Queue[tuple[int, str]]] = [asyncio.Queue() for _ in crowd]
    for i, item in enumerate(workload):
        queues[i % count].put_nowait(item)
    connector = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def user(index: int) -> None:
            tenant, queue = crowd[index % count], queues[index % count]
            headers = {FAIRNESS_HEADER: tenant.name} if tenants else None
            while True:
                try:
                    group, prompt = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                answered = await stream_completion(
                    session,
                    url,
                    group,
                    {"prompt": prompt, "max_tokens": max_tokens},
                    tenant.rec,
                    headers,
                )
                if answered is not None:
                    tenant.done.append(time.perf_counter())

        start = time.perf_counter()
        await asyncio.gather(*(user(i) for i in range(max(concurrency, count))))
        elapsed = time.perf_counter() - start
    return crowd, elapsed


def merged(records: Sequence[ClientRecord]) -> ClientRecord:
    """One record of several tenants' requests."""
    out = ClientRecord()
    for rec in records:
        out.ttfb_ms += rec.ttfb_ms
        out.latency_ms += rec.latency_ms
        out.instances.update(rec.instances)
        out.errors.update(rec.errors)
        for group, instances in rec.group_instances.items():
            out.group_instances.setdefault(group, set()).update(instances)
        for group, served in rec.group_requests.items():
            out.group_requests.setdefault(group, Counter()).update(served)
        out.tpot_ms += rec.tpot_ms
        for instance, ttfbs in rec.ttfb_by_instance.items():
            out.ttfb_by_instance.setdefault(instance, []).extend(ttfbs)
        out.prompt_tokens += rec.prompt_tokens
        out.cached_tokens += rec.cached_tokens
        out.sent += rec.sent
        out.answered += rec.answered
    return out


def shares(crowd: Sequence[Tenant]) -> tuple[float, ...]:
    """Each tenant's share of the requests answered while every tenant still had some
    running: up to the first time a tenant's last request ended."""
    if len(crowd) < 2 or not all(t.done for t in crowd):
        return ()
    until = min(max(t.done) for t in crowd)
    counts = [sum(1 for when in t.done if when <= until) for t in crowd]
    return tuple(n / sum(counts) for n in counts)


# --- the side-by-side run ---


@dataclass(frozen=True)
class Column:
    outcome: Outcome
    cpu_per_1k: float
    idle_cpu: float
    load: float
    metrics: list[Samples]
    #: GET /metrics each model server answered per second of traffic, on average
    scrapes_per_s: float = math.nan
    notes: Counter[str] = field(default_factory=Counter)
    holders: Counter[str] = field(default_factory=Counter)
    #: per tenant: its share of the answered requests while all ran, its client TTFT p90
    #: (ms, simulated)
    tenant_share: tuple[float, ...] = ()
    tenant_ttft_p90_ms: tuple[float, ...] = ()
    #: Redis reply writes (≈ round trips) and commands per answered request, over the
    #: traffic; round trips per second without traffic (NaN: no Redis)
    redis_trips_per_request: float = math.nan
    redis_commands_per_request: float = math.nan
    #: the Redis server's main-thread CPU per answered request over the traffic (ms)
    redis_cpu_ms_per_request: float = math.nan
    redis_idle_trips_per_s: float = math.nan
    #: per Redis command: calls and µs per answered request over the traffic (``evalsha``
    #: and ``eval``: the scripts' whole run, their inner commands included)
    redis_commands: dict[str, tuple[float, float]] = field(default_factory=dict)
    #: Envoy's ext_proc fault counters that are not 0 (``Stack.EXTPROC_FAULTS``)
    extproc_faults: dict[str, int] = field(default_factory=dict)


def run_column(key: str, args: argparse.Namespace, workload: Sequence[tuple[int, str]]) -> Column:
    name, _, deadline = key.partition("@")
    spec = column_spec(name)
    assert spec is not None, key
    label, replicas, kind, flags = spec
    more = (args.redis_args.split() if kind else []) + flags
    if deadline:
        label += f" {deadline}"
        deadline, _, claim_deadline = deadline.partition("/")
        more += ["--redis-deadline", deadline]
        if claim_deadline:
            more += ["--redis-claim-deadline", claim_deadline]
    with redis_for(kind) as redis_args:
        options = StackOptions(
            simulators=args.instances,
            simulator_base_ip=args.base_ip,
            simulator_args=simulator_args(args),
            epp_replicas=replicas,
            epp_args=[*redis_args, *more],
            extproc_faults=True,  # counted in the table instead of failing the run
        )
        with Stack.run(options) as stack:
            idle_from = epp_cpu_seconds(stack), time.perf_counter()
            idle_redis = redis_counters(redis_args)
            time.sleep(IDLE_SECONDS)  # a benchmark, not a test: the replicas' idle CPU
            cpu_before = epp_cpu_seconds(stack)
            redis_before = redis_counters(redis_args)
            commands_before = redis_commandstats(redis_args)
            scrapes_before = asyncio.run(scrape_counts(stack.simulator_urls))
            started = time.perf_counter()
            idle_for = started - idle_from[1]
            idle = (cpu_before - idle_from[0]) / idle_for
            crowd, elapsed = asyncio.run(
                drive_tenants(stack.url, workload, args.concurrency, args.max_tokens, args.tenants)
            )
            cpu = epp_cpu_seconds(stack) - cpu_before
            redis_after = redis_counters(redis_args)
            commands_after = redis_commandstats(redis_args)
            stats = asyncio.run(sim_stats(stack.simulator_urls))
            scraped = time.perf_counter() - started
            holders = chain_holders(redis_args)
            metrics = scrape(stack)
            logs = [epp.log() for epp in stack.epps]
            load = os.getloadavg()[0]
            faults = {
                name.rsplit(".", 1)[-1]: value
                for name, value in stack.envoy_counters().items()
                if name.rsplit(".", 1)[-1] in Stack.EXTPROC_FAULTS and value
            }
    rec = merged([t.rec for t in crowd])
    outcome = summarise(label, rec, elapsed, stats, args.time_scale)
    done = max(1, outcome.requests)
    scale = args.time_scale if args.time_scale > 0 else 1.0
    return Column(
        outcome=outcome,
        cpu_per_1k=cpu / done * 1000,
        idle_cpu=idle,
        load=load,
        metrics=metrics,
        notes=_notes(logs),
        holders=holders,
        scrapes_per_s=(sum(d["metrics_scrapes"] for d in stats.values()) - scrapes_before)
        / len(stats)
        / scraped,
        tenant_share=shares(crowd) if args.tenants > 1 else (),
        tenant_ttft_p90_ms=tuple(
            percentile([t / scale for t in tenant.rec.ttfb_ms], 0.9) for tenant in crowd
        )
        if args.tenants > 1
        else (),
        redis_trips_per_request=(redis_after[0] - redis_before[0]) / done,
        redis_commands_per_request=(redis_after[1] - redis_before[1]) / done,
        redis_cpu_ms_per_request=(redis_after[2] - redis_before[2]) / done * 1000,
        redis_idle_trips_per_s=(redis_before[0] - idle_redis[0]) / idle_for,
        redis_commands={
            name: (
                (calls - commands_before.get(name, (0.0, 0.0))[0]) / done,
                (usec - commands_before.get(name, (0.0, 0.0))[1]) / done,
            )
            for name, (calls, usec) in commands_after.items()
        },
        extproc_faults=faults,
    )


def chain_holders(redis_args: Sequence[str]) -> Counter[str]:
    """What Redis says of the chains at the end: how many endpoints hold each chain's first
    block (``"held by N"``) and how many first blocks each endpoint holds (by name); empty
    without Redis."""
    if not redis_args:
        return Counter()
    import redis

    url, prefix = redis_args[1], redis_args[3]
    found: Counter[str] = Counter()
    for address in url.split("://", 1)[1].split(","):
        host, _, port = address.rpartition(":")
        node = redis.Redis(host=host, port=int(port), decode_responses=True)
        try:
            for key in node.scan_iter(match=f"{prefix}:c:*", count=1000):
                root = str(key).rpartition("{")[2].rstrip("}")
                first = node.hget(key, root)  # the chain's first block: "<ms> <name>" lines
                if first:
                    names = [line.partition(" ")[2] for line in str(first).splitlines()]
                    found[f"held by {len(names)}"] += 1
                    found.update(names)
        finally:
            node.close()
    return found


#: The shared state's log lines worth counting (a change of health, a failure).
_NOTABLE = ("shared prefix index", "shared load")


def _notes(logs: Sequence[str]) -> Counter[str]:
    """The shared state's warnings and changes in the replicas' logs, counted by their
    text up to the first digit or colon-separated detail (so reasons group together)."""
    found: Counter[str] = Counter()
    for log in logs:
        for line in log.splitlines():
            at = min((line.find(n) for n in _NOTABLE if n in line), default=-1)
            if at < 0:
                continue
            text = line[at:].split(" request_id=")[0].strip().strip('"}')
            found[text[:160]] += 1
    return found


def _num(value: float, digits: int = 2) -> str:
    return "-" if math.isnan(value) else f"{value:.{digits}f}"


def _ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1e3:.2f}"


def extra_rows(columns: Sequence[Column]) -> list[tuple[str, list[str]]]:
    def every(render: Callable[[Column], str]) -> list[str]:
        return [render(c) for c in columns]

    def shared(render: Callable[[list[Samples]], str]) -> list[str]:
        return [render(c.metrics) if present(c.metrics, WRITES) else "-" for c in columns]

    def spread(c: Column) -> str:
        counts = sorted(c.outcome.per_instance.values())
        if not counts or counts[0] == 0:
            return "-"
        return f"{counts[-1] / counts[0]:.2f}"

    def per_replica(c: Column) -> str:
        return " ".join(f"{total([m], REQUESTS):.0f}" for m in c.metrics)

    def trip(q: float, operation: str) -> Callable[[list[Samples]], str]:
        return lambda m: _ms(quantile(m, ROUNDTRIP, q, operation=operation))

    return [
        ("requests per instance max/min", every(spread)),
        ("requests per replica", every(per_replica)),
        ("scheduler decision p50 (ms)", every(lambda c: _ms(quantile(c.metrics, SCHEDULER, 0.5)))),
        ("scheduler decision p99 (ms)", every(lambda c: _ms(quantile(c.metrics, SCHEDULER, 0.99)))),
        ("redis match round trip p50 (ms)", shared(trip(0.5, "match"))),
        ("redis match round trip p99 (ms)", shared(trip(0.99, "match"))),
        ("redis add round trip p50 (ms)", shared(trip(0.5, "add"))),
        ("shared matches answered", shared(lambda m: f"{total(m, MATCHES, operation='match'):.0f}")),  # noqa: E501
        ("deadline misses (local fallback)", shared(lambda m: f"{total(m, MISSES):.0f}")),
        ("kv gate: requests held / past maxHoldMs / wait p50 / p90 (ms)", every(
            lambda c: f"{total(c.metrics, KV_GATE_WAIT + '_count'):.0f}"
            f" / {total(c.metrics, KV_GATE_WAIT + '_count', outcome='deadline'):.0f}"
            f" / {_ms(quantile(c.metrics, KV_GATE_WAIT, 0.5))}"
            f" / {_ms(quantile(c.metrics, KV_GATE_WAIT, 0.9))}"
            if present(c.metrics, KV_GATE_WAIT + '_count') else "-")),
        ("new-prefix claims won / moved / lost / fallback", shared(
            lambda m: " / ".join(
                f"{total(m, CLAIMS, outcome=o):.0f}"
                for o in ("won", "moved", "lost", "fallback")))),
        ("redis claim round trip p50 (ms)", shared(trip(0.5, "claim"))),
        ("chains in redis at end, held by 1 / 2 / 3+", every(
            lambda c: " / ".join(
                str(n) for n in (
                    c.holders["held by 1"], c.holders["held by 2"],
                    sum(v for k, v in c.holders.items() if k.startswith("held by ")
                        and int(k.split()[-1]) >= 3)))
            if c.holders else "-")),
        ("chains in redis per endpoint", every(
            lambda c: "-".join(
                str(v) for k, v in sorted(c.holders.items()) if not k.startswith("held by "))
            if c.holders else "-")),
        ("shared-state errors", shared(lambda m: f"{total(m, ERRORS):.0f}")),
        ("writes acknowledged / dropped", shared(
            lambda m: f"{total(m, WRITES):.0f} / {total(m, DROPPED):.0f}")),
        ("degraded replicas at end", shared(lambda m: f"{total(m, DEGRADED):.0f}")),
        ("redis round trips per request (writes)", every(
            lambda c: _num(c.redis_trips_per_request))),
        ("redis commands per request", every(lambda c: _num(c.redis_commands_per_request))),
        ("redis CPU per request (ms, server)", every(
            lambda c: _ms(c.redis_cpu_ms_per_request / 1000))),
        ("redis round trips per s per replica", every(
            lambda c: _num(c.redis_trips_per_request * c.outcome.requests
                           / c.outcome.elapsed / len(c.metrics), 0))),
        ("redis round trips per s idle", every(lambda c: _num(c.redis_idle_trips_per_s, 0))),
        ("tenant shares while all ran", every(
            lambda c: " / ".join(f"{x:.1%}" for x in c.tenant_share) or "-")),
        ("tenant client TTFT p90 (ms, sim)", every(
            lambda c: " / ".join(f"{x:.0f}" for x in c.tenant_ttft_p90_ms) or "-")),
        ("Envoy ext_proc faults", every(
            lambda c: " ".join(f"{k}:{v}" for k, v in sorted(c.extproc_faults.items()))
            or "0")),
        ("EPP CPU s per 1k requests (sum)", every(lambda c: f"{c.cpu_per_1k:.2f}")),
        ("EPP CPU idle (s per s, sum)", every(lambda c: f"{c.idle_cpu:.3f}")),
        ("model-server scrapes per s (each)", every(lambda c: f"{c.scrapes_per_s:.1f}")),
        ("machine load average (1 min, at end)", every(lambda c: f"{c.load:.1f}")),
    ]  # fmt: skip


def side_by_side(args: argparse.Namespace, workload: Sequence[tuple[int, str]]) -> None:
    keys = args.columns.split(",")
    if args.replicas:
        keys = [f"redis{n.strip()}" for n in args.replicas.split(",")] + ["pod2"]
    for key in keys:
        name, at, deadline = key.partition("@")
        spec = column_spec(name)
        if spec is None or (at and (spec[2] is None or not deadline)):
            raise SystemExit(
                f"--columns: unknown column {key!r} (known: {', '.join(COLUMNS)},"
                " redis<N>, pod<N>; redis@<deadline>, cluster@<deadline> set"
                " --redis-deadline; @<deadline>/<claim deadline> --redis-claim-deadline too)"
            )
    runs = [one_run(args, workload, keys) for _ in range(args.repeat)]
    if len(runs) > 1:
        repeated(runs)


def repeated(runs: Sequence[Sequence[Column]]) -> None:
    """The runs' figures side by side, and each column's median against the first's: one
    run's TTFT p90 moves by about 10% between runs with the same placement. TTFT is the
    client's, in simulated time (it includes a wait in the EPP's ``kv-capacity-gate``)."""
    print(f"\n{len(runs)} runs, columns interleaved:")
    modes = [c.outcome.mode for c in runs[0]]
    for i, mode in enumerate(modes):
        hits = [run[i].outcome.hit_rate for run in runs]
        p90s = [run[i].outcome.client_ttft_ms[1] for run in runs]
        homes = ["-".join(str(v) for v in run[i].outcome.groups_per_instance) for run in runs]
        print(
            f"  {mode}: hit rate {' '.join(f'{h:.1%}' for h in hits)};"
            f" TTFT p90 {' '.join(f'{p:.0f}' for p in p90s)} ms; groups {' '.join(homes)}"
        )
    base_hit = statistics.median(run[0].outcome.hit_rate for run in runs)
    base_p90 = statistics.median(run[0].outcome.client_ttft_ms[1] for run in runs)
    base_pooled = pooled_p90(runs, 0)
    for i, mode in enumerate(modes[1:], start=1):
        hit = statistics.median(run[i].outcome.hit_rate for run in runs)
        p90 = statistics.median(run[i].outcome.client_ttft_ms[1] for run in runs)
        print(
            f"{mode} vs {modes[0]}, medians: hit rate {hit / base_hit:.1%} of it"
            f" (target >= 95%), TTFT p90 {p90 / base_p90 - 1:+.1%} (target within 5%);"
            f" p90 of all {len(runs)} runs' requests together"
            f" {pooled_p90(runs, i) / base_pooled - 1:+.1%}"
        )


def pooled_p90(runs: Sequence[Sequence[Column]], column: int) -> float:
    """The client TTFT p90 (simulated time) over every request of every run of one column:
    steadier than one run's, whose p90 rests on its 60 slowest requests."""
    samples = [t for run in runs for t in run[column].outcome.client_ttft_samples_ms]
    return percentile(samples, 0.9)


def one_run(
    args: argparse.Namespace, workload: Sequence[tuple[int, str]], keys: Sequence[str]
) -> list[Column]:
    """Every column once, in order, on fresh stacks; its table and comparisons printed."""
    columns = []
    for key in keys:
        started = time.perf_counter()
        column = run_column(key, args, workload)
        print(f"  {column.outcome.mode}: done in {time.perf_counter() - started:.0f} s", flush=True)
        columns.append(column)
    print()
    print_table([c.outcome for c in columns], extra_rows(columns))
    for column in columns:
        busiest = sorted(column.redis_commands.items(), key=lambda kv: -kv[1][1])[:10]
        if busiest:
            print(f"{column.outcome.mode}: Redis commands per request (calls, µs)")
            print(
                "  "
                + ", ".join(f"{name} {calls:.1f} / {usec:.0f}" for name, (calls, usec) in busiest)
            )
    for column in columns:
        if column.notes:
            print(f"{column.outcome.mode}: the replicas' shared-state log lines")
            for text, count in column.notes.most_common(8):
                print(f"  {count:>4} x {text}")
    base = columns[0].outcome
    for column in columns[1:]:
        o = column.outcome
        print(
            f"{o.mode} vs {base.mode}: hit rate {o.hit_rate / base.hit_rate:.1%} of it"
            f" (target >= 95%),"
            f" TTFT p90 {o.client_ttft_ms[1] / base.client_ttft_ms[1] - 1:+.1%}"
            " (target within 5%; the client's, simulated)"
        )
    return columns


# --- fail-open ---


@dataclass
class Phase:
    name: str
    rec: ClientRecord = field(default_factory=ClientRecord)
    sent: int = 0
    stats: dict[str, dict[str, Any]] = field(default_factory=dict)
    metrics: list[Samples] = field(default_factory=list)


@dataclass
class Watch:
    """When the replicas' degraded gauges changed (seconds since the traffic started)."""

    events: list[tuple[float, int]] = field(default_factory=list)  # (when, degraded count)


async def _watch(stack: Stack, watch: Watch, started: float, stop: asyncio.Event) -> None:
    last = -1
    while not stop.is_set():
        with contextlib.suppress(OSError):
            degraded = int(total(await asyncio.to_thread(scrape, stack), DEGRADED))
            if degraded != last:
                watch.events.append((time.perf_counter() - started, degraded))
                last = degraded
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.1)


async def _fail_open_traffic(
    stack: Stack,
    server: RedisServer,
    workload: Sequence[tuple[int, str]],
    args: argparse.Namespace,
) -> tuple[list[Phase], Watch, dict[str, float]]:
    phases = [Phase("before"), Phase("redis down"), Phase("after restart")]
    bounds = (len(workload) // 3, 2 * len(workload) // 3)
    marks: dict[str, float] = {}
    queue: asyncio.Queue[tuple[int, int, str]] = asyncio.Queue()
    for i, (group, prompt) in enumerate(workload):
        queue.put_nowait((i, group, prompt))
    switch = asyncio.Lock()
    current = 0
    watch = Watch()
    stop = asyncio.Event()
    started = time.perf_counter()

    async def boundary(phase: int) -> None:
        """End phase ``phase - 1``: snapshot, then kill or restart Redis."""
        nonlocal current
        ended = phases[phase - 1]
        ended.stats = await sim_stats(stack.simulator_urls)
        ended.metrics = await asyncio.to_thread(scrape, stack)
        if phase == 1:
            await asyncio.to_thread(server.kill)
            marks["killed"] = time.perf_counter() - started
        else:
            await asyncio.to_thread(server.start)
            marks["restarted"] = time.perf_counter() - started
        current = phase

    connector = aiohttp.TCPConnector(limit=args.concurrency)
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def worker() -> None:
            while True:
                try:
                    index, group, prompt = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                async with switch:
                    for phase, bound in enumerate(bounds, start=1):
                        if index >= bound and current < phase:
                            await boundary(phase)
                phase_now = phases[current]
                phase_now.sent += 1
                await send_one(session, stack.url, group, prompt, args.max_tokens, phase_now.rec)

        watcher = asyncio.create_task(_watch(stack, watch, started, stop))
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        phases[-1].stats = await sim_stats(stack.simulator_urls)
        phases[-1].metrics = await asyncio.to_thread(scrape, stack)
        marks["ended"] = time.perf_counter() - started
        stop.set()
        await watcher
    return phases, watch, marks


def _delta(
    now: dict[str, dict[str, Any]], before: dict[str, dict[str, Any]]
) -> tuple[float, list[float]]:
    """Hit rate and the new TTFT samples between two ``/sim/stats`` snapshots."""
    hits = queries = 0.0
    ttft: list[float] = []
    for name, doc in now.items():
        old = before.get(name)
        hits += doc["prefix_cache"]["hits"] - (old["prefix_cache"]["hits"] if old else 0)
        queries += doc["prefix_cache"]["queries"] - (old["prefix_cache"]["queries"] if old else 0)
        skip = len(old["ttft_samples"]) if old else 0
        ttft += [s * 1e3 for s in doc["ttft_samples"][skip:]]
    return (hits / queries if queries else math.nan), ttft


def fail_open(args: argparse.Namespace, workload: Sequence[tuple[int, str]]) -> None:
    if not redis_available():
        raise SystemExit("redis-server and redis-cli are not on PATH: run `make install`")
    server = RedisServer()
    server.start()
    try:
        options = StackOptions(
            simulators=args.instances,
            simulator_base_ip=args.base_ip,
            simulator_args=simulator_args(args),
            epp_replicas=REPLICAS,
            epp_args=[
                "--redis-url",
                server.url,
                "--redis-key-prefix",
                f"epp:bench-{uuid.uuid4().hex[:8]}",
                *args.redis_args.split(),
            ],
        )
        with Stack.run(options) as stack:
            phases, watch, marks = asyncio.run(_fail_open_traffic(stack, server, workload, args))
            logs = [epp.log() for epp in stack.epps]
    finally:
        server.close()

    rows: list[tuple[str, list[str]]] = []
    previous_stats: dict[str, dict[str, Any]] = {}
    previous_metrics: list[Samples] = []
    cells: dict[str, list[str]] = {}
    for phase in phases:
        hit_rate, ttft = _delta(phase.stats, previous_stats)
        statuses: Counter[str] = Counter({"200": len(phase.rec.ttfb_ms)})
        statuses.update(phase.rec.errors)

        now, before = phase.metrics, previous_metrics

        def diff(name: str, now: list[Samples] = now, before: list[Samples] = before) -> float:
            labels = {"operation": "match"} if name == MATCHES else {}
            return total(now, name, **labels) - total(before, name, **labels)

        groups = phase.rec.group_instances

        values = {
            "requests sent": str(phase.sent),
            "statuses": " ".join(f"{k}:{v}" for k, v in sorted(statuses.items())),
            "prefix-cache hit rate (tokens)": f"{hit_rate:.1%}",
            "sim TTFT p50 (ms, simulated)": f"{percentile(ttft, 0.5):.0f}",
            "sim TTFT p90 (ms, simulated)": f"{percentile(ttft, 0.9):.0f}",
            "instances per group (mean)": (
                f"{sum(len(s) for s in groups.values()) / len(groups):.2f}" if groups else "-"
            ),
            "shared matches answered": f"{diff(MATCHES):.0f}",
            "deadline misses": f"{diff(MISSES):.0f}",
            "shared-state errors": f"{diff(ERRORS):.0f}",
            "writes acknowledged": f"{diff(WRITES):.0f}",
            "writes dropped": f"{diff(DROPPED):.0f}",
            "degraded replicas at phase end": f"{total(phase.metrics, DEGRADED):.0f}",
        }
        for label, value in values.items():
            cells.setdefault(label, []).append(value)
        previous_stats, previous_metrics = phase.stats, phase.metrics
    rows = list(cells.items())
    width = max(len(label) for label, _ in rows)
    widths = [max(len(p.name), *(len(r[1][i]) for r in rows)) for i, p in enumerate(phases)]
    print(
        f"{'':<{width}}  "
        + "  ".join(f"{p.name:>{w}}" for p, w in zip(phases, widths, strict=True))
    )
    for label, values_ in rows:
        print(
            f"{label:<{width}}  "
            + "  ".join(f"{v:>{w}}" for v, w in zip(values_, widths, strict=True))
        )
    print()
    print(
        f"redis-server SIGKILLed at {marks['killed']:.1f} s, restarted empty at"
        f" {marks['restarted']:.1f} s, traffic ended at {marks['ended']:.1f} s"
    )
    print(
        "degraded gauge (replicas degraded) over time: "
        + ", ".join(f"{when:.1f} s: {count}" for when, count in watch.events)
    )
    degraded_lines = sum(log.count("shared prefix index degraded") for log in logs)
    healed_lines = sum(log.count("shared prefix index healthy again") for log in logs)
    load_down = sum(log.count("shared load: redis failed") for log in logs)
    load_up = sum(log.count("shared load: redis answers again") for log in logs)
    print(
        f"log lines over {REPLICAS} replicas: index degraded {degraded_lines}, healthy again"
        f" {healed_lines}; load failed {load_down}, answers again {load_up}"
    )
    bad = sum(sum(p.rec.errors.values()) for p in phases)
    print(f"non-200 or broken responses: {bad} of {sum(p.sent for p in phases)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_arguments(parser)
    parser.add_argument(
        "--columns",
        default=",".join(DEFAULT_COLUMNS),
        help=f"which columns, in order (default: {', '.join(DEFAULT_COLUMNS)}; also"
        " 1-nogate, redis-nogate: without kv-capacity-gate; redis-scrape1: each replica"
        " scraping 3 times less often, so the servers get one replica's scrapes)",
    )
    parser.add_argument(
        "--replicas",
        default="",
        help="the scaling curve instead of --columns: e.g. 1,2,4,8 runs redis1,redis2,"
        "redis4,redis8 (N EPPs on one redis-server) and pod2 (one EPP, --workers 2)",
    )
    parser.add_argument(
        "--tenants",
        type=int,
        default=2,
        help="fairness ids sending at equal load (x-gateway-inference-fairness-id; 0: none)",
    )
    parser.add_argument(
        "--redis-args",
        default="",
        help="more EPP flags for the Redis columns, e.g. '--redis-deadline 20ms'",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run the columns this many times, interleaved, and compare their medians",
    )
    parser.add_argument(
        "--fail-open",
        action="store_true",
        help="3 replicas on Redis; SIGKILL it at 1/3 of the requests, restart it at 2/3",
    )
    args = parser.parse_args()
    finish_workload_arguments(args)
    workload = build_workload(
        groups=args.groups,
        prompts_per_group=args.prompts_per_group,
        rounds=args.rounds,
        seed=args.seed,
    )
    print(describe(args, workload))
    if args.redis_args:
        print(f"Redis columns' extra EPP flags: {args.redis_args}")
    if args.fail_open:
        fail_open(args, workload)
    else:
        side_by_side(args, workload)


if __name__ == "__main__":
    main()
