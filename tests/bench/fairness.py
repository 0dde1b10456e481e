"""Benchmark (not a test): flow control's fairness and priority over EPP replicas.

Every column is a fresh stack (``tests.support.stack``): ``--instances`` (3) simulated vLLM
servers (``h100-8b`` timings, ``--time-scale`` 0.5: far from their own batch limit, so the
pool is saturated by the EPP's ``concurrency-detector``, ``--max-concurrency`` (8) requests
per server, 24 over the pool), behind one Envoy and the column's EPPs. Columns
(``--columns``):

- ``1``: one EPP, ``round-robin-fairness-policy`` (flow control as it was, one process);
- ``3-local``: three EPPs on one ``redis-server`` with ``--redis-shared-admission=false``:
  the in-flight load is shared (the detector sees the pool's), flow control is per process,
  ``round-robin-fairness-policy``;
- ``3-pool``: three EPPs on one ``redis-server``, flow control over the pool,
  ``max-min-fairness-policy``;
- ``1-maxmin``: one EPP, ``max-min-fairness-policy``;
- ``3-off``: three EPPs on Redis without flow control (the servers queue everything);
- any of these with flow control followed by ``-holdback<minCeiling>`` (e.g.
  ``1-holdback0.5``): the same with ``priority-holdback-policy`` (``minCeiling`` as given)
  as the usage-limit policy instead of ``static-usage-limit-policy``: the lower band stops
  at that saturation, the higher one goes up to 1.0.

Each EPP runs the default scheduling profile plus::

    featureGates: [flowControl]
    plugins: [..., concurrency-detector {maxConcurrency}, <fairness policy>]
    saturationDetector: {pluginRef: concurrency-detector}
    flowControl: {defaultRequestTTL: 60s, defaultPriorityBand: {fairnessPolicyRef: ...}}

Scenarios (``--scenarios``), each phase ``--warmup`` (3 s) then ``--seconds`` (20 s) measured,
requests streamed ``/v1/completions`` of a ~100-token prompt and ``max_tokens`` drawn from
half to one and a half ``--max-tokens`` (100), closed-loop users sending one request after
another. Tenants are told apart by
``x-gateway-inference-fairness-id`` (the stack's trusted-header stand-in sets it):

- ``light``: (a) of issue 39, first part. ``light`` (6 users: a quarter of the pool's
  concurrency) alone, then ``light`` with ``heavy`` (30 users, 5x): light's completed
  requests per second in the mix against alone (target >= 90%), heavy's, and the requests
  running on the servers (sampled every 50 ms) against the pool's limit;
- ``light-open``: (a), first part, as an offered rate: ``light`` open-loop Poisson at
  ``--light-rate`` (4/s, about a quarter of what the pool completes on one replica) alone,
  then with ``heavy`` (30 users): the share of light's requests sent in the window that it
  completes in the window (edge effects make it ±5% around 100% alone), against alone,
  its TTFB, and its requests sent and not ended (the slots it holds, plus its queue).
  The closed-loop ``light`` ratio also counts each request's own slow-down when the
  servers run full (a closed-loop user sends less when answered slower); the open-loop
  one does not: it asks whether the tenant is served what it asks;
- ``equal``: (a), second part. ``light`` (16 users, two thirds of the pool) and ``heavy``
  (80): each one's share of the completions (target 45-55%);
- ``priority``: (b). ``high`` (objective ``high``, priority 10) alone, open-loop Poisson at
  ``--high-rate`` (8/s), then the same with ``batch`` (priority 0, 40 users) flooding:
  high's client TTFT (time to first byte) p50/p90 against alone (target: p90 within 10%).

The light scenarios also report the light tenant's mean time from the first byte to the
end (the server's decoding as the client sees it), ``equal`` each tenant's; all three the
CPU cores the EPPs, simulators, Envoy, Redis and this client used in the measured window
(a column whose parts used little CPU yet ran slow was starved by the machine's other
work).

Prints one table per scenario, the columns side by side.

    .venv/bin/python -m tests.bench.fairness [--quick] [--columns 1,3-local,3-pool]
        [--scenarios light,light-open,equal,priority] [--light-rate 4] [--time-scale 0.5]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import math
import os
import random
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import aiohttp
import orjson
import yaml

from app.config.loader import DEFAULT_CONFIG
from tests.bench.load import cpu_seconds
from tests.bench.pod import pod_pids
from tests.bench.replicas import redis_for
from tests.simulator import DEFAULT_MODEL
from tests.support.stack import Stack, StackOptions, trusted_header

FAIRNESS_HEADER = trusted_header("x-gateway-inference-fairness-id")
OBJECTIVE_HEADER = trusted_header("x-gateway-inference-objective")
OBJECTIVES = """\
kind: InferenceObjective
metadata: {name: high}
spec: {priority: 10}
---
kind: InferenceObjective
metadata: {name: batch}
spec: {priority: 0}
"""

ROUND_ROBIN = "round-robin-fairness-policy"
MAX_MIN = "max-min-fairness-policy"


@dataclass(frozen=True)
class ColumnSpec:
    label: str
    replicas: int
    redis: bool
    fairness: str | None  # None: no flow control
    shared_admission: bool = True
    holdback: float | None = None  # priority-holdback-policy's minCeiling (None: static)


COLUMNS: dict[str, ColumnSpec] = {
    "1": ColumnSpec("1 replica, per process", 1, False, ROUND_ROBIN),
    "3-local": ColumnSpec("3 redis, per process", 3, True, ROUND_ROBIN, shared_admission=False),
    "3-pool": ColumnSpec("3 redis, pool-wide", 3, True, MAX_MIN),
    "1-maxmin": ColumnSpec("1 replica, max-min", 1, False, MAX_MIN),
    "3-off": ColumnSpec("3 redis, no flow control", 3, True, None),
}
SCENARIOS = ("light", "light-open", "equal", "priority")
HOLDBACK = "-holdback"


def column_spec(key: str) -> ColumnSpec:
    """``COLUMNS[key]``, or ``<column>-holdback<minCeiling>``: that column with
    ``priority-holdback-policy`` as its usage-limit policy (e.g. ``3-pool-holdback0.5``)."""
    base, sep, value = key.partition(HOLDBACK)
    if base not in COLUMNS or (sep and not value):
        raise SystemExit(
            f"--columns: unknown {key!r} (known: {', '.join(COLUMNS)}, each optionally"
            f" followed by {HOLDBACK}<minCeiling>)"
        )
    spec = COLUMNS[base]
    if not sep:
        return spec
    if spec.fairness is None:
        raise SystemExit(f"--columns: {key!r}: {base!r} has no flow control to hold back")
    try:
        ceiling = float(value)
    except ValueError:
        raise SystemExit(f"--columns: {key!r}: {value!r} is not a number") from None
    return dataclasses.replace(spec, label=f"{spec.label}, holdback {ceiling:g}", holdback=ceiling)


def epp_config(spec: ColumnSpec, max_concurrency: int) -> str:
    """The default profile plus flow control with ``spec``'s fairness policy."""
    config: dict[str, Any] = {
        "plugins": [dict(p) for p in DEFAULT_CONFIG["plugins"]],
        "schedulingProfiles": DEFAULT_CONFIG["schedulingProfiles"],
    }
    if spec.fairness is None:
        return yaml.safe_dump(config)
    config["featureGates"] = ["flowControl"]
    config["plugins"] += [
        {"type": "concurrency-detector", "parameters": {"maxConcurrency": max_concurrency}},
        {"type": spec.fairness},
    ]
    config["saturationDetector"] = {"pluginRef": "concurrency-detector"}
    config["flowControl"] = {
        "defaultRequestTTL": "60s",
        "defaultPriorityBand": {"fairnessPolicyRef": spec.fairness},
    }
    if spec.holdback is not None:
        config["plugins"].append(
            {
                "type": "priority-holdback-policy",
                "name": "holdback",
                "parameters": {"minCeiling": spec.holdback},
            }
        )
        config["flowControl"]["usageLimitPolicyPluginRef"] = "holdback"
    return yaml.safe_dump(config)


