"""Benchmark (not a test): routing quality of the EPP's profiles against SGLang's gateway.

Runs each workload once per column, each column on a fresh stack (``tests.support.stack``:
simulated vLLM instances with the ``h100-8b`` timing preset and a small KV cache):

- ``default``: the EPP without a config ("sticky until saturated" and ``kv-capacity-gate``,
  ``app.config.loader``'s ``DEFAULT_CONFIG``), through Envoy;
- ``sticky``: the same filter and scorer as a config (``tests.bench.profiles.sticky_config``)
  with ``peakPrefillThroughput`` the simulator's 4,000 tokens/s and the prefix index sized
  by the servers' KV blocks (``autoTune``);
- ``reference``: the reference's default (queue 2 + KV-cache utilization 2 + prefix 3,
  ``REFERENCE_DEFAULT_CONFIG_TEXT``; this repository's default until 2026-11-24);
- ``random``: ``random-picker`` only;
- ``sglang-cache_aware``, ``sglang-round_robin``: SGLang's model gateway (the
  ``sglang-router`` wheel, the ``bench`` extra, installed with pip on first use; the columns
  are skipped with a message when it cannot be installed or started) with that ``--policy``
  and its default thresholds, the client talking to it directly (no Envoy, no EPP).

Workloads (``--workload``, default all; one table each), streamed ``/v1/completions`` with
``max_tokens`` = ``--max-tokens`` (30) by ``--concurrency`` (24) closed-loop workers; every
text is whole 64-character blocks where it is shared, so the EPP's approximate prefix index
and the simulators' block hashes cut it alike:

- ``shared-prefix``: ``--groups`` (20) groups of ``--prompts-per-group`` (5) prompts, each
  the group's ~2,000-token system prompt (8,000 characters) and its own ~200-token question,
  sent ``--rounds`` times (6; ``--quick``: 2), every round shuffled;
- ``multi-turn``: ``--sessions`` (48; quick 24) agentic chat sessions of ``--turns`` (6;
  quick 4) turns; each turn resends the whole conversation (instructions shared by every
  session, the session's own context, every earlier user part and reply) and starts when the
  previous turn has finished;
- ``no-share``: ``--requests`` (400; quick 100) prompts of the same size sharing nothing
  (routing can only balance);
- ``zipf``: ``--requests`` prompts on ``--prefixes`` (40) system prompts drawn with weight
  1/rank^``--zipf`` (1.1): a few hot prefixes and a long tail.

Each simulator has ``--num-gpu-blocks`` (480) KV blocks of 16 tokens: about 3.8 of the
shared-prefix groups' prefixes, so cache pressure matters and requests queue for blocks.
``--time-scale`` (0.5; ``--quick``: 0.2) shortens every simulated wait.

Prints, side by side: the prefix-cache hit rate from the simulators' own counters
(``GET /sim/stats``: hits / queries in tokens, summed over instances), the simulators' TTFT
p50/p90/p99 and mean queue time (in simulated time: what an H100 would show, from the moment
the request reaches the simulator), the client's TTFT p50/p90/p99 in simulated time (its time
to first byte / the time scale: the simulators' TTFT plus whatever the request spent in front
of them, such as a wait in the EPP's ``kv-capacity-gate``, with the gateway's own latency
doubled at time scale 0.5), the client's time to first byte p50/p90 and latency p50 (real
time), requests per instance, how
many instances served each group (session, prefix), KV evictions, preemptions and errors.
All workloads and columns take about 10 minutes on 2 cores, ``--quick`` about 3.

    .venv/bin/python -m tests.bench.routing_quality [--quick] [--seed 1]
        [--workload shared-prefix|multi-turn|no-share|zipf|all]
        [--modes default,sticky,reference,random,sglang-cache_aware,sglang-round_robin]

``--modes`` may also name ``no-gate`` (the default without ``kv-capacity-gate``, the default
until 2026-11-25), ``no-freshness`` (the default without ``metrics-freshness-filter``)
and ``lru-0.003``, ``lru-0.01``, ``lru-0.03`` (the default plus ``no-hit-lru-scorer`` at that
weight), the variants of decision 0014; ``prev-default`` (the default of 2026-11-25 as a
config, "sticky until saturated"), ``predicted-latency`` (the llm-d chart's
latency-predictor config as it ships), ``predicted-sticky-N`` and ``predicted-balanced-N``
(the affinity filter on the predicted TTFT with ``maxTTFTPenaltyMs`` N, ``latency-scorer``,
the second with ``token-load-scorer`` as tie-break), the variants of decision 0027;
``reported-load`` (the default counting 1,000 tokens per request a server reports beyond
the EPP's own), ``predicted-band-N`` (the default with stickiness broken on the
predicted TTFT, ``maxTTFTPenaltyMs`` N and ``excludeSaturated``: no endpoint predicted
more than N ms above the fastest gets the request; new prefixes placed by
``token-load-scorer`` with the reported load) and ``predicted-break-all-1000`` (the same
without ``excludeSaturated``: an open gate passes every endpoint), ``predicted-band-qkv-1000``
and ``predicted-band-q-1000`` (``predicted-band-1000`` choosing among the endpoints the band
passes by the reported queue at weight 2 and, the first, KV usage at weight 2, before
``token-load-scorer``), ``predicted-leave-1000`` (``predicted-band-1000`` with
``leaveByReportedQueue``: a request leaving its saturated sticky endpoint goes to the
shortest scraped queue in the band, a new prefix is placed by token load;
``predicted-leave-nogate-1000`` the same without ``kv-capacity-gate``),
``predicted-band-1000-queued-M`` and ``predicted-leave-1000-queued-M`` (either with
``queuedStickyPenaltyMs`` M: a sticky endpoint whose reported queue is longer than the
shortest keeps the request only within M ms of the fastest prediction), the candidates
of issue 37's default; ``flow-control`` and ``flow-control-q4`` (the default with flow
control on, FCFS, no TTL, gated by ``standing-queue-detector``, ``queuePerServer`` 1 or 4:
decision 0030's candidate default); they are not run unless named.

Issue 37's workloads (``--workload``) reuse the shared-prefix prompts: ``heterogeneous`` (the
first simulator ``--slowdown`` (2) times slower in prefill and decode), ``external-load``
(``--external-streams`` (16) requests at a time sent straight to the first simulator,
bypassing Envoy) and ``bursts`` (open loop: half the requests at ``--burst-rate`` (4) per
simulated second, ``--burst-idle`` (20) s of nothing, the rest at ``--burst-factor`` (4)
times the rate). ``--load pressure`` is the issue's cache pressure (40 groups, 240 KV blocks
each, 48 clients), ``--load light`` 8 clients. ``--slo-ttft-ms`` and ``--slo-tpot-ms``
(simulated) go to every request as ``x-slo-*`` headers and add the SLO attainment row; the
hit rate is then the client's own requests' (the simulators report cached tokens), the
EPP's TTFT prediction error after the first third of the requests is read from its
``/metrics`` when it exports it, and so are the share of the requests ``kv-capacity-gate``
held and for how long, and the scheduler's p90. ``--repeat`` N runs every column N times,
the order alternated, and adds a table of all the runs' requests pooled.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import math
import os
import random
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from app.config import REFERENCE_DEFAULT_CONFIG_TEXT
from tests.bench.profiles import (
    RANDOM_CONFIG,
    default_as_of_2026_11_25,
    default_with_flow_control,
    default_with_no_hit_lru,
    default_without_freshness,
    default_without_kv_gate,
    predicted_band_blend_config,
    predicted_break_config,
    predicted_leave_config,
    predicted_sticky_config,
    reported_load_config,
    sticky_config,
)
from tests.simulator import DEFAULT_MODEL
from tests.simulator.server import INSTANCE_HEADER
from tests.support.charts import LLMD_LATENCY_PREDICTOR_PLUGINS
from tests.support.stack import Stack, StackOptions, free_port, wait_for

MODES: dict[str, list[str]] = {
    "default": [],
    "sticky": ["--config-text", sticky_config()],
    "reference": ["--config-text", REFERENCE_DEFAULT_CONFIG_TEXT],
    "random": ["--config-text", RANDOM_CONFIG],
}
#: Columns run only when ``--modes`` names them (decision 0014's variants of the default, and
#: the latency-aware profiles).
EXTRA_MODES: dict[str, list[str]] = {
    "prev-default": ["--config-text", default_as_of_2026_11_25()],
    "predicted-latency": ["--config-text", LLMD_LATENCY_PREDICTOR_PLUGINS],
    **{
        f"predicted-sticky-{penalty}": [
            "--config-text",
            predicted_sticky_config(float(penalty)),
        ]
        for penalty in (1000, 2000, 5000, 18000)
    },
    **{
        f"predicted-balanced-{penalty}": [
            "--config-text",
            predicted_sticky_config(float(penalty), tie_break=True),
        ]
        for penalty in (1000, 2000, 5000)
    },
    "reported-load": ["--config-text", reported_load_config()],
    **{
        f"predicted-band-{penalty}": ["--config-text", predicted_break_config(float(penalty))]
        for penalty in (500, 1000, 2000)
    },
    "predicted-band-qkv-1000": ["--config-text", predicted_band_blend_config(1000.0)],
    "predicted-band-qkv-nogate-1000": [
        "--config-text",
        predicted_band_blend_config(1000.0, gate=False),
    ],
    "predicted-band-q-1000": [
        "--config-text",
        predicted_band_blend_config(1000.0, kv_weight=0.0),
    ],
    "predicted-leave-1000": ["--config-text", predicted_leave_config(1000.0)],
    "predicted-leave-nogate-1000": [
        "--config-text",
        predicted_leave_config(1000.0, gate=False),
    ],
    **{
        f"predicted-band-1000-queued-{narrow}": [
            "--config-text",
            predicted_leave_config(1000.0, leave=False, queued_penalty_ms=float(narrow)),
        ]
        for narrow in (0, 300)
    },
    **{
        f"predicted-leave-1000-queued-{narrow}": [
            "--config-text",
            predicted_leave_config(1000.0, queued_penalty_ms=float(narrow)),
        ]
        for narrow in (0, 300)
    },
    "predicted-break-all-1000": [
        "--config-text",
        predicted_break_config(1000.0, exclude=False),
    ],
    "no-freshness": ["--config-text", default_without_freshness()],
    "no-gate": ["--config-text", default_without_kv_gate()],
    "flow-control": ["--config-text", default_with_flow_control()],
    "flow-control-q4": ["--config-text", default_with_flow_control(queue_per_server=4)],
    **{
        f"lru-{weight}": ["--config-text", default_with_no_hit_lru(weight)]
        for weight in (0.003, 0.01, 0.03)
    },
}
#: SGLang's model gateway in front of the same simulators: mode -> its ``--policy``.
SGLANG_MODES: dict[str, str] = {
    "sglang-cache_aware": "cache_aware",
    "sglang-round_robin": "round_robin",
}
#: The bench extra's requirement (pyproject.toml), installed on first use.
SGLANG_REQUIREMENT = "sglang-router>=0.3"
WORKLOADS = (
    "shared-prefix",
    "multi-turn",
    "no-share",
    "zipf",
    "heterogeneous",
    "external-load",
    "bursts",
)

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


#: One workload: sessions, each a list of ``(group, prompt)`` sent one after the other.
Sessions = list[list[tuple[int, str]]]

MULTI_TURN_SYSTEM_CHARS = 2048  # 512 tokens, the same agent instructions in every session
MULTI_TURN_CONTEXT_CHARS = 2048  # 512 tokens of the session's own context
MULTI_TURN_USER_CHARS = 256  # 64 tokens: the next instruction or tool result
MULTI_TURN_REPLY_CHARS = 256  # 64 tokens: the previous answer, resent with the history


def multi_turn_sessions(*, sessions: int, turns: int, seed: int) -> Sessions:
    """Agentic chat: every session resends its whole conversation each turn (the shared
    instructions, its context, then every earlier user part and reply); every part is whole
    64-character blocks. The group of a request is its session."""
    rng = random.Random(seed)
    system = _text(rng, MULTI_TURN_SYSTEM_CHARS, "Agent instructions: you are a coding agent")
    result: Sessions = []
    for s in range(sessions):
        history = system + _text(rng, MULTI_TURN_CONTEXT_CHARS, f"\nSession {s:03d} context:")
        requests: list[tuple[int, str]] = []
        for t in range(turns):
            history += _text(rng, MULTI_TURN_USER_CHARS, f"\nUser {s:03d}.{t:02d}:")
            requests.append((s, history))
            history += _text(rng, MULTI_TURN_REPLY_CHARS, f"\nAssistant {s:03d}.{t:02d}:")
        result.append(requests)
    rng.shuffle(result)
    return result


def no_share_workload(*, requests: int, seed: int) -> Sessions:
    """Prompts that share nothing (each of the shared-prefix workload's size, different
    from its first block): no cache to win, so routing must only balance."""
    rng = random.Random(seed)
    return [
        [(i, _text(rng, SYSTEM_CHARS + QUESTION_CHARS, f"Prompt {i:05d} on its own:"))]
        for i in range(requests)
    ]


def zipf_workload(*, prefixes: int, requests: int, exponent: float, seed: int) -> Sessions:
    """Skewed popularity: ``requests`` prompts on ``prefixes`` system prompts drawn with
    weight 1 / rank^``exponent`` (a few hot prefixes, a long tail), each with its own
    question."""
    rng = random.Random(seed)
    systems = [
        _text(rng, SYSTEM_CHARS, f"System prompt of tenant {g:03d}: you are assistant")
        for g in range(prefixes)
    ]
    weights = [1.0 / (rank + 1) ** exponent for rank in range(prefixes)]
    drawn = rng.choices(range(prefixes), weights=weights, k=requests)
    return [
        [(g, systems[g] + _text(rng, QUESTION_CHARS, f"\nQuestion {i:05d}:"))]
        for i, g in enumerate(drawn)
    ]


@dataclass
class ClientRecord:
    ttfb_ms: list[float] = field(default_factory=list)
    latency_ms: list[float] = field(default_factory=list)
    instances: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    # how many distinct instances served each group (affinity)
    group_instances: dict[int, set[str]] = field(default_factory=dict)
    # how many of each group's requests each instance served (placement)
    group_requests: dict[int, Counter[str]] = field(default_factory=dict)
    #: every answered request's time per output token after the first (ms, real)
    tpot_ms: list[float] = field(default_factory=list)
    #: the answered requests' TTFB (ms, real) by the instance that served them
    ttfb_by_instance: dict[str, list[float]] = field(default_factory=dict)
    #: the answered requests' prompt and cached prompt tokens (their streamed ``usage``)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    #: requests sent (answered or not), for the SLO attainment
    sent: int = 0
    #: every answered request's (TTFB, time per output token) in ms, real
    answered: list[tuple[float, float]] = field(default_factory=list)


async def stream_completion(
    session: aiohttp.ClientSession,
    url: str,
    group: int,
    request: dict[str, object],
    rec: ClientRecord,
    headers: Mapping[str, str] | None = None,
) -> tuple[bytes, Mapping[str, str]] | None:
    """One streamed ``/v1/completions`` request with ``request``'s fields (and ``headers``
    besides the content type); its TTFB, time per output token, latency, serving instance,
    group and streamed usage recorded in ``rec``. Returns the streamed body and the response
    headers, or ``None`` after counting what went wrong."""
    body = orjson.dumps(
        {
            "model": DEFAULT_MODEL,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": 0,
            **request,
        }
    )
    sent = {"content-type": "application/json", **(headers or {})}
    rec.sent += 1
    start = time.perf_counter()
    try:
        async with session.post(f"{url}/v1/completions", data=body, headers=sent) as response:
            if response.status != 200:
                rec.errors[f"HTTP {response.status}"] += 1
                await response.read()
                return None
            first = await response.content.readany()
            ttfb = time.perf_counter() - start
            if not first:
                rec.errors["empty body"] += 1
                return None
            text = first + await response.read()
            if b"[DONE]" not in text:
                rec.errors["stream without [DONE]"] += 1
                return None
            response_headers = response.headers  # case-insensitive
    except (aiohttp.ClientError, TimeoutError) as exc:
        rec.errors[type(exc).__name__] += 1
        return None
    ended = time.perf_counter()
    instance = response_headers.get(INSTANCE_HEADER, "?")
    rec.ttfb_ms.append(ttfb * 1e3)
    rec.latency_ms.append((ended - start) * 1e3)
    rec.ttfb_by_instance.setdefault(instance, []).append(ttfb * 1e3)
    tokens = request.get("max_tokens")
    tpot = 0.0
    if isinstance(tokens, int) and tokens > 1:
        tpot = (ended - start - ttfb) * 1e3 / (tokens - 1)
        rec.tpot_ms.append(tpot)
    rec.answered.append((ttfb * 1e3, tpot))
    usage = _streamed_usage(text)
    if usage is not None:
        rec.prompt_tokens += usage[0]
        rec.cached_tokens += usage[1]
    rec.instances[instance] += 1
    rec.group_instances.setdefault(group, set()).add(instance)
    rec.group_requests.setdefault(group, Counter())[instance] += 1
    return text, response_headers


def _streamed_usage(text: bytes) -> tuple[int, int] | None:
    """(prompt tokens, cached prompt tokens) of a streamed response's ``usage`` event."""
    for line in reversed(text.split(b"\n")):
        if not line.startswith(b"data: {") or b'"usage"' not in line:
            continue
        usage = orjson.loads(line[6:]).get("usage")
        if not isinstance(usage, dict):
            continue
        details = usage.get("prompt_tokens_details") or {}
        return int(usage.get("prompt_tokens", 0)), int(details.get("cached_tokens") or 0)
    return None


