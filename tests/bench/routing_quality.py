"""Benchmark (not a test): routing quality of the EPP's default profile against random routing.

Runs the same shared-prefix workload twice through Envoy, each time on a fresh stack
(``tests.support.stack``: simulated vLLM instances with the ``h100-8b`` timing preset and
a small KV cache, the EPP, Envoy from the shipped config):

- ``default``: the EPP without a config (queue, KV-cache-utilization and prefix-cache
  scorers, max-score picker);
- ``sticky``: "sticky until saturated" (``tests.bench.profiles.sticky_config``):
  ``prefix-cache-affinity-filter`` with its TTFT gate, ``token-load-scorer`` with the prompt
  look-ahead, ``max-score-picker``; ``peakPrefillThroughput`` is the simulator's 4,000
  tokens/s;
- ``random``: the EPP with a config of only ``random-picker`` (uniformly random routing).

Workload: ``--groups`` (20) groups of ``--prompts-per-group`` (5) prompts; each prompt is
the group's ~2,000-token system prompt (8,000 characters: 125 whole 64-character blocks, so
the EPP's approximate prefix index and the simulators' block hashes cut it alike) followed
by its own ~200-token question, sent ``--rounds`` times each (6; ``--quick``: 2), every
round in a seeded random order (the same order both times), as streamed
``/v1/completions`` requests with ``max_tokens`` = ``--max-tokens`` (30), by
``--concurrency`` (24) closed-loop workers. Each simulator has ``--num-gpu-blocks`` (480)
KV blocks of 16 tokens: about 3.8 group prefixes, fewer than the 5 groups per instance a
perfect partition would need, so cache pressure matters and requests queue for blocks.
``--time-scale`` (0.5; ``--quick``: 0.2) shortens every simulated wait.

Prints, side by side: the prefix-cache hit rate from the simulators' own counters
(``GET /sim/stats``: hits / queries in tokens, summed over instances), the simulators' TTFT
p50/p90/p99 and mean queue time (in simulated time: what an H100 would show), the
client's time to first byte p50/p90 and latency p50 (real time, through Envoy and the EPP),
requests per instance, how many instances served each group, KV evictions, preemptions and
errors. A full run takes about a minute on 2 cores, ``--quick`` about 15 s.

    .venv/bin/python -m tests.bench.routing_quality [--quick] [--seed 1]
        [--modes default,sticky,random]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from tests.bench.profiles import RANDOM_CONFIG, sticky_config
from tests.simulator import DEFAULT_MODEL
from tests.simulator.server import INSTANCE_HEADER
from tests.support.stack import Stack, StackOptions

MODES: dict[str, list[str]] = {
    "default": [],
    "sticky": ["--config-text", sticky_config()],
    "random": ["--config-text", RANDOM_CONFIG],
}

SYSTEM_CHARS = 8000  # 2,000 pseudo-tokens = 125 blocks of 16 tokens (64 characters)
QUESTION_CHARS = 800  # 200 pseudo-tokens
_VOCABULARY = (
    "cluster node pod gateway request model token cache prefix latency queue batch replica "
    "service route policy weight score filter picker endpoint metric server adapter memory "
    "block budget deadline priority tenant shard region"
)
_WORDS = tuple(_VOCABULARY.split())


def _text(rng: random.Random, length: int, head: str) -> str:
    """``head`` then random words, cut to exactly ``length`` characters."""
    parts = [head]
    size = len(head)
    while size < length:
        word = rng.choice(_WORDS)
        parts.append(word)
        size += len(word) + 1
    return " ".join(parts)[:length]


def build_workload(
    *, groups: int, prompts_per_group: int, rounds: int, seed: int
) -> list[tuple[int, str]]:
    """``(group, prompt)`` in sending order: every prompt ``rounds`` times, each round
    shuffled."""
    rng = random.Random(seed)
    prompts: list[tuple[int, str]] = []
    for g in range(groups):
        system = _text(rng, SYSTEM_CHARS, f"System prompt of group {g:03d}: you are assistant")
        for p in range(prompts_per_group):
            question = _text(rng, QUESTION_CHARS, f"\nQuestion {g:03d}.{p:02d}:")
            prompts.append((g, system + question))
    order: list[tuple[int, str]] = []
    for _ in range(rounds):
        batch = list(prompts)
        rng.shuffle(batch)
        order.extend(batch)
    return order


@dataclass
class ClientRecord:
    ttfb_ms: list[float] = field(default_factory=list)
    latency_ms: list[float] = field(default_factory=list)
    instances: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    # how many distinct instances served each group (affinity)
    group_instances: dict[int, set[str]] = field(default_factory=dict)


async def send_one(
    session: aiohttp.ClientSession,
    url: str,
    group: int,
    prompt: str,
    max_tokens: int,
    rec: ClientRecord,
) -> None:
    body = orjson.dumps(
        {
            "model": DEFAULT_MODEL,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "stream": True,
            "temperature": 0,
        }
    )
    start = time.perf_counter()
    try:
        async with session.post(
            f"{url}/v1/completions", data=body, headers={"content-type": "application/json"}
        ) as response:
            if response.status != 200:
                rec.errors[f"HTTP {response.status}"] += 1
                await response.read()
                return
            first = await response.content.readany()
            ttfb = time.perf_counter() - start
            if not first:
                rec.errors["empty body"] += 1
                return
            rest = await response.read()
            if b"[DONE]" not in first + rest:
                rec.errors["stream without [DONE]"] += 1
                return
            instance = response.headers.get(INSTANCE_HEADER, "?")
    except (aiohttp.ClientError, TimeoutError) as exc:
        rec.errors[type(exc).__name__] += 1
        return
    rec.ttfb_ms.append(ttfb * 1e3)
    rec.latency_ms.append((time.perf_counter() - start) * 1e3)
    rec.instances[instance] += 1
    rec.group_instances.setdefault(group, set()).add(instance)


async def drive(
    url: str, workload: Sequence[tuple[int, str]], concurrency: int, max_tokens: int
) -> tuple[ClientRecord, float]:
    rec = ClientRecord()
    queue: asyncio.Queue[tuple[int, str]] = asyncio.Queue()
    for item in workload:
        queue.put_nowait(item)
    connector = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def worker() -> None:
            while True:
                try:
                    group, prompt = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                await send_one(session, url, group, prompt, max_tokens, rec)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    return rec, elapsed


async def sim_stats(urls: dict[str, str]) -> dict[str, dict[str, Any]]:
    async with aiohttp.ClientSession() as session:
        documents: dict[str, dict[str, Any]] = {}
        for name, url in sorted(urls.items()):
            async with session.get(f"{url}/sim/stats", params={"samples": "1"}) as response:
                documents[name] = orjson.loads(await response.read())
        return documents


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


@dataclass(frozen=True)
class Outcome:
    mode: str
    elapsed: float
    requests: int
    hit_rate: float
    sim_ttft_ms: tuple[float, float, float]
    sim_queue_ms_mean: float
    ttfb_ms: tuple[float, float]
    latency_ms_p50: float
    per_instance: dict[str, int]
    evictions: int
    preemptions: int
    errors: dict[str, int]
    instances_per_group: float


def simulator_args(args: argparse.Namespace) -> list[str]:
    """The simulators' flags for this run (preset, time scale, KV blocks, max seqs)."""
    result = [
        "--preset",
        "h100-8b",
        "--time-scale",
        str(args.time_scale),
        "--num-gpu-blocks",
        str(args.num_gpu_blocks),
    ]
    if args.max_num_seqs:
        result += ["--max-num-seqs", str(args.max_num_seqs)]
    return result