# --- the client ---


@dataclass
class Done:
    """One finished request: who sent it, when it was sent and when it ended, its TTFB
    (None: it failed)."""

    who: str
    sent: float
    ended: float
    ttfb: float | None
    status: int


@dataclass
class Log:
    done: list[Done] = field(default_factory=list)


def prompt_of(rng: random.Random) -> str:
    return " ".join(rng.choice(("alpha", "beta", "gamma", "delta", "omega")) for _ in range(80))


async def one(
    session: aiohttp.ClientSession,
    url: str,
    who: str,
    headers: dict[str, str],
    prompt: str,
    max_tokens: int,
    log: Log,
) -> None:
    body = orjson.dumps(
        {
            "model": DEFAULT_MODEL,
            "prompt": prompt,
            # Spread around the mean: equal lengths would start and end in waves.
            "max_tokens": random.randint(max_tokens // 2, max_tokens * 3 // 2),
            "stream": True,
        }
    )
    start = time.perf_counter()
    ttfb: float | None = None
    status = 0
    try:
        async with session.post(f"{url}/v1/completions", data=body, headers=headers) as response:
            status = response.status
            async for _chunk in response.content.iter_any():
                if ttfb is None and status == 200:
                    ttfb = time.perf_counter() - start
    except (aiohttp.ClientError, TimeoutError):
        status = 0
    ttfb = ttfb if status == 200 else None
    log.done.append(Done(who, start, time.perf_counter(), ttfb, status))


async def closed_loop(
    session: aiohttp.ClientSession,
    url: str,
    who: str,
    headers: dict[str, str],
    users: int,
    until: float,
    max_tokens: int,
    log: Log,
    seed: int,
) -> None:
    async def user(index: int) -> None:
        rng = random.Random(seed * 1000 + index)
        while time.perf_counter() < until:
            await one(session, url, who, headers, prompt_of(rng), max_tokens, log)

    await asyncio.gather(*(user(i) for i in range(users)))


async def open_loop(
    session: aiohttp.ClientSession,
    url: str,
    who: str,
    headers: dict[str, str],
    rate: float,
    until: float,
    max_tokens: int,
    log: Log,
    seed: int,
) -> None:
    rng = random.Random(seed)
    tasks: list[asyncio.Task[None]] = []
    at = time.perf_counter()
    while True:
        at += rng.expovariate(rate)
        if at >= until:
            break
        delay = at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)  # open-loop pacing
        tasks.append(
            asyncio.create_task(one(session, url, who, headers, prompt_of(rng), max_tokens, log))
        )
    await asyncio.gather(*tasks)


