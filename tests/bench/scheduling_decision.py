"""Benchmark (not a test): one scheduling decision of the EPP with the default profile.

A request goes through the Director as the gRPC server hands it over: ``route()`` on the
exchange that ``Director.open`` returns, with the Director built by ``configured_director``
from the in-tree default config ("sticky until saturated": approx-prefix-cache-producer
without autoTune, inflight-load-producer, prefix-cache-affinity-filter,
metrics-freshness-filter, token-load-scorer, max-score-picker, kv-capacity-gate,
single-profile-handler),
inside one asyncio loop (uvloop when installed).
One decision is the OpenAI body parse (orjson), the prefix hashing (xxh64), the prefix-index
match, the in-flight load lookup, the filters, the scorer and the picker, and the PreRequest
hooks (index update, load booking, the KV gate's count: one request is in flight at a time,
so it never waits). Its wall time (and the thread's
CPU time) is taken with ``perf_counter_ns`` around ``route()``; ``close()`` runs after each
request, untimed. The PreRequest hook is wrapped in a thin timer (one extra coroutine call)
so that its share is reported too. Observability is off (the Director's no-op observer).

The matrix: 10, 100 and 1,000 endpoints with varied, fresh metrics (refreshed every
``REFRESH_EVERY`` decisions, outside the timing) x completions bodies of 4 KiB, 32 KiB and
220 KiB of English-like text. Half of the requests start with one of ``SHARED_PREFIXES``
long prefixes (three quarters of the prompt) that earlier requests used; the others are new
text. Before timing, every endpoint's prefix index is filled to ``--fill`` of its capacity
(``cache_num_blocks``, the steady state of a long-running EPP) with older hashes, then a
warm-up routes ``--warmup`` requests of the cell's kind. GC runs as in production (enabled,
default thresholds); the collections that fall inside timed decisions are reported.

Prints per cell the p50/p99/p99.9/max of ``route()`` in µs, the PreRequest hook's part of
it, the decisions per second of one core (1 / mean) and the GC collections; then, for
100 endpoints x 4 KiB (or ``--cell`` / ``--breakdown``), the time of each piece called
directly (parse, hashing, index match, attributes, scoring+picking, index update).
``--quick`` runs 10x4k, 100x4k and 100x32k with a 20 % filled index in a few seconds;
``--cell 100x4k --no-breakdown`` suits a profiler.

    .venv/bin/python -m tests.bench.scheduling_decision [--quick] [--cell 100x4k]
        [--breakdown 1000x4k] [--no-breakdown] [--iterations N] [--warmup N]
        [--fill 1.0] [--capacity 31250] [--seed 1] [--no-uvloop] [--profile reference|sticky]

``--profile reference`` measures the reference's default (queue-scorer 2,
kv-cache-utilization-scorer 2, prefix-cache-scorer 3; the default here until 2026-11-24) and
prints the per-piece breakdown, which calls that profile's pieces by name; ``--profile
sticky`` measures ``tests.bench.profiles.sticky_config`` (the prefix index auto-tuned).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib.metadata
import os
import platform
import random
import statistics
import sys
import time
from array import array
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from app.config import REFERENCE_DEFAULT_CONFIG_TEXT
from domain.datastore.endpoint import Endpoint, EndpointMetrics
from domain.datastore.store import Datastore
from domain.plugins.base import TypedName
from domain.plugins.state import RequestStates
from domain.prefixcache.index import InMemoryPrefixIndex
from domain.requestcontrol.director import Director
from domain.requestcontrol.plugins.prefix_producer import (
    CHARS_PER_TOKEN,
    ApproxPrefixCacheProducer,
)
from domain.scheduling.interfaces import CycleState
from domain.scheduling.types import (
    Candidate,
    InferenceRequest,
    SchedulingResult,
    ScoredCandidate,
)
from ports.codec import JsonCodec
from ports.endpoints import EndpointAddress, EndpointEvent, EndpointEventKind, EndpointInfo
from ports.metric_catalogue import PREFIX_INDEXER_HIT_RATIO, HistogramMetric
from ports.observer import NoopObserver
from ports.prefix_index import BlockHasher
from ports.requests import InboundRequest
from tests.bench.profiles import sticky_config
from tests.support.director import configured_director

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
ENDPOINT_COUNTS = (10, 100, 1000)
#: Label → target body size in bytes.
PROMPT_SIZES: dict[str, int] = {"4k": 4 * 1024, "32k": 32 * 1024, "220k": 220 * 1024}
#: vLLM's default KV block size, in tokens.
CACHE_BLOCK_TOKENS = 16
SHARED_PREFIXES = 32
SHARED_FRACTION = 0.5
#: Share of the prompt taken by a shared prefix.
PREFIX_SHARE = 0.75
#: Endpoint metrics are replaced every this many decisions (~ a 50 ms scrape at 1k req/s).
REFRESH_EVERY = 20
TARGET_CELL = (100, "4k")
#: The configs ``--profile`` picks from (None: the in-tree default).
PROFILES: dict[str, str | None] = {
    "default": None,
    "reference": REFERENCE_DEFAULT_CONFIG_TEXT,
    "sticky": sticky_config(15928.0),
}
TARGET_P99_US = 1000.0
CORPUS_CHARS = 1_500_000

# Text generation: common English words, some technical vocabulary, now and then a code
# block or typographic punctuation (as real prompts pasted from documents have).
_COMMON_TEXT = (
    "the of and to in is that for it as with was on be by this are from or have an they "
    "which one you were her all she there would their we him been has when who will more "
    "no if out so said what up its about into than them can only other new some could time "
    "these two may then do first any my now such like our over man me even most made after "
    "also did many before must through back years where much your way well down should "
    "because each just those people how too little state good very make world still own "
    "see men work long get here between both life being under never day same another know "
    "while last might us great old year off come since against go came right used take "
    "three small large next early important few public bad able"
)
_TECHNICAL_TEXT = (
    "model inference cluster request latency token cache gateway endpoint scheduler "
    "throughput replica deployment container memory accelerator batch queue prefix "
    "context window embedding transformer attention layer parameter gradient dataset "
    "pipeline service network protocol configuration metric threshold policy budget "
    "capacity tenant region storage database index query response stream session"
)
_COMMON = tuple(_COMMON_TEXT.split())
_TECHNICAL = tuple(_TECHNICAL_TEXT.split())
_CODE = (
    "```python\n"
    "def handle(request: dict[str, str]) -> str:\n"
    '    """Return the route for a request."""\n'
    '    if request.get("priority") == "high":\n'
    '        return "fast-path"\n'
    '    return f"pool-{hash(request[\\"user\\"]) % 8}"\n'
    "```\n\n"
)


def _sentence(rng: random.Random) -> str:
    words = [
        rng.choice(_TECHNICAL) if rng.random() < 0.2 else rng.choice(_COMMON)
        for _ in range(rng.randint(6, 22))
    ]
    words[0] = words[0].capitalize()
    if rng.random() < 0.15:
        words.insert(rng.randint(1, len(words) - 1), f"{rng.randint(2, 4096)}")
    text = " ".join(words)
    roll = rng.random()
    if roll < 0.03:
        text = f"\u201c{text}\u201d"  # curly quotes
    elif roll < 0.05:
        text = text.replace(" ", " \u2014 ", 1)  # an em dash
    elif roll < 0.10:
        text = f'"{text}"'
    return text + rng.choice((".", ".", ".", "?", "!", ":", ";"))


def make_corpus(rng: random.Random, chars: int) -> str:
    """About ``chars`` characters of paragraphs of English-like text."""
    parts: list[str] = []
    total = 0
    while total < chars:
        if rng.random() < 0.06:
            paragraph = _CODE
        else:
            paragraph = " ".join(_sentence(rng) for _ in range(rng.randint(3, 8))) + "\n\n"
        parts.append(paragraph)
        total += len(paragraph)
    return "".join(parts)


def completions_body(prompt: str) -> bytes:
    return orjson.dumps(
        {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": 256,
            "temperature": 0.7,
            "top_p": 0.95,
            "stream": True,
            "stream_options": {"include_usage": True},
            "user": "bench-client",
        }
    )


def request_headers(request_id: str, body: bytes) -> dict[str, str]:
    """Headers as Envoy's ext_proc hands them over (lower case, pseudo-headers included)."""
    return {
        ":method": "POST",
        ":path": "/v1/completions",
        ":authority": "inference-gateway.example.com",
        ":scheme": "https",
        "content-type": "application/json",
        "content-length": str(len(body)),
        "accept": "application/json",
        "user-agent": "OpenAI/Python 1.51.0",
        "x-forwarded-for": "10.244.3.17",
        "x-forwarded-proto": "https",
        "x-request-id": request_id,
    }