async def send_one(
    session: aiohttp.ClientSession,
    url: str,
    group: int,
    prompt: str,
    max_tokens: int,
    rec: ClientRecord,
    headers: Mapping[str, str] | None = None,
) -> None:
    await stream_completion(
        session, url, group, {"prompt": prompt, "max_tokens": max_tokens}, rec, headers
    )


async def drive(
    url: str, workload: Sequence[tuple[int, str]], concurrency: int, max_tokens: int
) -> tuple[ClientRecord, float]:
    """Every request of ``workload`` on its own, in order, by ``concurrency`` workers."""
    return await drive_sessions(url, [[item] for item in workload], concurrency, max_tokens)


async def drive_sessions(
    url: str,
    sessions: Sequence[Sequence[tuple[int, str]]],
    concurrency: int,
    max_tokens: int,
    *,
    headers: Mapping[str, str] | None = None,
    progress: Callable[[int], Awaitable[None]] | None = None,
) -> tuple[ClientRecord, float]:
    """``concurrency`` closed-loop workers; each takes the next session and sends its
    requests one after the other (a turn starts when the previous one has finished), with
    ``headers``. ``progress`` is awaited with the count of requests answered so far after
    each one (a worker waits for it)."""
    rec = ClientRecord()
    queue: asyncio.Queue[Sequence[tuple[int, str]]] = asyncio.Queue()
    for session_requests in sessions:
        queue.put_nowait(session_requests)
    connector = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def worker() -> None:
            while True:
                try:
                    turns = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                for group, prompt in turns:
                    await send_one(session, url, group, prompt, max_tokens, rec, headers)
                    if progress is not None:
                        await progress(rec.sent)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    return rec, elapsed