async def running_on_servers(urls: dict[str, str], samples: list[int], stop: asyncio.Event) -> None:
    """Sums the servers' running + waiting requests every 50 ms until ``stop``."""
    async with aiohttp.ClientSession() as session:
        while not stop.is_set():
            total = 0
            for url in urls.values():
                try:
                    async with session.get(f"{url}/sim/stats") as response:
                        doc = orjson.loads(await response.read())
                    total += doc["requests"]["running"] + doc["requests"]["waiting"]
                except aiohttp.ClientError:
                    pass
            samples.append(total)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.05)


@dataclass
class Phase:
    """What one measured phase saw: its requests, its length, the servers' in-flight, and
    the CPU cores each part of the stack used over the measured window."""

    log: Log
    start: float
    end: float
    running: list[int]
    cores: dict[str, float] = field(default_factory=dict)

    def rate(self, who: str) -> float:
        ok = [d for d in self.log.done if d.who == who and d.status == 200]
        return sum(self.start <= d.ended < self.end for d in ok) / (self.end - self.start)

    def errors(self) -> int:
        return sum(d.status != 200 for d in self.log.done)

    def sent(self, who: str) -> int:
        """``who``'s requests sent within the measured window (answered or not)."""
        return sum(d.who == who and self.start <= d.sent < self.end for d in self.log.done)

    def in_flight(self, who: str) -> float:
        """``who``'s requests sent and not yet ended, averaged over the measured window
        (the client's view: queued in the EPP or on a server)."""
        held = sum(
            max(0.0, min(d.ended, self.end) - max(d.sent, self.start))
            for d in self.log.done
            if d.who == who
        )
        return held / (self.end - self.start)

    def stream_times(self, who: str) -> list[float]:
        """From the first byte to the end, for ``who``'s answered requests in the window
        (the server's decoding, as the client sees it)."""
        return [
            d.ended - d.sent - d.ttfb
            for d in self.log.done
            if d.who == who and d.ttfb is not None and self.start <= d.ended < self.end
        ]

    def ttfbs(self, who: str) -> list[float]:
        return [
            d.ttfb
            for d in self.log.done
            if d.who == who and d.ttfb is not None and self.start <= d.ended < self.end
        ]