class Prompts:
    """Completions requests of one body size: a share starts with a shared prefix.

    A shared request is one of ``SHARED_PREFIXES`` prefixes (popularity 1/k) followed by a
    unique question; a fresh one starts with a unique line, so none of its blocks match.
    """

    def __init__(
        self, corpus: str, body_bytes: int, rng: random.Random, label: str, shared: float
    ) -> None:
        self._corpus = corpus
        self._rng = rng
        self._label = label
        self._shared = shared
        self._serial = 0
        self.length = body_bytes - len(completions_body(""))
        prefix_chars = int(self.length * PREFIX_SHARE)
        self.prefixes = []
        for k in range(SHARED_PREFIXES):
            head = f"You are assistant {k} of team {label}. Answer from the documents below.\n\n"
            start = rng.randrange(len(corpus) - prefix_chars)
            self.prefixes.append((head + corpus[start : start + prefix_chars])[:prefix_chars])
        self._weights = [1.0 / (k + 1) for k in range(SHARED_PREFIXES)]
        self.shared_count = 0

    def _text(self, head: str) -> str:
        need = max(0, self.length - len(head))
        start = self._rng.randrange(len(self._corpus) - need)
        return head + self._corpus[start : start + need]

    def prompt(self, prefix: int | None = None) -> str:
        self._serial += 1
        serial = self._serial
        if prefix is None and self._rng.random() >= self._shared:
            return self._text(f"Conversation {self._label}-{serial:08d}, new session.\n\n")
        if prefix is None:
            prefix = self._rng.choices(range(SHARED_PREFIXES), self._weights)[0]
        self.shared_count += 1
        return self._text(f"{self.prefixes[prefix]}\n\nQuestion {serial}: ")

    def inbound(self, prefix: int | None = None) -> InboundRequest:
        body = completions_body(self.prompt(prefix))
        request_id = f"{self._label}-{self._serial:08d}-{self._rng.getrandbits(48):012x}"
        return InboundRequest(
            request_id=request_id, headers=request_headers(request_id, body), body=body
        )