def burst_schedule(count: int, rate: float, idle: float, factor: float, seed: int) -> list[float]:
    """Send times (simulated seconds from the start) of ``count`` requests: the first half
    at ``rate`` requests/s, then ``idle`` seconds without any, then the rest at ``factor``
    times the rate; exponential gaps (Poisson arrivals) drawn from ``seed``."""
    rng = random.Random(seed)
    times: list[float] = []
    now = 0.0
    steady = count // 2
    for index in range(count):
        if index == steady:
            now += idle
        current = rate if index < steady else rate * factor
        now += rng.expovariate(current)
        times.append(now)
    return times


async def drive_open_loop(
    url: str,
    requests: Sequence[tuple[int, str]],
    send_at: Sequence[float],
    max_tokens: int,
    *,
    headers: Mapping[str, str] | None = None,
    progress: Callable[[int], Awaitable[None]] | None = None,
) -> tuple[ClientRecord, float]:
    """Each of ``requests`` sent at its time in ``send_at`` (real seconds from the start),
    whatever is still in flight (open loop)."""
    rec = ClientRecord()
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        loop = asyncio.get_running_loop()
        start = loop.time()

        async def one(group: int, prompt: str, at: float) -> None:
            await asyncio.sleep(max(0.0, start + at - loop.time()))
            await send_one(session, url, group, prompt, max_tokens, rec, headers)
            if progress is not None:
                await progress(rec.sent)

        await asyncio.gather(
            *(one(group, prompt, at) for (group, prompt), at in zip(requests, send_at, strict=True))
        )
        elapsed = loop.time() - start
    return rec, elapsed