def redis_cpu(redis_args: Sequence[str]) -> float:
    """CPU seconds the Redis in ``redis_args`` has used so far (0 without Redis)."""
    if not redis_args:
        return 0.0
    import redis

    host, _, port = redis_args[1].split("://", 1)[1].split(",")[0].rpartition(":")
    node = redis.Redis(host=host, port=int(port))
    try:
        info = node.info("cpu")
    finally:
        node.close()
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


def cpu_by_part(stack: Stack, redis_args: Sequence[str]) -> dict[str, float]:
    """CPU seconds used so far by the stack's EPPs (with their workers), simulators,
    Envoy and Redis, and by this client."""
    used = {"EPPs": 0.0, "simulators": 0.0, "Envoy": 0.0, "Redis": redis_cpu(redis_args)}
    for child in stack.children:
        if child.process is None:
            continue
        part = (
            "EPPs"
            if child.name.startswith("epp")
            else "simulators"
            if child.name.startswith("simulator")
            else "Envoy"
            if child.name.startswith("envoy")
            else None
        )
        if part is None:
            continue
        for pid in pod_pids(child.process.pid):
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                used[part] += cpu_seconds(pid)
    used["client"] = time.process_time()
    return used


async def cpu_over(
    stack: Stack, redis_args: Sequence[str], start: float, end: float, cores: dict[str, float]
) -> None:
    """Fills ``cores`` with the CPU cores each part used between ``start`` and ``end``."""
    await asyncio.sleep(max(0.0, start - time.perf_counter()))  # the window's start
    before, at = cpu_by_part(stack, redis_args), time.perf_counter()
    await asyncio.sleep(max(0.0, end - time.perf_counter()))  # the window's end
    after, length = cpu_by_part(stack, redis_args), time.perf_counter() - at
    cores.update({part: (after[part] - before[part]) / length for part in before})


async def phase(
    stack: Stack,
    loads: Sequence[Load],
    args: argparse.Namespace,
) -> Phase:
    log = Log()
    samples: list[int] = []
    cores: dict[str, float] = {}
    stop = asyncio.Event()
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start = time.perf_counter() + args.warmup
        end = start + args.seconds
        sampler = asyncio.create_task(running_on_servers(stack.simulator_urls, samples, stop))
        cpu = asyncio.create_task(cpu_over(stack, args.redis_args, start, end, cores))
        await asyncio.gather(*(load(session, stack.url, end, log) for load in loads))
        stop.set()
        await sampler
        await cpu
    # samples taken over the whole phase; keep the measured window's share (by count)
    skip = int(len(samples) * args.warmup / (args.warmup + args.seconds))
    return Phase(log, start, end, samples[skip:], cores)


#: One load of a phase: (session, Envoy's URL, end of the phase, log) -> a coroutine.
Load = Callable[[aiohttp.ClientSession, str, float, Log], Awaitable[None]]


def tenant(who: str, users: int, args: argparse.Namespace, seed: int) -> Load:
    """``users`` closed-loop users of fairness id ``who``."""
    headers = {FAIRNESS_HEADER: who}

    def load(session: aiohttp.ClientSession, url: str, until: float, log: Log) -> Awaitable[None]:
        return closed_loop(session, url, who, headers, users, until, args.max_tokens, log, seed)

    return load


def tenant_open(who: str, rate: float, args: argparse.Namespace, seed: int) -> Load:
    """Open-loop Poisson arrivals of fairness id ``who`` at ``rate`` per second."""
    headers = {FAIRNESS_HEADER: who}

    def load(session: aiohttp.ClientSession, url: str, until: float, log: Log) -> Awaitable[None]:
        return open_loop(session, url, who, headers, rate, until, args.max_tokens, log, seed)

    return load


def objective(
    who: str, name: str, args: argparse.Namespace, seed: int, *, users: int = 0, rate: float = 0
) -> Load:
    """Fairness id ``who`` under objective ``name``: ``users`` closed-loop users, or an
    open-loop Poisson arrival at ``rate`` per second."""
    headers = {OBJECTIVE_HEADER: name, FAIRNESS_HEADER: who}

    def load(session: aiohttp.ClientSession, url: str, until: float, log: Log) -> Awaitable[None]:
        if users:
            return closed_loop(session, url, who, headers, users, until, args.max_tokens, log, seed)
        return open_loop(session, url, who, headers, rate, until, args.max_tokens, log, seed)

    return load