class Pool:
    """``count`` endpoints in a Datastore, their metrics replaced by ``refresh``."""

    def __init__(self, count: int, capacity: int, rng: random.Random) -> None:
        self.rng = rng
        self.capacity = capacity
        self.datastore = Datastore()
        for i in range(count):
            suffix = "".join(rng.choice("bcdfghjklmnpqrstvwxz2456789") for _ in range(5))
            pod = f"vllm-llama-3-1-8b-6b9d8c7f5-{suffix}"
            ip = f"10.{16 + i // 62500}.{(i // 250) % 250}.{i % 250 + 1}"
            info = EndpointInfo(
                name=f"{pod}-rank-0",
                address=EndpointAddress(ip=ip, port=8000),
                pod_name=pod,
                namespace="inference",
                labels={"app": "vllm-llama-3-1-8b", "pod-template-hash": "6b9d8c7f5"},
                metrics_host=f"{ip}:8000",
            )
            self.datastore.apply(EndpointEvent(kind=EndpointEventKind.ADD_OR_UPDATE, endpoint=info))
        self.datastore.mark_synced()
        self.endpoints: tuple[Endpoint, ...] = self.datastore.endpoints()
        self.refresh()

    def refresh(self) -> None:
        """Fresh metrics for every endpoint, as a loaded vLLM pool reports them."""
        rng = self.rng
        now = time.monotonic()
        for endpoint in self.endpoints:
            running = rng.randint(0, 64)
            waiting = 0 if rng.random() < 0.6 else int(rng.expovariate(1 / 6)) + 1
            kv = min(0.99, 0.04 + 0.8 * running / 64 + 0.15 * rng.random())
            endpoint.metrics = EndpointMetrics(
                waiting_queue_size=waiting,
                running_requests_size=running,
                kv_cache_usage_percent=kv,
                cache_block_size=CACHE_BLOCK_TOKENS,
                cache_num_blocks=self.capacity,
                update_time=now - 0.05 * rng.random(),
            )