@dataclass
class ExternalLoad:
    """Requests sent straight to one model server, bypassing the gateway (another pool's
    traffic, a batch job): ``streams`` closed-loop workers, each prompt its own."""

    url: str
    streams: int
    prompt_chars: int
    max_tokens: int
    seed: int
    done: int = 0
    failed: int = 0

    async def run(self, stop: asyncio.Event) -> None:
        rng = random.Random(self.seed)
        timeout = aiohttp.ClientTimeout(total=300)
        connector = aiohttp.TCPConnector(limit=self.streams)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

            async def worker(index: int) -> None:
                count = 0
                while not stop.is_set():
                    count += 1
                    prompt = _text(rng, self.prompt_chars, f"External {index:02d}.{count:05d}:")
                    body = orjson.dumps(
                        {
                            "model": DEFAULT_MODEL,
                            "prompt": prompt,
                            "max_tokens": self.max_tokens,
                            "stream": True,
                        }
                    )
                    try:
                        async with session.post(
                            f"{self.url}/v1/completions",
                            data=body,
                            headers={"content-type": "application/json"},
                        ) as response:
                            await response.read()
                            if response.status == 200:
                                self.done += 1
                            else:
                                self.failed += 1
                    except (aiohttp.ClientError, TimeoutError):
                        self.failed += 1

            await asyncio.gather(*(worker(i) for i in range(self.streams)))


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
    #: per instance (sorted by name), the groups most of whose requests it served
    groups_per_instance: tuple[int, ...] = ()
    #: every request's simulated TTFT (ms), for figures pooled over several runs
    sim_ttft_samples_ms: tuple[float, ...] = ()
    #: the client's time to first byte in simulated time (real / time scale) p50/p90/p99:
    #: the simulators' TTFT plus any time the request spent in the gateway before reaching
    #: one (Envoy, the EPP's flow control or ``kv-capacity-gate``, SGLang's router)
    client_ttft_ms: tuple[float, float, float] = (math.nan, math.nan, math.nan)
    #: every request's client TTFT (ms, simulated), for figures pooled over several runs
    client_ttft_samples_ms: tuple[float, ...] = ()
    #: the client's time per output token p50/p90 (ms, simulated)
    client_tpot_ms: tuple[float, float] = (math.nan, math.nan)
    #: the share of the requests sent that met every SLO given (NaN: no SLO)
    slo_attainment: float = math.nan
    #: per instance (sorted by name): its share of the answered requests, and the client
    #: TTFT p90 of those (ms, simulated)
    instance_share: tuple[float, ...] = ()
    instance_ttft_p90_ms: tuple[float, ...] = ()
    #: the EPP's TTFT prediction error after warm-up, p50/p90 (ms, simulated; NaN: none)
    prediction_error_ms: tuple[float, float] = (math.nan, math.nan)
    #: requests the external load completed straight on its server
    external_requests: int = 0
    #: where requests waited in the EPP (``_epp_wait``; empty: no EPP)
    epp_wait: tuple[float, ...] = ()


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
    result.append("--enable-prompt-tokens-details")
    return result


