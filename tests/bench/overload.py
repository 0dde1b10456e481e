"""Benchmark (not a test): flow control under overload, by priority.

Starts a stack (``tests.support.stack``): ``--instances`` (3) simulated vLLM servers with the
``h100-8b`` timing preset, ``--time-scale`` (0.3) and ``--max-num-seqs`` (4, so the
servers' waiting queues, which the default ``utilization-detector`` reads, build up at a
load a laptop can drive), the EPP with its default scheduling profile plus flow control::

    featureGates: [flowControl]
    flowControl:
      defaultRequestTTL: <--ttl>s
      defaultPriorityBand: {maxRequests: <--low-band-limit>}
      priorityBands:
      - {priority: 10, maxRequests: <--high-band-limit>}

and ``--static-objectives`` with ``high`` (priority 10) and ``batch`` (priority -1).

Load: open-loop Poisson arrivals at ``--rate`` requests/s (above the pool's capacity) for
``--burst`` seconds, ``--high-share`` (60%) of them ``high`` and the rest ``batch``, each a
streamed ``/v1/completions`` with ``max_tokens`` ``--max-tokens``; then a quiet period
until every request has ended. Meanwhile the EPP's ``/metrics`` is sampled every 0.5 s.

Prints: per priority, counts by HTTP status and the client-side time to first byte
(p50/p90/p99) of the successful requests; then the EPP's queue size per priority and its
pool saturation over time, showing the queues fill during the burst and drain after.

    .venv/bin/python -m tests.bench.overload [--quick] [--seed 1]

**Detectors side by side** (``--columns``): the same open-loop mix at ``--overload`` times
the pool's capacity on each of ``--servers`` (``fast``: 3 servers of 8 at once, the preset's
12 ms per token; ``slow``: 3 servers of 2 at once, 4 times slower per token; real time,
``--max-tokens`` 30), one stack per column and server kind, in one run. Columns:

- ``off``: the shipped default config (no flow control; ``utilization-detector`` sheds
  sheddable requests on a saturated pool);
- ``utilization``, ``utilization-qN``: flow control with ``utilization-detector`` at its
  defaults, or with ``queueDepthThreshold: N``;
- ``concurrency-N``: flow control with ``concurrency-detector``, ``maxConcurrency: N``;
- ``standing``: flow control with ``standing-queue-detector`` at its defaults.

Flow control is the shipped default config plus ``featureGates: [flowControl]``,
``defaultRequestTTL: --ttl`` (0: none) and the column's detector, FCFS and one ceiling of
1.0 (the defaults). The pool's capacity is computed from the simulator's timing model (a
request's duration at a full batch; ``capacity`` in the output). Per column: the requests
sent, answered, refused (429) and expired (503), the answered per second, goodput (answered
with client TTFT within ``--slo-batches`` request durations at a full batch, per second of
arrivals), and the client TTFT p50/p90 of the answered, per priority (``high`` 10 and
``batch`` -1, ``--high-share`` of them ``high``)::

    .venv/bin/python -m tests.bench.overload --columns off,utilization,concurrency-9,\
        concurrency-3,standing --servers fast,slow [--overload 2] [--burst-durations 25]

``--burst-durations N``: each server kind gets N request durations at a full batch of
arrivals (the same number of batch turnovers on fast and slow servers).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from tempfile import TemporaryDirectory

import aiohttp
import orjson

from app.config import DEFAULT_CONFIG
from tests.simulator import DEFAULT_MODEL
from tests.support.stack import Stack, StackOptions, trusted_header

# Set by the test stack's trusted filter (Envoy strips a client's x-gateway-* headers).
OBJECTIVE_HEADER = trusted_header("x-gateway-inference-objective")
QUEUE_SIZE = "inference_extension_flow_control_queue_size"
SATURATION = "inference_extension_flow_control_pool_saturation"
DISPLACED = "inference_extension_flow_control_displaced_total"

OBJECTIVES = """\
kind: InferenceObjective
metadata: {name: high}
spec: {priority: 10}
---
kind: InferenceObjective
metadata: {name: batch}
spec: {priority: -1}
"""

PRIORITY = {"high": 10, "batch": -1}


def flow_config(ttl: float, high_limit: int, low_limit: int) -> str:
    return f"""\