def fill_index(
    index: InMemoryPrefixIndex, names: Iterable[str], per_endpoint: int, capacity: int
) -> None:
    """Gives each endpoint ``per_endpoint`` older hashes, in 256-hash requests."""
    rng = random.Random(99)
    for name in names:
        left = per_endpoint
        while left > 0:
            n = min(256, left)
            index.add_sync(array("Q", rng.randbytes(8 * n)), name, capacity)
            left -= n


class TimedPreRequest:
    """Wraps a PreRequest hook and keeps the wall time of its last call."""

    def __init__(self, inner: ApproxPrefixCacheProducer) -> None:
        self.inner = inner
        self.last_ns = 0

    @property
    def typed_name(self) -> TypedName:
        return self.inner.typed_name

    async def pre_request(self, request: InferenceRequest, result: SchedulingResult) -> None:
        started = time.perf_counter_ns()
        await self.inner.pre_request(request, result)
        self.last_ns = time.perf_counter_ns() - started


class PrefixHits(NoopObserver):
    """The prefix producer's observer here: counts, from its hit-ratio metric, the requests
    that had a prefix block and those some endpoint held part of. Otherwise a no-op."""

    def __init__(self) -> None:
        self.requests = 0
        self.matched = 0

    def histogram(self, metric: HistogramMetric, labels: Mapping[str, str], value: float) -> None:
        if metric is PREFIX_INDEXER_HIT_RATIO:
            self.requests += 1
            if value > 0:
                self.matched += 1


class GcMeter:
    """Counts collections per generation and their pause times (a ``gc.callbacks`` hook)."""

    def __init__(self) -> None:
        self.count = 0
        self.collections = [0, 0, 0]
        self.pause_ns = [0, 0, 0]
        self.max_pause_ns = [0, 0, 0]
        self._started = 0

    def __call__(self, phase: str, info: Mapping[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter_ns()
            return
        pause = time.perf_counter_ns() - self._started
        generation = info["generation"]
        self.count += 1
        self.collections[generation] += 1
        self.pause_ns[generation] += pause
        self.max_pause_ns[generation] = max(self.max_pause_ns[generation], pause)

    def __enter__(self) -> GcMeter:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)

    def summary(self) -> str:
        return "/".join(str(c) for c in self.collections)


def percentile(ordered: Sequence[int], q: float) -> float:
    """The ``q`` quantile of sorted ns values, in µs (nearest rank)."""
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))] / 1000


@dataclass
class Cell:
    endpoints: int
    size: str
    body_bytes: float = 0.0
    route_ns: list[int] = field(default_factory=list)
    pre_ns: list[int] = field(default_factory=list)
    cpu_ns: list[int] = field(default_factory=list)
    gc_hit: list[bool] = field(default_factory=list)
    gc: GcMeter = field(default_factory=GcMeter)
    matched: float = 0.0
    index_entries: int = 0


@dataclass
class Bench:
    """The Director of one pool and the plugins the breakdown calls directly."""

    pool: Pool
    director: Director
    producer: ApproxPrefixCacheProducer
    index: InMemoryPrefixIndex
    hook: TimedPreRequest
    hits: PrefixHits