def summarise(
    mode: str, rec: ClientRecord, elapsed: float, stats: dict[str, dict[str, Any]]
) -> Outcome:
    """One column: the client's record and the simulators' counters (``/sim/stats``)."""
    hits = sum(d["prefix_cache"]["hits"] for d in stats.values())
    queries = sum(d["prefix_cache"]["queries"] for d in stats.values())
    ttft = [s * 1e3 for d in stats.values() for s in d["ttft_samples"]]
    queued = sum(d["queue_time"]["count"] for d in stats.values())
    queue_mean_ms = (
        sum(d["queue_time"]["sum"] for d in stats.values()) / queued * 1e3 if queued else 0.0
    )
    return Outcome(
        mode=mode,
        elapsed=elapsed,
        requests=len(rec.ttfb_ms),
        hit_rate=hits / queries if queries else math.nan,
        sim_ttft_ms=(
            percentile(ttft, 0.5),
            percentile(ttft, 0.9),
            percentile(ttft, 0.99),
        ),
        sim_queue_ms_mean=queue_mean_ms,
        ttfb_ms=(percentile(rec.ttfb_ms, 0.5), percentile(rec.ttfb_ms, 0.9)),
        latency_ms_p50=percentile(rec.latency_ms, 0.5),
        per_instance={
            name: sum(d["requests"]["finished"].values()) for name, d in sorted(stats.items())
        },
        evictions=sum(d["kv_cache"]["evictions"] for d in stats.values()),
        preemptions=sum(d["requests"]["preemptions"] for d in stats.values()),
        errors=dict(rec.errors),
        instances_per_group=(
            sum(len(s) for s in rec.group_instances.values()) / len(rec.group_instances)
            if rec.group_instances
            else math.nan
        ),
    )


def run_mode(mode: str, args: argparse.Namespace, workload: Sequence[tuple[int, str]]) -> Outcome:
    options = StackOptions(
        simulators=args.instances,
        simulator_base_ip=args.base_ip,
        simulator_args=simulator_args(args),
        epp_args=MODES[mode],
    )
    with Stack.run(options) as stack:
        rec, elapsed = asyncio.run(drive(stack.url, workload, args.concurrency, args.max_tokens))
        stats = asyncio.run(sim_stats(stack.simulator_urls))
    return summarise(mode, rec, elapsed, stats)