featureGates: [flowControl]
flowControl:
  defaultRequestTTL: {ttl:g}s
  defaultPriorityBand: {{maxRequests: {low_limit}}}
  priorityBands:
  - {{priority: 10, maxRequests: {high_limit}}}
"""


@dataclass
class Outcome:
    objective: str
    status: int
    ttfb: float | None  # seconds to the first body byte of a 200; None otherwise
    latency: float


@dataclass
class Sample:
    at: float
    queued: dict[str, float]
    saturation: float


@dataclass
class Run:
    outcomes: list[Outcome] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    displaced: float = 0.0


def parse_metrics(text: str) -> tuple[dict[str, float], float, float]:
    """Queue size per priority label, pool saturation, displaced total."""
    queued: dict[str, float] = {}
    saturation = 0.0
    displaced = 0.0
    for line in text.splitlines():
        if line.startswith("#") or not line:
            continue
        series, _, raw = line.rpartition(" ")
        name = series.split("{", 1)[0]
        if name == QUEUE_SIZE:
            priority = series.split('priority="', 1)[1].split('"', 1)[0]
            queued[priority] = queued.get(priority, 0.0) + float(raw)
        elif name == SATURATION:
            saturation = max(saturation, float(raw))
        elif name == DISPLACED:
            displaced += float(raw)
    return queued, saturation, displaced


async def one_request(
    session: aiohttp.ClientSession, url: str, objective: str, prompt: str, max_tokens: int
) -> Outcome:
    body = orjson.dumps(
        {"model": DEFAULT_MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    )
    start = time.monotonic()
    ttfb: float | None = None
    try:
        async with session.post(
            f"{url}/v1/completions", data=body, headers={OBJECTIVE_HEADER: objective}
        ) as response:
            status = response.status
            async for _chunk in response.content.iter_any():
                if ttfb is None and status == 200:
                    ttfb = time.monotonic() - start
    except (aiohttp.ClientError, TimeoutError):
        status = 0
    return Outcome(objective, status, ttfb, time.monotonic() - start)


async def sampler(
    session: aiohttp.ClientSession, metrics_url: str, run: Run, t0: float, done: asyncio.Event
) -> None:
    """Samples the EPP's metrics every 0.5 s until 3 samples after ``done``."""
    after_done = 0
    while after_done < 3:
        if done.is_set():
            after_done += 1
        try:
            async with session.get(metrics_url) as response:
                queued, saturation, displaced = parse_metrics(await response.text())
            run.samples.append(Sample(time.monotonic() - t0, queued, saturation))
            run.displaced = displaced
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.5)  # the sampling period


async def send_open(
    session: aiohttp.ClientSession,
    url: str,
    rate: float,
    args: argparse.Namespace,
    rng: random.Random,
    t0: float,
) -> list[asyncio.Task[Outcome]]:
    """Poisson arrivals at ``rate`` from ``t0`` for ``--burst`` seconds, each request a task
    (``--high-share`` of them ``high``, the others ``batch``); returns once all are sent."""
    tasks: list[asyncio.Task[Outcome]] = []
    next_at = 0.0
    while True:
        next_at += rng.expovariate(rate)
        if next_at > args.burst:
            return tasks
        delay = t0 + next_at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)  # open-loop pacing, not waiting for a condition
        objective = "high" if rng.random() < args.high_share else "batch"
        prompt = prompt_of(len(tasks))
        tasks.append(
            asyncio.create_task(one_request(session, url, objective, prompt, args.max_tokens))
        )