def build(count: int, capacity: int, fill: float, seed: int, config: str | None = None) -> Bench:
    pool = Pool(count, capacity, random.Random(seed + count))
    director = configured_director(pool.datastore, config, seed=seed)
    control = director.control
    producer = next(p for p in control.data_producers if isinstance(p, ApproxPrefixCacheProducer))
    index = producer._index  # the Handle's index; the bench pre-fills it
    assert isinstance(index, InMemoryPrefixIndex)
    hook = TimedPreRequest(producer)
    hits = PrefixHits()
    producer._observer = hits  # the Handle's no-op observer, counting prefix hits
    control.pre_request = [hook if h is producer else h for h in control.pre_request]
    started = time.perf_counter()
    fill_index(index, (e.name for e in pool.endpoints), int(capacity * fill), capacity)
    filled = time.perf_counter() - started
    # A long-running process holds its index in the oldest generation; one full collection
    # puts it there (and shows what every later full collection costs).
    started = time.perf_counter()
    gc.collect()
    print(
        f"  {count} endpoints: index pre-filled with {index.size():,} entries in {filled:.1f} s;"
        f" a full GC collection now takes {1000 * (time.perf_counter() - started):.0f} ms",
        flush=True,
    )
    return Bench(pool, director, producer, index, hook, hits)


async def route_one(bench: Bench, inbound: InboundRequest) -> None:
    exchange = bench.director.open(inbound)
    decision = await exchange.route()
    await exchange.close()
    if decision.error is not None:
        raise RuntimeError(f"routing failed: {decision.error}")


async def warm_up(bench: Bench, prompts: Prompts, count: int) -> None:
    """Routes every shared prefix once, then ``count`` requests of the usual mix."""
    for k in range(SHARED_PREFIXES):
        await route_one(bench, prompts.inbound(prefix=k))
    for i in range(count):
        if i % REFRESH_EVERY == 0:
            bench.pool.refresh()
        await route_one(bench, prompts.inbound())


async def measure(bench: Bench, prompts: Prompts, cell: Cell, iterations: int) -> None:
    director, hook, pool = bench.director, bench.hook, bench.pool
    hits = bench.hits
    requests_before, matched_before = hits.requests, hits.matched
    clock, cpu_clock = time.perf_counter_ns, time.thread_time_ns
    body_bytes = 0
    with cell.gc as meter:
        for i in range(iterations):
            if i % REFRESH_EVERY == 0:
                pool.refresh()
            inbound = prompts.inbound()
            assert inbound.body is not None
            body_bytes += len(inbound.body)
            exchange = director.open(inbound)
            collections = meter.count
            cpu0 = cpu_clock()
            t0 = clock()
            decision = await exchange.route()
            t1 = clock()
            cpu1 = cpu_clock()
            await exchange.close()
            if decision.error is not None:
                raise RuntimeError(f"routing failed: {decision.error}")
            cell.route_ns.append(t1 - t0)
            cell.pre_ns.append(hook.last_ns)
            cell.cpu_ns.append(cpu1 - cpu0)
            cell.gc_hit.append(meter.count != collections)
    cell.body_bytes = body_bytes / iterations
    done = hits.requests - requests_before
    cell.matched = (hits.matched - matched_before) / done if done else 0.0
    cell.index_entries = bench.index.size()


# The breakdown: the pieces of one decision, called directly in the Director's order.

STAGES = (
    "parse (orjson + validation)",
    "InferenceRequest + snapshot",
    "prefix input (prompt encode)",
    "hashing (xxh64 chain)",
    "index match",
    "attributes + producer glue",
    "scoring + picking (schedule)",
    "  queue-scorer",
    "  kv-cache-utilization-scorer",
    "  prefix-cache-scorer",
    "  weighted sum + picker + glue",
    "PreRequest (index add)",
)