def print_table(
    outcomes: Sequence[Outcome], extra_rows: Sequence[tuple[str, list[str]]] = ()
) -> None:
    """The columns side by side; ``extra_rows`` (label, one value per column) go last."""
    rows: list[tuple[str, list[str]]] = [
        ("requests ok", [str(o.requests) for o in outcomes]),
        (
            "errors",
            [str(sum(o.errors.values())) + (f" {o.errors}" if o.errors else "") for o in outcomes],
        ),
        ("wall time (s)", [f"{o.elapsed:.1f}" for o in outcomes]),
        ("prefix-cache hit rate (tokens)", [f"{o.hit_rate:.1%}" for o in outcomes]),
        ("sim TTFT p50 (ms, simulated)", [f"{o.sim_ttft_ms[0]:.0f}" for o in outcomes]),
        ("sim TTFT p90 (ms, simulated)", [f"{o.sim_ttft_ms[1]:.0f}" for o in outcomes]),
        ("sim TTFT p99 (ms, simulated)", [f"{o.sim_ttft_ms[2]:.0f}" for o in outcomes]),
        ("sim queue time mean (ms, simulated)", [f"{o.sim_queue_ms_mean:.0f}" for o in outcomes]),
        ("client TTFB p50 (ms, real)", [f"{o.ttfb_ms[0]:.0f}" for o in outcomes]),
        ("client TTFB p90 (ms, real)", [f"{o.ttfb_ms[1]:.0f}" for o in outcomes]),
        ("client latency p50 (ms, real)", [f"{o.latency_ms_p50:.0f}" for o in outcomes]),
        (
            "requests per instance",
            [" ".join(str(v) for v in o.per_instance.values()) for o in outcomes],
        ),
        ("instances per group (mean)", [f"{o.instances_per_group:.2f}" for o in outcomes]),
        ("KV evictions (blocks)", [str(o.evictions) for o in outcomes]),
        ("preemptions", [str(o.preemptions) for o in outcomes]),
        *extra_rows,
    ]
    width = max(len(label) for label, _ in rows)
    columns = [max(len(o.mode), *(len(r[1][i]) for r in rows)) for i, o in enumerate(outcomes)]
    print(
        f"{'':<{width}}  "
        + "  ".join(f"{o.mode:>{c}}" for o, c in zip(outcomes, columns, strict=True))
    )
    for label, values in rows:
        print(
            f"{label:<{width}}  "
            + "  ".join(f"{v:>{c}}" for v, c in zip(values, columns, strict=True))
        )


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The workload's and the simulators' flags (shared with ``tests.bench.replicas``)."""
    parser.add_argument(
        "--quick", action="store_true", help="a ~30 s run: 2 rounds at time scale 0.2"
    )
    parser.add_argument("--instances", type=int, default=4)
    parser.add_argument("--groups", type=int, default=20)
    parser.add_argument("--prompts-per-group", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=None, help="default 6 (--quick: 2)")
    parser.add_argument("--concurrency", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=30)
    parser.add_argument("--time-scale", type=float, default=None, help="default 0.5 (--quick: 0.2)")
    parser.add_argument("--num-gpu-blocks", type=int, default=480, help="per instance")
    parser.add_argument("--max-num-seqs", type=int, default=0, help="0: the preset's")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--base-ip", default="127.0.0.200")


def finish_workload_arguments(args: argparse.Namespace) -> None:
    """Fill in the defaults that depend on ``--quick``."""
    if args.rounds is None:
        args.rounds = 2 if args.quick else 6
    if args.time_scale is None:
        args.time_scale = 0.2 if args.quick else 0.5


def describe(args: argparse.Namespace, workload: Sequence[tuple[int, str]]) -> str:
    """One line saying what runs: simulators, cache size, workload."""
    blocks_per_prefix = SYSTEM_CHARS // 64
    return (
        f"{args.instances} simulators (h100-8b, time scale {args.time_scale},"
        f" {args.num_gpu_blocks} KV blocks each = {args.num_gpu_blocks / blocks_per_prefix:.1f}"
        f" group prefixes); {args.groups} groups x {args.prompts_per_group} prompts"
        f" ({SYSTEM_CHARS + QUESTION_CHARS} chars) x {args.rounds} rounds = {len(workload)}"
        f" requests, max_tokens {args.max_tokens}, {args.concurrency} concurrent, seed {args.seed}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_arguments(parser)
    parser.add_argument("--modes", default="default,sticky,random")
    args = parser.parse_args()
    finish_workload_arguments(args)

    workload = build_workload(
        groups=args.groups,
        prompts_per_group=args.prompts_per_group,
        rounds=args.rounds,
        seed=args.seed,
    )
    print(describe(args, workload))
    outcomes = []
    for mode in args.modes.split(","):
        started = time.perf_counter()
        outcome = run_mode(mode, args, workload)
        print(f"  {mode}: done in {time.perf_counter() - started:.0f} s", flush=True)
        outcomes.append(outcome)
    print()
    print_table(outcomes)


if __name__ == "__main__":
    main()