def summarise(
    mode: str,
    rec: ClientRecord,
    elapsed: float,
    stats: dict[str, dict[str, Any]],
    time_scale: float = 0.0,
    *,
    slo_ms: tuple[float, float] = (0.0, 0.0),
    prediction_error_ms: tuple[float, float] = (math.nan, math.nan),
    external_requests: int = 0,
    epp_wait: tuple[float, ...] = (),
) -> Outcome:
    """One column: the client's record and the simulators' counters (``/sim/stats``);
    with ``time_scale`` also the client's TTFB and TPOT in simulated time, and the share
    of requests within ``slo_ms`` (TTFT, TPOT in simulated ms; 0: none). The hit rate is
    the client's own requests' (their streamed ``usage``) when the servers report cached
    tokens, else the simulators' counters."""
    scale = time_scale if time_scale > 0 else 1.0
    scaled = [t / time_scale for t in rec.ttfb_ms] if time_scale > 0 else []
    tpots = [t / scale for t in rec.tpot_ms]
    hits = sum(d["prefix_cache"]["hits"] for d in stats.values())
    queries = sum(d["prefix_cache"]["queries"] for d in stats.values())
    if rec.prompt_tokens > 0 and rec.cached_tokens > 0:
        hits, queries = rec.cached_tokens, rec.prompt_tokens
    slo_ttft, slo_tpot = slo_ms
    attainment = math.nan
    if (slo_ttft > 0 or slo_tpot > 0) and rec.sent:
        met = sum(
            1
            for ttfb, tpot in rec.answered
            if (slo_ttft <= 0 or ttfb / scale <= slo_ttft)
            and (slo_tpot <= 0 or tpot / scale <= slo_tpot)
        )
        attainment = met / rec.sent
    names = sorted(stats)
    answered = max(1, len(rec.ttfb_ms))
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
        }
        if not external_requests
        else {name: rec.instances.get(name, 0) for name in names},
        evictions=sum(d["kv_cache"]["evictions"] for d in stats.values()),
        preemptions=sum(d["requests"]["preemptions"] for d in stats.values()),
        errors=dict(rec.errors),
        instances_per_group=(
            sum(len(s) for s in rec.group_instances.values()) / len(rec.group_instances)
            if rec.group_instances
            else math.nan
        ),
        groups_per_instance=_groups_per_instance(rec, sorted(stats)),
        sim_ttft_samples_ms=tuple(ttft),
        client_ttft_ms=(
            percentile(scaled, 0.5),
            percentile(scaled, 0.9),
            percentile(scaled, 0.99),
        ),
        client_ttft_samples_ms=tuple(scaled),
        client_tpot_ms=(percentile(tpots, 0.5), percentile(tpots, 0.9)),
        slo_attainment=attainment,
        instance_share=tuple(rec.instances.get(name, 0) / answered for name in names),
        instance_ttft_p90_ms=tuple(
            percentile([t / scale for t in rec.ttfb_by_instance.get(name, [])], 0.9)
            for name in names
        ),
        prediction_error_ms=prediction_error_ms,
        external_requests=external_requests,
        epp_wait=epp_wait,
    )


def _groups_per_instance(rec: ClientRecord, instances: Sequence[str]) -> tuple[int, ...]:
    """Per instance, how many groups it served most of (a group's home)."""
    homes = Counter(c.most_common(1)[0][0] for c in rec.group_requests.values() if c)
    return tuple(homes.get(name, 0) for name in instances)


def run_mode(
    mode: str, args: argparse.Namespace, sessions: Sessions, workload: str = "shared-prefix"
) -> Outcome:
    """One column on fresh simulators: through Envoy and the EPP, or through the
    ``sglang-router`` gateway for the ``sglang-*`` modes. ``workload`` ``heterogeneous``
    slows the first simulator down (``--slowdown``), ``external-load`` sends it
    ``--external-streams`` of its own, ``bursts`` sends the requests open loop."""
    policy = SGLANG_MODES.get(mode)
    sim_args = simulator_args(args)
    if workload == "heterogeneous":
        sim_args += ["--slow-instances", "1", "--slowdown", str(args.slowdown)]
    options = StackOptions(
        simulators=args.instances,
        simulator_base_ip=args.base_ip,
        simulator_args=sim_args,
        epp=policy is None,
        envoy=policy is None,
        epp_args={**MODES, **EXTRA_MODES}.get(mode, ()),
    )
    with Stack.run(options) as stack:
        url = stack.url if policy is None else start_sglang_router(stack, policy)
        metrics_url = stack.epp_metrics_url if policy is None else None
        rec, elapsed, error, external = asyncio.run(
            _drive(args, workload, sessions, url, stack, metrics_url)
        )
        stats = asyncio.run(sim_stats(stack.simulator_urls))
        wait: tuple[float, ...] = ()
        if metrics_url is not None:
            sent = sum(len(s) for s in sessions)
            wait = asyncio.run(_epp_wait(metrics_url, sent, args.time_scale))
    return summarise(
        mode,
        rec,
        elapsed,
        stats,
        args.time_scale,
        slo_ms=(args.slo_ttft_ms, args.slo_tpot_ms),
        prediction_error_ms=error,
        external_requests=external,
        epp_wait=wait,
    )


#: The EPP's histogram of its TTFT prediction errors (per endpoint and kind).
PREDICTION_ERROR = "inference_extension_latency_prediction_error_seconds"
#: How long ``kv-capacity-gate`` held requests, and how long each scheduling took.
KV_GATE_WAIT_METRIC = "inference_extension_kv_capacity_gate_wait_seconds"
SCHEDULER_METRIC = "inference_extension_scheduler_e2e_duration_seconds"


async def _drive(
    args: argparse.Namespace,
    workload: str,
    sessions: Sessions,
    url: str,
    stack: Stack,
    metrics_url: str | None,
) -> tuple[ClientRecord, float, tuple[float, float], int]:
    """Runs the workload (with the external load when asked); returns the client's record,
    the time taken, the EPP's TTFT prediction error after the first third of the requests
    (p50, p90 in simulated ms) and the external requests done."""
    total = sum(len(s) for s in sessions)
    # the error histogram once a third of the requests were sent (None: not yet taken)
    warm: list[dict[float, float] | None] = []

    async def progress(sent: int) -> None:
        if metrics_url is not None and not warm and sent >= total // 3:
            warm.append(None)
            warm[0] = await _error_buckets(metrics_url)

    headers = slo_headers(args)
    stop = asyncio.Event()
    external: ExternalLoad | None = None
    background: asyncio.Task[None] | None = None
    if workload == "external-load":
        first = stack.simulator_urls[sorted(stack.simulator_urls)[0]]
        external = ExternalLoad(
            first, args.external_streams, SYSTEM_CHARS + QUESTION_CHARS, args.max_tokens, args.seed
        )
        background = asyncio.create_task(external.run(stop))
    try:
        if workload == "bursts":
            flat = [item for s in sessions for item in s]
            times = burst_schedule(
                len(flat), args.burst_rate, args.burst_idle, args.burst_factor, args.seed
            )
            rec, elapsed = await drive_open_loop(
                url,
                flat,
                [t * args.time_scale for t in times],
                args.max_tokens,
                headers=headers,
                progress=progress,
            )
        else:
            rec, elapsed = await drive_sessions(
                url,
                sessions,
                args.concurrency,
                args.max_tokens,
                headers=headers,
                progress=progress,
            )
    finally:
        stop.set()
        if background is not None:
            await background
    error = (math.nan, math.nan)
    before = warm[0] if warm else None
    if metrics_url is not None and before is not None:
        end = await _error_buckets(metrics_url)
        if end is not None:
            delta = {le: end.get(le, 0.0) - before.get(le, 0.0) for le in end}
            error = (
                _bucket_quantile(delta, 0.5) * 1e3 / args.time_scale,
                _bucket_quantile(delta, 0.9) * 1e3 / args.time_scale,
            )
    return rec, elapsed, error, external.done if external is not None else 0