async def breakdown(bench: Bench, prompts: Prompts, iterations: int) -> dict[str, list[int]]:
    control = bench.director.control
    parser, scheduler, producer, index = (
        control.parser,
        control.scheduler,
        bench.producer,
        bench.index,
    )
    codec: JsonCodec = bench.director.codec
    hasher: BlockHasher = producer._hasher
    params = producer.parameters
    (profile,) = scheduler.profiles.values()
    scorers = [w.scorer for w in profile.scorers]
    states = RequestStates()
    times: dict[str, list[int]] = {stage: [] for stage in STAGES}
    clock = time.perf_counter_ns
    endpoints = bench.pool.datastore.endpoints
    for i in range(iterations):
        if i % REFRESH_EVERY == 0:
            bench.pool.refresh()
        inbound = prompts.inbound()
        body, headers = inbound.body, inbound.headers
        assert body is not None
        t0 = clock()
        parsed = parser.parse(body, headers)
        t1 = clock()
        request = InferenceRequest(
            request_id=inbound.request_id,
            target_model=parsed.model,
            incoming_model=parsed.model,
            body=parsed,
            headers=headers,
            priority=0,
            request_size_bytes=len(body),
            state=states.create(inbound.request_id),
        )
        candidates = [Candidate(e) for e in endpoints()]
        t2 = clock()
        data = parsed.prefix_input(codec)
        t3 = clock()
        block_tokens = params.tokens_per_block
        metrics = candidates[0].metrics
        if params.auto_tune and metrics is not None and metrics.cache_block_size > 0:
            block_tokens = metrics.cache_block_size
        seed = (request.target_model + parsed.cache_salt).encode()
        hashes = hasher.chain(
            data, block_tokens * CHARS_PER_TOKEN, seed, params.max_blocks(block_tokens)
        )
        t4 = clock()
        index.match_sync(hashes)
        t5 = clock()
        await producer.prepare_request_data(request, candidates)  # hashes and matches again
        t6 = clock()
        result = scheduler.schedule(request, candidates)
        t7 = clock()
        await producer.pre_request(request, result)
        t8 = clock()
        # The scorers and the picker alone, on the same candidates (outside the above).
        cycle = CycleState(profile=profile.name, state=request.state)
        scorer_ns = []
        totals = [0.0] * len(candidates)
        for scorer in scorers:
            s0 = clock()
            scorer.score(cycle, request, candidates)
            scorer_ns.append(clock() - s0)
        s0 = clock()
        profile.picker.pick(
            cycle, request, [ScoredCandidate(c, s) for c, s in zip(candidates, totals, strict=True)]
        )
        picker_ns = clock() - s0
        states.release(request.state)

        hash_ns, match_ns, input_ns = t4 - t3, t5 - t4, t3 - t2
        schedule_ns = t7 - t6
        times[STAGES[0]].append(t1 - t0)
        times[STAGES[1]].append(t2 - t1)
        times[STAGES[2]].append(input_ns)
        times[STAGES[3]].append(hash_ns)
        times[STAGES[4]].append(match_ns)
        times[STAGES[5]].append(max(0, (t6 - t5) - input_ns - hash_ns - match_ns))
        times[STAGES[6]].append(schedule_ns)
        for stage, ns in zip(STAGES[7:10], scorer_ns, strict=True):
            times[stage].append(ns)
        times[STAGES[10]].append(max(0, schedule_ns - sum(scorer_ns)))
        times[STAGES[11]].append(t8 - t7)
        del picker_ns  # included in the row above (picker + weighted sum + scheduler glue)
    return times


def print_breakdown(times: dict[str, list[int]], cell: Cell | None) -> None:
    top = [s for s in STAGES if not s.startswith("  ")]
    total_mean = sum(statistics.fmean(times[s]) for s in top) / 1000
    print(f"\n{'stage':<34}{'p50 µs':>9}{'mean µs':>9}{'p99 µs':>9}{'share':>8}")
    for stage in STAGES:
        ordered = sorted(times[stage])
        mean = statistics.fmean(ordered) / 1000
        share = f"{100 * mean / total_mean:6.1f}%"
        print(
            f"{stage:<34}{percentile(ordered, 0.5):9.1f}{mean:9.1f}"
            f"{percentile(ordered, 0.99):9.1f}{share:>8}"
        )
    print(f"{'sum of the pieces (means)':<34}{'':9}{total_mean:9.1f}")
    if cell is not None:
        ordered = sorted(cell.route_ns)
        mean = statistics.fmean(ordered) / 1000
        print(
            f"{'route() in the same cell':<34}{percentile(ordered, 0.5):9.1f}{mean:9.1f}"
            f"{percentile(ordered, 0.99):9.1f}"
        )
        quiet = [ns for ns, hit in zip(cell.route_ns, cell.gc_hit, strict=True) if not hit]
        if quiet:
            quiet_mean = statistics.fmean(quiet) / 1000
            print(f"{'  same, decisions without a GC':<34}{'':9}{quiet_mean:9.1f}")
            print(f"{'Director glue (route - pieces)':<34}{'':9}{quiet_mean - total_mean:9.1f}")