@dataclass
class Column:
    spec: ColumnSpec
    rows: dict[str, dict[str, str]] = field(default_factory=dict)  # scenario -> row -> cell


def pct(values: Sequence[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f}"


def run_column(key: str, args: argparse.Namespace) -> Column:
    spec = column_spec(key)
    column = Column(spec)
    limit = args.max_concurrency * args.instances
    with (
        TemporaryDirectory(prefix="fairness-") as tmp,
        redis_for("server" if spec.redis else None) as redis_args,
    ):
        objectives = Path(tmp) / "objectives.yaml"
        objectives.write_text(OBJECTIVES)
        args.redis_args = list(redis_args)
        more = list(redis_args)
        if spec.redis and not spec.shared_admission:
            more.append("--redis-shared-admission=false")
        options = StackOptions(
            simulators=args.instances,
            simulator_base_ip="127.0.0.80",
            simulator_args=["--preset", "h100-8b", "--time-scale", str(args.time_scale)],
            epp_replicas=spec.replicas,
            epp_args=[
                "--config-text",
                epp_config(spec, args.max_concurrency),
                "--static-objectives",
                str(objectives),
                *more,
            ],
            extproc_faults=True,  # counted below, as a row, rather than failing the run
        )
        with Stack.run(options) as stack:
            for scenario in args.scenarios:
                started = time.perf_counter()
                column.rows[scenario] = asyncio.run(SCENARIO_RUNS[scenario](stack, args, limit))
                column.rows[scenario]["Envoy's ext_proc faults"] = extproc_faults(stack)
                print(
                    f"  {spec.label}: {scenario} in {time.perf_counter() - started:.0f} s:"
                    f" {column.rows[scenario]}",
                    flush=True,
                )
    return column


def extproc_faults(stack: Stack) -> str:
    """Envoy's ext_proc fault counters so far (failed streams, message timeouts, rejected
    header mutations) that are not zero, or ``0``."""
    faults = {
        name.rsplit(".", 1)[-1]: value
        for name, value in stack.envoy_counters().items()
        if name.rsplit(".", 1)[-1] in Stack.EXTPROC_FAULTS and value
    }
    return ", ".join(f"{name} {value}" for name, value in sorted(faults.items())) or "0"


def servers(p: Phase, limit: int) -> str:
    if not p.running:
        return "-"
    return f"{statistics.mean(p.running):.1f} / {max(p.running)} (limit {limit})"


def over(p: Phase, limit: int) -> str:
    """The share of the samples with more requests on the servers than the pool's limit,
    and the mean excess over the limit across all samples."""
    if not p.running:
        return "-"
    share = sum(n > limit for n in p.running) / len(p.running)
    excess = statistics.mean(max(0, n - limit) for n in p.running) / limit
    return f"{share:.0%} / {excess:+.1%}"


def cores(p: Phase) -> str:
    """The CPU cores the EPPs, simulators, Envoy, Redis and the client used in ``p``."""
    if not p.cores:
        return "-"
    parts = ("EPPs", "simulators", "Envoy", "Redis", "client")
    return " / ".join(f"{p.cores[part]:.2f}" for part in parts)


def mean_ms(values: Sequence[float]) -> str:
    return ms(statistics.mean(values)) if values else "-"


def light_alone_and_mixed(alone: Phase, mixed: Phase, limit: int) -> dict[str, str]:
    """The rows both light scenarios end with: the light tenant's TTFB p90 and stream
    time alone and beside the heavy one, the servers, the CPU, the errors."""
    return {
        "light TTFB p90 alone / mixed (ms)": (
            f"{ms(pct(alone.ttfbs('light'), 0.9))} / {ms(pct(mixed.ttfbs('light'), 0.9))}"
        ),
        "light first byte to end, mean alone / mixed (ms)": (
            f"{mean_ms(alone.stream_times('light'))} / {mean_ms(mixed.stream_times('light'))}"
        ),
        "on the servers, mean / max": servers(mixed, limit),
        "samples over the limit / mean excess": over(mixed, limit),
        "CPU cores alone: EPPs / sims / Envoy / Redis / client": cores(alone),
        "CPU cores mixed: EPPs / sims / Envoy / Redis / client": cores(mixed),
        "errors": str(alone.errors() + mixed.errors()),
    }


async def light_scenario(stack: Stack, args: argparse.Namespace, limit: int) -> dict[str, str]:
    alone = await phase(stack, [tenant("light", args.light_users, args, 1)], args)
    mixed = await phase(
        stack,
        [
            tenant("light", args.light_users, args, 1),
            tenant("heavy", args.light_users * 5, args, 2),
        ],
        args,
    )
    light_alone, light_mixed = alone.rate("light"), mixed.rate("light")
    return {
        "light alone (req/s)": f"{light_alone:.1f}",
        "light with heavy (req/s)": f"{light_mixed:.1f}",
        "light with heavy / alone": f"{light_mixed / light_alone:.1%}" if light_alone else "-",
        "heavy (req/s)": f"{mixed.rate('heavy'):.1f}",
        "light TTFB mean alone / mixed (ms)": (
            f"{mean_ms(alone.ttfbs('light'))} / {mean_ms(mixed.ttfbs('light'))}"
        ),
        **light_alone_and_mixed(alone, mixed, limit),
    }


async def light_open_scenario(stack: Stack, args: argparse.Namespace, limit: int) -> dict[str, str]:
    light = tenant_open("light", args.light_rate, args, 7)
    alone = await phase(stack, [light], args)
    mixed = await phase(
        stack,
        [
            tenant_open("light", args.light_rate, args, 7),
            tenant("heavy", args.light_users * 5, args, 2),
        ],
        args,
    )

    def share(p: Phase) -> str:
        sent = p.sent("light")
        return f"{p.rate('light') * (p.end - p.start) / sent:.1%}" if sent else "-"

    def offered(p: Phase) -> str:
        return f"{p.sent('light') / (p.end - p.start):.1f}"

    return {
        "light offered alone / with heavy (req/s)": f"{offered(alone)} / {offered(mixed)}",
        "light offered / the pool's completions with heavy": (
            f"{float(offered(mixed)) / pool:.0%}"
            if (pool := mixed.rate("light") + mixed.rate("heavy"))
            else "-"
        ),
        "light completed / offered, alone": share(alone),
        "light completed / offered, with heavy": share(mixed),
        "light completed with heavy / alone": (
            f"{mixed.rate('light') / alone.rate('light'):.1%}" if alone.rate("light") else "-"
        ),
        "heavy (req/s)": f"{mixed.rate('heavy'):.1f}",
        "light TTFB p50 alone / mixed (ms)": (
            f"{ms(pct(alone.ttfbs('light'), 0.5))} / {ms(pct(mixed.ttfbs('light'), 0.5))}"
        ),
        "light in flight, mean alone / mixed": (
            f"{alone.in_flight('light'):.1f} / {mixed.in_flight('light'):.1f}"
        ),
        **light_alone_and_mixed(alone, mixed, limit),
    }


async def equal_scenario(stack: Stack, args: argparse.Namespace, limit: int) -> dict[str, str]:
    users = args.equal_users
    mixed = await phase(
        stack, [tenant("light", users, args, 3), tenant("heavy", users * 5, args, 4)], args
    )
    light, heavy = mixed.rate("light"), mixed.rate("heavy")
    total = light + heavy
    return {
        "light share": f"{light / total:.1%}" if total else "-",
        "heavy share": f"{heavy / total:.1%}" if total else "-",
        "total (req/s)": f"{total:.1f}",
        "TTFB mean, light / heavy (ms)": (
            f"{mean_ms(mixed.ttfbs('light'))} / {mean_ms(mixed.ttfbs('heavy'))}"
        ),
        "first byte to end mean, light / heavy (ms)": (
            f"{mean_ms(mixed.stream_times('light'))} / {mean_ms(mixed.stream_times('heavy'))}"
        ),
        "in flight (client), light / heavy": (
            f"{mixed.in_flight('light'):.1f} / {mixed.in_flight('heavy'):.1f}"
        ),
        "on the servers, mean / max": servers(mixed, limit),
        "samples over the limit / mean excess": over(mixed, limit),
        "CPU cores: EPPs / sims / Envoy / Redis / client": cores(mixed),
        "errors": str(mixed.errors()),
    }


async def priority_scenario(stack: Stack, args: argparse.Namespace, limit: int) -> dict[str, str]:
    high = objective("web", "high", args, 5, rate=args.high_rate)
    alone = await phase(stack, [high], args)
    flood = objective("batch", "batch", args, 6, users=args.flood_users)
    mixed = await phase(
        stack, [objective("web", "high", args, 5, rate=args.high_rate), flood], args
    )
    a50, a90 = pct(alone.ttfbs("web"), 0.5), pct(alone.ttfbs("web"), 0.9)
    m50, m90 = pct(mixed.ttfbs("web"), 0.5), pct(mixed.ttfbs("web"), 0.9)
    return {
        "high TTFB p50 alone / flood (ms)": f"{a50 * 1e3:.0f} / {m50 * 1e3:.0f}",
        "high TTFB p90 alone / flood (ms)": f"{a90 * 1e3:.0f} / {m90 * 1e3:.0f}",
        "high p90 flood / alone": f"{m90 / a90 - 1:+.1%}" if a90 else "-",
        "high (req/s), batch (req/s)": f"{mixed.rate('web'):.1f}, {mixed.rate('batch'):.1f}",
        "on the servers, mean / max": servers(mixed, limit),
        "errors": str(alone.errors() + mixed.errors()),
    }


SCENARIO_RUNS = {
    "light": light_scenario,
    "light-open": light_open_scenario,
    "equal": equal_scenario,
    "priority": priority_scenario,
}


def print_tables(columns: Sequence[Column], scenarios: Sequence[str]) -> None:
    for scenario in scenarios:
        rows: list[str] = []
        for column in columns:
            for row in column.rows.get(scenario, {}):
                if row not in rows:
                    rows.append(row)
        labels = [c.spec.label for c in columns]
        width = max(len(r) for r in rows)
        cells = [[c.rows.get(scenario, {}).get(r, "-") for c in columns] for r in rows]
        widths = [
            max(len(labels[i]), *(len(line[i]) for line in cells)) for i in range(len(columns))
        ]
        print(f"\n{scenario}:")
        print(
            " " * width + "  " + "  ".join(f"{h:>{w}}" for h, w in zip(labels, widths, strict=True))
        )
        for name, line in zip(rows, cells, strict=True):
            print(f"{name:<{width}}  " + _cells(line, widths))


def _cells(line: Sequence[str], widths: Sequence[int]) -> str:
    return "  ".join(f"{v:>{w}}" for v, w in zip(line, widths, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 s phases, 2 s warm-up")
    parser.add_argument("--columns", default="1,3-local,3-pool")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--instances", type=int, default=3)
    parser.add_argument("--time-scale", type=float, default=0.5)
    parser.add_argument("--max-concurrency", type=int, default=8, help="per server")
    parser.add_argument("--max-tokens", type=int, default=100)
    parser.add_argument("--light-users", type=int, default=6)
    parser.add_argument(
        "--light-rate", type=float, default=4.0, help="light-open's requests per second"
    )
    parser.add_argument("--equal-users", type=int, default=16)
    parser.add_argument("--flood-users", type=int, default=40)
    parser.add_argument("--high-rate", type=float, default=8.0, help="high requests per second")
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args()
    if args.quick:
        args.warmup, args.seconds = 2.0, 8.0
    keys = args.columns.split(",")
    for key in keys:
        column_spec(key)
    args.scenarios = args.scenarios.split(",")
    for scenario in args.scenarios:
        if scenario not in SCENARIOS:
            raise SystemExit(f"--scenarios: unknown {scenario!r} (known: {', '.join(SCENARIOS)})")
    print(
        f"{args.instances} simulators (h100-8b, time scale {args.time_scale}); the pool's limit"
        f" {args.max_concurrency * args.instances} requests (concurrency-detector"
        f" maxConcurrency {args.max_concurrency}); max_tokens {args.max_tokens};"
        f" phases {args.warmup:g} s warm-up + {args.seconds:g} s measured"
    )
    columns = [run_column(key, args) for key in keys]
    print_tables(columns, args.scenarios)
    load = os.getloadavg()
    print(
        f"\nmachine load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1/5/15 min),"
        f" {os.cpu_count()} cores; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )


if __name__ == "__main__":
    main()