def slo_headers(args: argparse.Namespace) -> dict[str, str]:
    """The SLO headers of every request: ``--slo-ttft-ms`` and ``--slo-tpot-ms`` are in
    simulated time, the EPP sees real time (x the time scale)."""
    headers: dict[str, str] = {}
    if args.slo_ttft_ms > 0:
        headers["x-slo-ttft-ms"] = f"{args.slo_ttft_ms * args.time_scale:g}"
    if args.slo_tpot_ms > 0:
        headers["x-slo-tpot-ms"] = f"{args.slo_tpot_ms * args.time_scale:g}"
    return headers


async def _metrics_text(metrics_url: str) -> str:
    async with (
        aiohttp.ClientSession() as session,
        session.get(metrics_url) as response,
    ):
        return (await response.read()).decode()


def _histogram(text: str, name: str, match: str = "") -> tuple[dict[float, float], float]:
    """The histogram ``name`` in an exposition ``text``, every series whose labels contain
    ``match`` summed: upper bound -> cumulative count, and the sum of the observations."""
    buckets: dict[float, float] = {}
    total = 0.0
    prefix = f"{name}_bucket{{"
    sum_prefix = f"{name}_sum"
    for line in text.splitlines():
        if line.startswith(sum_prefix) and match in line:
            total += float(line.rsplit(" ", 1)[1])
            continue
        if not line.startswith(prefix) or match not in line:
            continue
        labels, value = line[len(prefix) :].rsplit(" ", 1)
        bound = labels.split('le="', 1)[1].split('"', 1)[0]
        le = math.inf if bound == "+Inf" else float(bound)
        buckets[le] = buckets.get(le, 0.0) + float(value)
    return buckets, total


async def _error_buckets(metrics_url: str) -> dict[float, float] | None:
    """The EPP's TTFT prediction-error histogram, every endpoint's summed: upper bound ->
    cumulative count; ``None`` when the EPP does not export it."""
    buckets, _ = _histogram(await _metrics_text(metrics_url), PREDICTION_ERROR, 'kind="ttft"')
    return buckets or None


async def _epp_wait(metrics_url: str, requests: int, time_scale: float) -> tuple[float, ...]:
    """Where a request waited in the EPP over the run: the share of the requests
    ``kv-capacity-gate`` held, their mean and p90 hold (ms, simulated), and the
    scheduler's p90 per decision (ms, real)."""
    text = await _metrics_text(metrics_url)
    gate, gate_sum = _histogram(text, KV_GATE_WAIT_METRIC)
    held = max(gate.values(), default=0.0)
    schedule, _ = _histogram(text, SCHEDULER_METRIC)
    return (
        held / max(1, requests),
        gate_sum / held * 1e3 / time_scale if held else 0.0,
        _bucket_quantile(gate, 0.9) * 1e3 / time_scale if held else 0.0,
        _bucket_quantile(schedule, 0.9) * 1e3,
    )


def _bucket_quantile(cumulative: Mapping[float, float], q: float) -> float:
    """The ``q`` quantile of a cumulative histogram, interpolated within its bucket."""
    bounds = sorted(cumulative)
    total = cumulative[bounds[-1]] if bounds else 0.0
    if total <= 0:
        return math.nan
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound in bounds:
        count = cumulative[bound]
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            width = count - lower_count
            share = (rank - lower_count) / width if width > 0 else 1.0
            return lower_bound + (bound - lower_bound) * share
        lower_bound, lower_count = bound, count
    return lower_bound


def sglang_router_missing() -> str | None:
    """Why the ``sglang-*`` columns cannot run (``None``: they can). Installs the bench
    extra's ``sglang-router`` into this interpreter's environment on first use."""
    if importlib.util.find_spec("sglang_router") is None:
        print(f"  installing {SGLANG_REQUIREMENT} (the bench extra) ...", flush=True)
        done = subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", SGLANG_REQUIREMENT],
            capture_output=True,
            text=True,
            check=False,
        )
        importlib.invalidate_caches()
        if done.returncode != 0 or importlib.util.find_spec("sglang_router") is None:
            last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["?"]
            return f"{SGLANG_REQUIREMENT} is not installable here: {last[0]}"
    probe = subprocess.run(
        [sys.executable, "-m", "sglang_router.launch_router", "--help"],
        capture_output=True,
        text=True,
        check=False,
    )
    if probe.returncode != 0:
        return f"sglang_router.launch_router does not start here: {probe.stderr.strip()[-300:]}"
    return None