def _us(ordered: Sequence[int], q: float) -> str:
    return f"{percentile(ordered, q):.1f}" if ordered else "-"


def print_table(cells: Sequence[Cell]) -> None:
    print(
        f"\n{'endpoints':>9} {'prompt':>6} {'body KiB':>8} {'match':>6}"
        f" {'p50 µs':>8} {'p99 µs':>8} {'p99.9':>8} {'max':>8} {'mean':>8}"
        f" {'pre p50':>8} {'pre p99':>8} {'dec/s':>7} {'cpu p50':>8} {'cpu p99':>8}"
        f" {'GCs 0/1/2':>10} {'p99 noGC':>8}"
    )
    for c in cells:
        ordered = sorted(c.route_ns)
        pre = sorted(c.pre_ns)
        cpu = sorted(c.cpu_ns)
        no_gc = sorted(ns for ns, hit in zip(c.route_ns, c.gc_hit, strict=True) if not hit)
        mean_ns = statistics.fmean(ordered)
        print(
            f"{c.endpoints:>9} {c.size:>6} {c.body_bytes / 1024:>8.1f} {100 * c.matched:>5.0f}%"
            f" {percentile(ordered, 0.5):>8.1f} {percentile(ordered, 0.99):>8.1f}"
            f" {percentile(ordered, 0.999):>8.1f} {ordered[-1] / 1000:>8.1f}"
            f" {mean_ns / 1000:>8.1f} {percentile(pre, 0.5):>8.1f} {percentile(pre, 0.99):>8.1f}"
            f" {1e9 / mean_ns:>7.0f} {percentile(cpu, 0.5):>8.1f} {percentile(cpu, 0.99):>8.1f}"
            f" {c.gc.summary():>10} {_us(no_gc, 0.99):>8}"
        )


def _gc_report(cells: Sequence[Cell]) -> None:
    print(f"\nGC during the timed decisions (enabled, thresholds {gc.get_threshold()}):")
    for c in cells:
        hits = sum(c.gc_hit)
        pauses = ", ".join(
            f"gen{g} {c.gc.collections[g]}x max {c.gc.max_pause_ns[g] / 1000:.0f} µs"
            for g in range(3)
            if c.gc.collections[g]
        )
        share = 100 * sum(c.gc.pause_ns) / sum(c.route_ns)
        print(
            f"  {c.endpoints:>4} x {c.size:<4}: {hits} of {len(c.route_ns)} decisions held a"
            f" collection; {pauses or 'none'}; GC = {share:.1f}% of the timed wall time"
        )


def parse_cell(text: str) -> tuple[int, str]:
    count, _, size = text.lower().partition("x")
    if not count.isdigit() or size not in PROMPT_SIZES:
        raise argparse.ArgumentTypeError(f"expected <endpoints>x<{'|'.join(PROMPT_SIZES)}>")
    return int(count), size