async def drive(stack: Stack, args: argparse.Namespace) -> Run:
    rng = random.Random(args.seed)
    run = Run()
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=args.ttl + 60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        done = asyncio.Event()
        t0 = time.monotonic()
        sampling = asyncio.create_task(sampler(session, stack.epp_metrics_url, run, t0, done))
        tasks = await send_open(session, stack.url, args.rate, args, rng, t0)
        print(f"sent {len(tasks)} requests in {time.monotonic() - t0:.1f}s; waiting for all")
        run.outcomes = list(await asyncio.gather(*tasks))
        done.set()  # the sampler takes a few more samples: the queues at rest
        await sampling
    return run


def percentile(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


def report(run: Run, args: argparse.Namespace) -> None:
    print()
    print("per priority (client side, through Envoy):")
    print(
        f"{'objective':>10} {'prio':>5} {'sent':>5} {'200':>5} {'429':>5} {'503':>5} "
        f"{'other':>5} {'TTFB p50':>9} {'p90':>7} {'p99':>7}"
    )
    for objective in ("high", "batch"):
        mine = [o for o in run.outcomes if o.objective == objective]
        statuses = Counter(o.status for o in mine)
        other = sum(n for s, n in statuses.items() if s not in (200, 429, 503))
        ttfbs = [o.ttfb for o in mine if o.ttfb is not None]
        print(
            f"{objective:>10} {PRIORITY[objective]:>5} {len(mine):>5} {statuses[200]:>5} "
            f"{statuses[429]:>5} {statuses[503]:>5} {other:>5} "
            f"{percentile(ttfbs, 50):>8.2f}s {percentile(ttfbs, 90):>6.2f}s "
            f"{percentile(ttfbs, 99):>6.2f}s"
        )
    others = Counter(o.status for o in run.outcomes if o.status not in (200, 429, 503))
    if others:
        print(f"other statuses: {dict(others)}")
    print(f"displaced (EPP counter): {run.displaced:.0f}")
    print()
    print(f"EPP queue size over time (burst ends at {args.burst:.0f}s):")
    print(f"{'t':>6} {'prio 10':>8} {'prio -1':>8} {'saturation':>11}")
    for sample in run.samples:
        print(
            f"{sample.at:>5.1f}s {sample.queued.get('10', 0.0):>8.0f} "
            f"{sample.queued.get('-1', 0.0):>8.0f} {sample.saturation:>11.2f}"
        )
    if run.samples:
        last = run.samples[-1]
        drained = sum(last.queued.values()) == 0
        print(f"queues drained after the burst: {'yes' if drained else 'NO'}")


@dataclass(frozen=True)
class Servers:
    """A kind of model server: what it runs at once and its timing (real seconds)."""

    max_num_seqs: int
    prefill_overhead: float
    prefill_per_token: float
    itl: float
    load_alpha: float = 1.5

    def args(self) -> list[str]:
        return [
            "--preset",
            "h100-8b",
            "--time-scale",
            "1",
            "--max-num-seqs",
            str(self.max_num_seqs),
            "--prefill-overhead-ms",
            f"{self.prefill_overhead * 1000:g}",
            "--prefill-per-token-ms",
            f"{self.prefill_per_token * 1000:g}",
            "--itl-ms",
            f"{self.itl * 1000:g}",
        ]

    def full_batch_duration(self, prompt_tokens: int, max_tokens: int) -> float:
        """A request's duration on a server running a full batch (the simulator's model)."""
        n = self.max_num_seqs
        load = 1 + self.load_alpha * (n - 1) / n
        prefill = (self.prefill_overhead + prompt_tokens * self.prefill_per_token) * load
        return prefill + (max_tokens - 1) * self.itl * load


SERVERS = {
    "fast": Servers(max_num_seqs=8, prefill_overhead=0.030, prefill_per_token=0.00025, itl=0.012),
    "slow": Servers(max_num_seqs=2, prefill_overhead=0.120, prefill_per_token=0.001, itl=0.048),
}


def prompt_of(index: int) -> str:
    return f"request {index}: " + "tell me something interesting. " * 8


def column_config(column: str, ttl: float) -> str:
    """The EPP config of a column (JSON, which the YAML loader reads)."""
    config: dict[str, object] = dict(DEFAULT_CONFIG)
    if column == "off":
        return orjson.dumps(config).decode()
    if column == "standing":
        plugin: dict[str, object] = {"type": "standing-queue-detector"}
    elif column == "utilization":
        plugin = {"type": "utilization-detector"}
    elif column.startswith("utilization-q"):
        threshold = int(column.removeprefix("utilization-q"))
        plugin = {"type": "utilization-detector", "parameters": {"queueDepthThreshold": threshold}}
    elif column.startswith("concurrency-"):
        limit = int(column.removeprefix("concurrency-"))
        plugin = {"type": "concurrency-detector", "parameters": {"maxConcurrency": limit}}
    else:
        raise SystemExit(f"unknown column {column!r}")
    plugins = list(config["plugins"])  # type: ignore[call-overload]
    plugins.append(plugin)
    config["plugins"] = plugins
    flow: dict[str, object] = {"saturationDetector": {"pluginRef": plugin["type"]}}
    if ttl > 0:
        flow["defaultRequestTTL"] = f"{ttl:g}s"
    config["featureGates"] = ["flowControl"]
    config["flowControl"] = flow
    return orjson.dumps(config).decode()


async def drive_open(url: str, rate: float, args: argparse.Namespace) -> list[Outcome]:
    """Poisson arrivals at ``rate`` for ``--burst`` seconds; every request's outcome."""
    rng = random.Random(args.seed)
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=args.burst + max(args.ttl, 60.0) + 120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        tasks = await send_open(session, url, rate, args, rng, time.monotonic())
        return list(await asyncio.gather(*tasks))


def run_columns(args: argparse.Namespace) -> None:
    columns = args.columns.split(",")
    prompt_tokens = len(prompt_of(0)) // 4
    print(f"load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}", flush=True)
    results: list[tuple[str, str, float, float, list[Outcome]]] = []
    for kind in args.servers.split(","):
        servers = SERVERS[kind]
        duration = servers.full_batch_duration(prompt_tokens, args.max_tokens)
        capacity = args.instances * servers.max_num_seqs / duration
        rate = args.overload * capacity
        slo = args.slo_batches * duration
        if args.burst_durations:
            args.burst = args.burst_durations * duration
        print(
            f"{kind}: {args.instances} servers of {servers.max_num_seqs} at once, a request"
            f" {duration:.2f}s at a full batch; capacity {capacity:.1f}/s, offered"
            f" {rate:.1f}/s for {args.burst:g}s ({args.high_share:.0%} high), SLO TTFT"
            f" {slo:.2f}s",
            flush=True,
        )
        for column in columns:
            options = StackOptions(
                simulators=args.instances,
                simulator_base_ip="127.0.0.70",
                simulator_args=servers.args(),
                epp_args=[
                    "--config-text",
                    column_config(column, args.ttl),
                    "--static-objectives",
                    str(args.objectives),
                ],
            )
            with Stack.run(options) as stack:
                outcomes = asyncio.run(drive_open(stack.url, rate, args))
            results.append((kind, column, slo, args.burst, outcomes))
            print(f"  {kind} {column}: done (load average {os.getloadavg()[0]:.2f})", flush=True)
    print()
    header = (
        f"{'servers':<6} {'column':<15} {'class':<6} {'sent':>5} {'200':>5} {'429':>5} "
        f"{'503':>5} {'200/s':>6} {'goodput/s':>10} {'TTFT p50':>9} {'p90':>8}"
    )
    print(header)
    for kind, column, slo, burst, outcomes in results:
        for objective in ("all", "high", "batch"):
            mine = [o for o in outcomes if objective in ("all", o.objective)]
            statuses = Counter(o.status for o in mine)
            ttfbs = [o.ttfb for o in mine if o.ttfb is not None]
            good = sum(1 for t in ttfbs if t <= slo)
            print(
                f"{kind:<6} {column:<15} {objective:<6} {len(mine):>5} {statuses[200]:>5} "
                f"{statuses[429]:>5} {statuses[503]:>5} {statuses[200] / burst:>6.2f} "
                f"{good / burst:>10.2f} {percentile(ttfbs, 50):>8.3f}s "
                f"{percentile(ttfbs, 90):>7.3f}s"
            )
        others = Counter(o.status for o in outcomes if o.status not in (200, 429, 503))
        if others:
            print(f"{'':<6} {column:<15} other statuses: {dict(others)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="shorter burst and TTL")
    parser.add_argument("--instances", type=int, default=3)
    parser.add_argument("--time-scale", type=float, default=0.3)
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--rate", type=float, default=50.0, help="arrivals per second")
    parser.add_argument("--burst", type=float, default=20.0, help="seconds of arrivals")
    parser.add_argument("--high-share", type=float, help="0.6; 0.4 with --columns")
    parser.add_argument("--max-tokens", type=int, help="100; 30 with --columns")
    parser.add_argument("--ttl", type=float, default=10.0, help="defaultRequestTTL (s)")
    parser.add_argument("--high-band-limit", type=int, default=200)
    parser.add_argument("--low-band-limit", type=int, default=60)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--columns", help="detectors side by side (see the docstring)")
    parser.add_argument("--servers", default="fast,slow", help="server kinds, with --columns")
    parser.add_argument(
        "--overload", type=float, default=2.0, help="offered load / capacity, with --columns"
    )
    parser.add_argument(
        "--burst-durations",
        type=float,
        help="with --columns: seconds of arrivals in request durations at a full batch"
        " (instead of --burst)",
    )
    parser.add_argument(
        "--slo-batches",
        type=float,
        default=1.0,
        help="goodput's TTFT SLO in request durations at a full batch, with --columns",
    )
    args = parser.parse_args()
    if args.columns:
        args.max_tokens = args.max_tokens or 30
        args.high_share = 0.4 if args.high_share is None else args.high_share
        with TemporaryDirectory(prefix="overload-") as tmp:
            args.objectives = Path(tmp) / "objectives.yaml"
            args.objectives.write_text(OBJECTIVES)
            run_columns(args)
        return
    args.max_tokens = args.max_tokens or 100
    args.high_share = 0.6 if args.high_share is None else args.high_share
    if args.quick:
        args.burst = min(args.burst, 8.0)
        args.ttl = min(args.ttl, 5.0)

    config = flow_config(args.ttl, args.high_band_limit, args.low_band_limit)
    print(
        f"{args.instances} simulators (h100-8b, time scale {args.time_scale}, max-num-seqs "
        f"{args.max_num_seqs}); {args.rate:g} req/s for {args.burst:g}s, "
        f"{args.high_share:.0%} priority 10; max_tokens {args.max_tokens}"
    )
    print("EPP config:\n" + config)
    with TemporaryDirectory(prefix="overload-") as tmp:
        objectives = Path(tmp) / "objectives.yaml"
        objectives.write_text(OBJECTIVES)
        options = StackOptions(
            simulators=args.instances,
            simulator_base_ip="127.0.0.70",
            simulator_args=[
                "--preset",
                "h100-8b",
                "--time-scale",
                str(args.time_scale),
                "--max-num-seqs",
                str(args.max_num_seqs),
            ],
            epp_args=["--config-text", config, "--static-objectives", str(objectives)],
        )
        with Stack.run(options) as stack:
            run = asyncio.run(drive(stack, args))
    report(run, args)


if __name__ == "__main__":
    main()