def start_sglang_router(stack: Stack, policy: str) -> str:
    """SGLang's model gateway in front of the stack's simulators (no Envoy, no EPP), with
    its default thresholds; waits until it reports every worker healthy. Its URL."""
    port = free_port()
    router = stack._spawn(
        "sglang-router",
        [
            sys.executable,
            "-m",
            "sglang_router.launch_router",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--policy",
            policy,
            "--log-level",
            "warn",
            "--worker-urls",
            *stack.simulator_urls.values(),
        ],
    )
    url = f"http://127.0.0.1:{port}"
    expected = len(stack.simulator_urls)

    def ready() -> bool:
        router.check_alive()
        try:
            with urllib.request.urlopen(f"{url}/readiness", timeout=2) as response:
                document = orjson.loads(response.read())
        except (OSError, ValueError):
            return False
        return bool(document.get("healthy_workers") == expected)

    wait_for(ready, timeout=60, what="the sglang router's workers")
    return url


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
        (
            "client TTFT p50 / p90 / p99 (ms, simulated)",
            ["{:.0f} / {:.0f} / {:.0f}".format(*o.client_ttft_ms) for o in outcomes],
        ),
        ("client TTFB p50 (ms, real)", [f"{o.ttfb_ms[0]:.0f}" for o in outcomes]),
        ("client TTFB p90 (ms, real)", [f"{o.ttfb_ms[1]:.0f}" for o in outcomes]),
        ("client latency p50 (ms, real)", [f"{o.latency_ms_p50:.0f}" for o in outcomes]),
        (
            "requests per instance",
            [" ".join(str(v) for v in o.per_instance.values()) for o in outcomes],
        ),
        (
            "groups per instance (their home)",
            ["-".join(str(v) for v in o.groups_per_instance) for o in outcomes],
        ),
        (
            "instances per group/session (mean)",
            [f"{o.instances_per_group:.2f}" for o in outcomes],
        ),
        ("KV evictions (blocks)", [str(o.evictions) for o in outcomes]),
        ("preemptions", [str(o.preemptions) for o in outcomes]),
        (
            "client TPOT p50 / p90 (ms, simulated)",
            ["{:.1f} / {:.1f}".format(*o.client_tpot_ms) for o in outcomes],
        ),
        (
            "share of requests per instance",
            [" ".join(f"{v:.0%}" for v in o.instance_share) for o in outcomes],
        ),
        (
            "client TTFT p90 per instance (ms, sim.)",
            [" ".join(f"{v:.0f}" for v in o.instance_ttft_p90_ms) for o in outcomes],
        ),
        *extra_rows,
    ]
    if any(not math.isnan(o.slo_attainment) for o in outcomes):
        rows.append(
            ("SLO attainment (of requests sent)", [f"{o.slo_attainment:.1%}" for o in outcomes])
        )
    if any(not math.isnan(o.prediction_error_ms[1]) for o in outcomes):
        rows.append(
            (
                "TTFT prediction error p50 / p90 (ms, sim.)",
                ["{:.0f} / {:.0f}".format(*o.prediction_error_ms) for o in outcomes],
            )
        )
    if any(o.epp_wait for o in outcomes):
        rows.append(
            (
                "held by kv gate: share, mean / p90 (ms, sim.)",
                [
                    "{:.1%}, {:.0f} / {:.0f}".format(*o.epp_wait[:3]) if o.epp_wait else "-"
                    for o in outcomes
                ],
            )
        )
        rows.append(
            (
                "scheduling p90 (ms, real)",
                [f"{o.epp_wait[3]:.2f}" if o.epp_wait else "-" for o in outcomes],
            )
        )
    if any(o.external_requests for o in outcomes):
        rows.append(
            (
                "external requests (straight to the first)",
                [str(o.external_requests) for o in outcomes],
            )
        )
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
    parser.add_argument(
        "--load",
        choices=sorted(LOADS),
        default="default",
        help="light: --concurrency 8; pressure: --groups 40 --num-gpu-blocks 240"
        " --concurrency 48 (flags given explicitly win)",
    )
    parser.add_argument(
        "--slo-ttft-ms", type=float, default=0.0, help="TTFT SLO of every request (simulated)"
    )
    parser.add_argument(
        "--slo-tpot-ms", type=float, default=0.0, help="TPOT SLO of every request (simulated)"
    )


#: ``--load`` presets: flag -> value, applied unless the flag is given.
LOADS: dict[str, dict[str, int]] = {
    "default": {},
    "light": {"concurrency": 8},
    "pressure": {"groups": 40, "num_gpu_blocks": 240, "concurrency": 48},
}


def finish_workload_arguments(args: argparse.Namespace) -> None:
    """Fill in the defaults that depend on ``--quick`` and ``--load``."""
    if args.rounds is None:
        args.rounds = 2 if args.quick else 6
    if args.time_scale is None:
        args.time_scale = 0.2 if args.quick else 0.5
    given = {a.split("=", 1)[0].removeprefix("--").replace("-", "_") for a in sys.argv[1:]}
    for name, value in LOADS[args.load].items():
        if name not in given:
            setattr(args, name, value)


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