async def run(args: argparse.Namespace) -> None:
    if args.cell:
        plan: dict[int, list[str]] = {args.cell[0]: [args.cell[1]]}
    elif args.quick:
        plan = {10: ["4k"], 100: ["4k", "32k"]}
    else:
        plan = {n: list(PROMPT_SIZES) for n in ENDPOINT_COUNTS}
    focus: tuple[int, str] = args.breakdown or args.cell or TARGET_CELL
    rng = random.Random(args.seed)
    corpus = make_corpus(rng, CORPUS_CHARS)
    cells: list[Cell] = []
    times: dict[str, list[int]] | None = None
    target: Cell | None = None
    for count, sizes in plan.items():
        bench = build(count, args.capacity, args.fill, args.seed, PROFILES[args.profile])
        for size in sizes:
            prompts = Prompts(corpus, PROMPT_SIZES[size], rng, size, SHARED_FRACTION)
            iterations = args.iterations or (
                300 if args.quick else (1000 if count >= 1000 else 2000)
            )
            warmup = args.warmup if args.warmup is not None else (200 if args.quick else 1000)
            await warm_up(bench, prompts, warmup)
            cell = Cell(count, size)
            await measure(bench, prompts, cell, iterations)
            cells.append(cell)
            print(
                f"  {count} x {size}: {iterations} decisions,"
                f" p99 {percentile(sorted(cell.route_ns), 0.99):.1f} µs",
                flush=True,
            )
            # The breakdown calls the reference profile's pieces by name.
            if (count, size) == focus and not args.no_breakdown and args.profile == "reference":
                times = await breakdown(bench, prompts, iterations)
                target = cell
        del bench
        gc.collect()

    print_table(cells)
    print(
        "\nµs per route() call (wall, perf_counter_ns; close() not timed); 'pre' = the"
        " PreRequest hook (index add) inside it; 'match' = requests where some endpoint held"
        " a prefix; dec/s = one core at the mean; cpu = the thread's CPU time for the same call"
        " (unlike wall time, not inflated when other processes take the core)."
    )
    _gc_report(cells)
    if times is not None:
        print(f"\nBreakdown, {focus[0]} endpoints x {focus[1]} (pieces called directly):")
        print_breakdown(times, target)
    for c in cells:
        if (c.endpoints, c.size) == TARGET_CELL:
            p99 = percentile(sorted(c.route_ns), 0.99)
            verdict = "met" if p99 <= TARGET_P99_US else "MISSED"
            print(
                f"\nTarget p99 <= {TARGET_P99_US:.0f} µs at {TARGET_CELL[0]} endpoints x"
                f" {TARGET_CELL[1]}: {p99:.1f} µs, {verdict}"
            )


def _loop_factory(use_uvloop: bool) -> tuple[Callable[[], asyncio.AbstractEventLoop] | None, str]:
    if use_uvloop:
        try:
            import uvloop
        except ImportError:
            return None, "asyncio (uvloop not installed)"
        return uvloop.new_event_loop, f"uvloop {importlib.metadata.version('uvloop')}"
    return None, "asyncio"


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small subset in a few seconds")
    parser.add_argument("--cell", type=parse_cell, help="only this cell, e.g. 100x4k")
    parser.add_argument(
        "--breakdown", type=parse_cell, help="the cell broken down (default: --cell or 100x4k)"
    )
    parser.add_argument("--iterations", type=int, help="timed decisions per cell")
    parser.add_argument("--warmup", type=int, help="routed warm-up requests per cell")
    parser.add_argument(
        "--fill", type=float, help="index fill, share of capacity (1.0; --quick: 0.2)"
    )
    parser.add_argument("--capacity", type=int, default=31_250, help="cache_num_blocks")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--no-uvloop", action="store_true")
    parser.add_argument("--no-breakdown", action="store_true")
    parser.add_argument("--profile", choices=sorted(PROFILES), default="default")
    args = parser.parse_args()
    if args.fill is None:
        args.fill = 0.2 if args.quick else 1.0
    factory, loop_name = _loop_factory(not args.no_uvloop)
    print(
        f"Python {platform.python_version()} ({sys.implementation.name}), {loop_name},"
        f" {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f};"
        f" GC {'enabled' if gc.isenabled() else 'DISABLED'}, thresholds {gc.get_threshold()}"
    )
    print(
        f"{args.profile} profile; index capacity {args.capacity:,} blocks/endpoint, filled to"
        f" {args.fill:.0%}; {SHARED_FRACTION:.0%} of requests share one of"
        f" {SHARED_PREFIXES} prefixes ({PREFIX_SHARE:.0%} of the prompt)"
    )
    main_coro: Coroutine[Any, Any, None] = run(args)
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(main_coro)
    print(
        f"(load average at the end {os.getloadavg()[0]:.2f};"
        f" GC-tracked objects at exit {len(gc.get_objects()):,})"
    )


if __name__ == "__main__":
    main()