def build_sessions(name: str, args: argparse.Namespace) -> tuple[Sessions, str]:
    """The workload ``name`` and one line describing it."""
    if name in ("heterogeneous", "external-load", "bursts"):
        sessions, line = build_sessions("shared-prefix", args)
        if name == "heterogeneous":
            return sessions, f"{line}; the first server {args.slowdown:g}x slower"
        if name == "external-load":
            return sessions, (
                f"{line}; {args.external_streams} requests at a time of"
                f" {SYSTEM_CHARS + QUESTION_CHARS} chars each straight to the first server"
            )
        return sessions, (
            f"{line}; open loop instead: half at {args.burst_rate:g}/s (simulated), idle"
            f" {args.burst_idle:g} s, the rest at {args.burst_factor:g}x that rate"
        )
    if name == "shared-prefix":
        workload = build_workload(
            groups=args.groups,
            prompts_per_group=args.prompts_per_group,
            rounds=args.rounds,
            seed=args.seed,
        )
        return [[item] for item in workload], describe(args, workload)
    if name == "multi-turn":
        sessions = multi_turn_sessions(sessions=args.sessions, turns=args.turns, seed=args.seed)
        last = MULTI_TURN_SYSTEM_CHARS + MULTI_TURN_CONTEXT_CHARS
        last += args.turns * MULTI_TURN_USER_CHARS + (args.turns - 1) * MULTI_TURN_REPLY_CHARS
        return sessions, (
            f"{args.sessions} sessions x {args.turns} turns = {args.sessions * args.turns}"
            f" requests, each turn the whole conversation ({MULTI_TURN_SYSTEM_CHARS} shared +"
            f" {MULTI_TURN_CONTEXT_CHARS} own chars, then +{MULTI_TURN_USER_CHARS} user"
            f" +{MULTI_TURN_REPLY_CHARS} reply a turn; last turn {last} chars)"
        )
    if name == "no-share":
        return no_share_workload(requests=args.requests, seed=args.seed), (
            f"{args.requests} prompts of {SYSTEM_CHARS + QUESTION_CHARS} chars sharing nothing"
        )
    if name == "zipf":
        return zipf_workload(
            prefixes=args.prefixes, requests=args.requests, exponent=args.zipf, seed=args.seed
        ), (
            f"{args.requests} prompts on {args.prefixes} prefixes of {SYSTEM_CHARS} chars,"
            f" popularity 1/rank^{args.zipf} (a few hot), each + {QUESTION_CHARS} chars own"
        )
    raise ValueError(name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_arguments(parser)
    parser.add_argument(
        "--modes",
        default=",".join([*MODES, *SGLANG_MODES]),
        help=f"columns, in order (default: all of {', '.join([*MODES, *SGLANG_MODES])}; "
        f"also {', '.join(EXTRA_MODES)})",
    )
    parser.add_argument(
        "--workload",
        default="all",
        help=f"which workloads, comma-separated (default: all, one table each): "
        f"{', '.join(WORKLOADS)}",
    )
    parser.add_argument("--sessions", type=int, default=None, help="multi-turn (48; quick 24)")
    parser.add_argument("--turns", type=int, default=None, help="multi-turn (6; quick 4)")
    parser.add_argument(
        "--requests", type=int, default=None, help="no-share and zipf (400; quick 100)"
    )
    parser.add_argument("--prefixes", type=int, default=40, help="zipf")
    parser.add_argument("--zipf", type=float, default=1.1, help="zipf exponent")
    parser.add_argument(
        "--slowdown", type=float, default=2.0, help="heterogeneous: the slow server's factor"
    )
    parser.add_argument(
        "--external-streams",
        type=int,
        default=16,
        help="external-load: concurrent requests sent straight to the first server",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="runs of every column (orders alternated), then the requests of all pooled",
    )
    parser.add_argument(
        "--burst-rate",
        type=float,
        default=4.0,
        help="bursts: the steady rate, requests per simulated second",
    )
    parser.add_argument(
        "--burst-idle", type=float, default=20.0, help="bursts: simulated seconds of idle"
    )
    parser.add_argument(
        "--burst-factor", type=float, default=4.0, help="bursts: the burst's rate / the steady"
    )
    args = parser.parse_args()
    finish_workload_arguments(args)
    if args.sessions is None:
        args.sessions = 24 if args.quick else 48
    if args.turns is None:
        args.turns = 4 if args.quick else 6
    if args.requests is None:
        args.requests = 100 if args.quick else 400

    unknown_workloads = set(args.workload.split(",")) - {*WORKLOADS, "all"}
    if unknown_workloads:
        parser.error(f"--workload: unknown {', '.join(sorted(unknown_workloads))}")
    modes = args.modes.split(",")
    known = {*MODES, *EXTRA_MODES, *SGLANG_MODES}
    unknown = [m for m in modes if m not in known]
    if unknown:
        parser.error(f"--modes: unknown {', '.join(unknown)}")
    if any(m in SGLANG_MODES for m in modes):
        missing = sglang_router_missing()
        if missing:
            print(f"skipping the sglang columns: {missing}")
            modes = [m for m in modes if m not in SGLANG_MODES]
    names = list(WORKLOADS) if args.workload == "all" else args.workload.split(",")
    print(f"load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}", flush=True)
    for name in names:
        sessions, line = build_sessions(name, args)
        print(f"== {name}: {line}", flush=True)
        runs: list[dict[str, Outcome]] = []
        for repeat in range(args.repeat):
            outcomes: dict[str, Outcome] = {}
            # alternate the order, so that the machine's drifting load falls on each alike
            for mode in modes if repeat % 2 == 0 else list(reversed(modes)):
                started = time.perf_counter()
                outcomes[mode] = run_mode(mode, args, sessions, name)
                print(f"  {mode}: done in {time.perf_counter() - started:.0f} s", flush=True)
            runs.append(outcomes)
            print()
            print_table([outcomes[mode] for mode in modes])
            print(flush=True)
        if args.repeat > 1:
            print_pooled(name, modes, runs)


def print_pooled(name: str, modes: Sequence[str], runs: Sequence[Mapping[str, Outcome]]) -> None:
    """Every run's requests pooled per column: client TTFT percentiles over all of them,
    the hit rate's and the gate's figures per run."""
    print(f"== {name}, {len(runs)} runs pooled (the columns' order alternated)")
    rows: list[tuple[str, list[str]]] = []
    pooled = {m: [t for run in runs for t in run[m].client_ttft_samples_ms] for m in modes}
    rows.append(
        (
            "client TTFT p50 / p90 / p99 (ms, sim.)",
            [
                " / ".join(f"{percentile(pooled[m], q):.0f}" for q in (0.5, 0.9, 0.99))
                for m in modes
            ],
        )
    )
    base = percentile(pooled[modes[0]], 0.9)
    rows.append(
        (
            f"client TTFT p90 against {modes[0]}",
            [f"{percentile(pooled[m], 0.9) / base - 1:+.1%}" for m in modes],
        )
    )
    rows.append(
        (
            "client TTFT p90 per run (ms, sim.)",
            [" ".join(f"{run[m].client_ttft_ms[1]:.0f}" for run in runs) for m in modes],
        )
    )
    rows.append(
        ("hit rate per run", [" ".join(f"{run[m].hit_rate:.1%}" for run in runs) for m in modes])
    )
    rows.append(
        (
            "hit rate mean",
            [f"{sum(run[m].hit_rate for run in runs) / len(runs):.1%}" for m in modes],
        )
    )
    rows.append(
        (
            "held by kv gate per run (share)",
            [
                " ".join(f"{run[m].epp_wait[0]:.0%}" if run[m].epp_wait else "-" for run in runs)
                for m in modes
            ],
        )
    )
    width = max(len(label) for label, _ in rows)
    columns = [max(len(m), *(len(r[1][i]) for r in rows)) for i, m in enumerate(modes)]
    print(f"{'':<{width}}  " + "  ".join(f"{m:>{c}}" for m, c in zip(modes, columns, strict=True)))
    for label, values in rows:
        print(
            f"{label:<{width}}  "
            + "  ".join(f"{v:>{c}}" for v, c in zip(values, columns, strict=True))
        )
    print(flush=True)


if __name__ == "__main__":
    main()
