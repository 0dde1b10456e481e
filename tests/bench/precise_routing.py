"""Benchmark (not a test): precise vs approximate vs random prefix routing under cache pressure.

Issue 16's measurement. Every column runs ``tests.bench.routing_quality``'s shared-prefix
workload (``--groups`` groups of ``--prompts-per-group`` prompts sharing an 8,000-character
system prompt, ``--rounds`` shuffled rounds) through Envoy and the EPP, each column on
fresh simulators that tokenize with a tokenizer the script trains on the workload's words
(no download; about 1,170 tokens per system prompt, 73 blocks of 16), hash blocks as vLLM
does and publish their KV-cache events over ZMQ (stored on prefill, removed on eviction).
Each simulator has ``--num-gpu-blocks`` (480) blocks, about 6.5 system prompts: 1,920 over
the 4 simulators against a working set of about 2,300 blocks (20 system prompts of 73
blocks, 100 questions of about 8), so the caches evict all the time. With 256 (about 3
sequences at once per server) requests also wait for blocks.

Columns (``--modes``):

- ``approximate``: the reference's default blend (queue 2, KV-cache utilization 2, prefix
  3) with ``approx-prefix-cache-producer``: where the EPP *sent* prefixes;
- ``precise``: the same blend with ``precise-prefix-cache-producer`` (the servers' events,
  speculative entries for 2 s); ``precise-nospec``: without speculative entries, so the
  accuracy is the events' index alone;
- ``random``: ``random-picker``;
- ``sticky``, ``sticky-precise``: the default "sticky until saturated" profile with the
  approximate producer, and with the precise one (optional columns).

Prints side by side the simulators' own figures (prefix-cache hit rate in tokens, TTFT
p50/p90 in simulated time, evictions) and the index's **accuracy**: per request, the
cached tokens the EPP predicted for the endpoint it chose (its ``prefix-cache-scorer``
score, from ``--explain-decisions``, times the prompt's full-block tokens) against the
cached tokens that server reported for it (``usage.prompt_tokens_details``): the share of
predicted tokens the server really had, ``sum(min(predicted, real)) / sum(predicted)``.
Then the issue's targets: accuracy >= 95%, hit rate above approximate, TTFT p90 at least
30% below approximate (the client's TTFT in simulated time, as ``routing_quality`` judges
it: a config with ``kv-capacity-gate`` waits in the EPP, which the simulators' own TTFT does
not see). About a minute per column on 2 cores (``--quick``: 10-30 s).

    PYTHONPATH=. .venv/bin/python -m tests.bench.precise_routing [--quick] [--seed 1]
        [--modes approximate,precise,precise-nospec,random,sticky,sticky-precise]
        [--num-gpu-blocks 480]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import re
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import orjson
from tokenizers import Tokenizer

from app.config import REFERENCE_DEFAULT_CONFIG_TEXT
from tests.bench.profiles import RANDOM_CONFIG, sticky_config
from tests.bench.routing_quality import (
    _VOCABULARY,
    SYSTEM_CHARS,
    ClientRecord,
    Outcome,
    add_workload_arguments,
    build_workload,
    finish_workload_arguments,
    print_table,
    sim_stats,
    stream_completion,
    summarise,
)
from tests.simulator import DEFAULT_MODEL
from tests.simulator.server import CACHED_ON_ARRIVAL_HEADER
from tests.support.stack import Stack, StackOptions, free_port, metric_sum
from tests.support.tokenizer import write_tokenizer_json

BLOCK_SIZE = 16
HASH_SEED = "16"
DECISION_HEADER = "x-epp-decision"
PRECISE_MODES = frozenset({"precise", "precise-nospec", "sticky-precise"})
ALL_MODES = ("approximate", "precise", "precise-nospec", "random", "sticky", "sticky-precise")


def precise_producer(tokenizer: Path, port: int, speculative_ttl: str = "2s") -> str:
    """The ``precise-prefix-cache-producer`` entry of a config's plugin list."""
    return f"""\
- type: precise-prefix-cache-producer
  parameters:
    tokenProcessorConfig:
      blockSizeTokens: {BLOCK_SIZE}
      hashSeed: "{HASH_SEED}"
      tokenizerPath: "{tokenizer}"
    kvEventsConfig: {{socketPort: {port}, replayPort: {port + 1}}}
    speculativeTtl: {speculative_ttl}
"""


def mode_config(mode: str, tokenizer: Path, port: int) -> str:
    """The EndpointPickerConfig of a column."""
    if mode == "approximate":
        return REFERENCE_DEFAULT_CONFIG_TEXT
    if mode == "precise":
        head, rest = REFERENCE_DEFAULT_CONFIG_TEXT.split("plugins:\n", 1)
        return head + "plugins:\n" + precise_producer(tokenizer, port) + rest
    if mode == "precise-nospec":
        head, rest = REFERENCE_DEFAULT_CONFIG_TEXT.split("plugins:\n", 1)
        return head + "plugins:\n" + precise_producer(tokenizer, port, "0s") + rest
    if mode == "random":
        return RANDOM_CONFIG
    if mode == "sticky":
        return sticky_config()
    if mode == "sticky-precise":
        head, rest = sticky_config().split("plugins:\n", 1)
        return head + "plugins:\n" + precise_producer(tokenizer, port) + rest
    raise ValueError(mode)


@dataclass
class Accuracy:
    """Per request: the cached tokens the EPP predicted on the endpoint it chose, against
    what that server held when the request arrived, and when it was scheduled."""

    predicted: int = 0  # tokens the EPP predicted cached on the chosen endpoint
    confirmed: int = 0  # sum(min(predicted, held on arrival))
    confirmed_at_schedule: int = 0  # sum(min(predicted, reused when scheduled))
    on_arrival: int = 0  # tokens the chosen servers held on arrival
    reused: int = 0  # tokens the servers reused (usage.prompt_tokens_details)
    requests: int = 0
    overpredicted: int = 0  # requests whose prediction exceeded the server's cache

    @property
    def share(self) -> float:
        return self.confirmed / self.predicted if self.predicted else math.nan

    @property
    def share_at_schedule(self) -> float:
        return self.confirmed_at_schedule / self.predicted if self.predicted else math.nan


_PICKED = re.compile(r"picked ([^,;| ]+)")


def predicted_share(decision: str) -> float | None:
    """The chosen endpoint's ``prefix-cache-scorer`` score in an ``x-epp-decision`` value
    (``None``: the header has none, e.g. ``random``)."""
    picked = _PICKED.search(decision)
    if picked is None:
        return None
    endpoint = picked.group(1)
    match = re.search(re.escape(endpoint) + r"=[^(]*\([^)]*prefix-cache-scorer=([0-9.]+)", decision)
    return float(match.group(1)) if match is not None else None


async def send_one(
    session: aiohttp.ClientSession,
    url: str,
    group: int,
    prompt: str,
    max_tokens: int,
    rec: ClientRecord,
    accuracy: Accuracy,
    prompt_tokens: int,
) -> None:
    """One streamed request; ``prompt_tokens``: the prompt's length in the servers' tokens
    (``usage.prompt_tokens`` counts the simulator's pseudo-tokens, four characters each)."""
    request = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream_options": {"include_usage": True},
    }
    answered = await stream_completion(session, url, group, request, rec)
    if answered is None:
        return
    text, headers = answered
    decision = headers.get(DECISION_HEADER, "")
    on_arrival = int(headers.get(CACHED_ON_ARRIVAL_HEADER, "0"))
    usage = None
    for line in text.split(b"\n"):
        if line.startswith(b"data: {") and b'"usage"' in line:
            chunk = orjson.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
    if usage is None:
        rec.errors["no usage chunk"] += 1
        return
    reused = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    share = predicted_share(decision)
    accuracy.requests += 1
    accuracy.reused += reused
    accuracy.on_arrival += on_arrival
    if share is None:
        return
    # the server never reuses a prompt's last token: at most (tokens - 1) // 16 blocks
    blocks = min(round(share * (prompt_tokens // BLOCK_SIZE)), (prompt_tokens - 1) // BLOCK_SIZE)
    predicted = blocks * BLOCK_SIZE
    accuracy.predicted += predicted
    accuracy.confirmed += min(predicted, on_arrival)
    accuracy.confirmed_at_schedule += min(predicted, reused)
    accuracy.overpredicted += predicted > on_arrival


async def drive(
    url: str,
    workload: Sequence[tuple[int, str]],
    concurrency: int,
    max_tokens: int,
    tokens: dict[str, int],
) -> tuple[ClientRecord, Accuracy, float]:
    rec = ClientRecord()
    accuracy = Accuracy()
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
                await send_one(
                    session, url, group, prompt, max_tokens, rec, accuracy, tokens[prompt]
                )

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    return rec, accuracy, elapsed


async def warm_up(stack: Stack, tokenizer_ready: bool) -> None:
    """Until the EPP's subscribers are connected, events would be missed: send one request
    through the EPP (its producer subscribes then), then one to each simulator directly until
    the EPP has counted a stored block from each (precise columns only); then reset every
    cache."""
    if not tokenizer_ready:
        return
    async with aiohttp.ClientSession() as session:
        # the producer subscribes on its first request
        async with session.post(
            f"{stack.url}/v1/completions",
            json={"model": DEFAULT_MODEL, "prompt": "start", "max_tokens": 1},
        ) as response:
            await response.read()
        deadline = time.monotonic() + 30
        while True:
            for sim in stack.simulator_urls.values():
                async with session.post(
                    f"{sim}/v1/completions",
                    json={"model": DEFAULT_MODEL, "prompt": "warm up " * 40, "max_tokens": 1},
                ) as response:
                    await response.read()
            text = metrics_text(stack.epp_metrics_url)
            heard = {
                line.split('endpoint="', 1)[1].split('"', 1)[0]
                for line in text.splitlines()
                if line.startswith("inference_extension_kv_events_total{")
                and '"BlockStored"' in line
            }
            if len(heard) >= len(stack.simulator_urls):
                break
            if time.monotonic() > deadline:
                raise RuntimeError("the EPP's KV-event subscribers never connected")
            await asyncio.sleep(0.2)
        for sim in stack.simulator_urls.values():
            async with session.post(f"{sim}/reset_prefix_cache") as response:
                await response.read()


@dataclass(frozen=True)
class Column:
    outcome: Outcome
    accuracy: Accuracy
    events: dict[str, float]


def run_mode(
    mode: str,
    args: argparse.Namespace,
    workload: Sequence[tuple[int, str]],
    tokenizer: Path,
    tokens: dict[str, int],
) -> Column:
    port = free_port(args.base_ip)
    options = StackOptions(
        simulators=args.instances,
        simulator_base_ip=args.base_ip,
        simulator_args=[
            "--preset", "h100-8b",
            "--time-scale", str(args.time_scale),
            "--num-gpu-blocks", str(args.num_gpu_blocks),
            "--block-size", str(BLOCK_SIZE),
            "--tokenizer", str(tokenizer),
            "--hash-seed", HASH_SEED,
            "--kv-events-port", str(port),
            "--enable-prompt-tokens-details",
            *(["--max-num-seqs", str(args.max_num_seqs)] if args.max_num_seqs else []),
        ],
        epp_args=[
            "--config-text", mode_config(mode, tokenizer, port), "--explain-decisions",
        ],
    )  # fmt: skip
    with Stack.run(options) as stack:
        asyncio.run(warm_up(stack, mode in PRECISE_MODES))
        rec, accuracy, elapsed = asyncio.run(
            drive(stack.url, workload, args.concurrency, args.max_tokens, tokens)
        )
        stats = asyncio.run(sim_stats(stack.simulator_urls))
        events = {}
        if mode in PRECISE_MODES:
            text = metrics_text(stack.epp_metrics_url)
            for kind in ("BlockStored", "BlockRemoved", "AllBlocksCleared"):
                events[kind] = sum(
                    float(line.rsplit(" ", 1)[1])
                    for line in text.splitlines()
                    if line.startswith("inference_extension_kv_events_total{")
                    and f'"{kind}"' in line
                )
            events["gaps"] = metric_sum(
                stack.epp_metrics_url, "inference_extension_kv_events_gaps_total"
            )
            events["errors"] = metric_sum(
                stack.epp_metrics_url, "inference_extension_kv_events_errors_total"
            )
    return Column(summarise(mode, rec, elapsed, stats, args.time_scale), accuracy, events)


def metrics_text(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=5) as response:
        return str(response.read().decode())


def bench_tokenizer(directory: Path, workload: Sequence[tuple[int, str]]) -> Path:
    """A byte-level BPE trained on the workload's words (no download)."""
    sample = [prompt for _, prompt in workload[:40]]
    return write_tokenizer_json(
        directory / "tokenizer.json", vocab_size=400, corpus=[_VOCABULARY, *sample] * 3
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_arguments(parser)
    parser.set_defaults(base_ip="127.0.0.160")
    parser.add_argument("--modes", default="approximate,precise,random")
    args = parser.parse_args()
    finish_workload_arguments(args)
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in ALL_MODES]
    if unknown:
        parser.error(f"--modes: unknown {', '.join(unknown)} (known: {', '.join(ALL_MODES)})")
    workload = build_workload(
        groups=args.groups,
        prompts_per_group=args.prompts_per_group,
        rounds=args.rounds,
        seed=args.seed,
    )
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = bench_tokenizer(Path(tmp), workload)
        encoder = Tokenizer.from_file(str(tokenizer))
        system_tokens = len(encoder.encode(workload[0][1][:SYSTEM_CHARS]).ids)
        distinct = {prompt for _, prompt in workload}
        tokens = {prompt: len(encoder.encode(prompt).ids) for prompt in distinct}
        print(
            f"{args.instances} simulators (h100-8b, time scale {args.time_scale},"
            f" {args.num_gpu_blocks} KV blocks of {BLOCK_SIZE} each, KV events on ZMQ);"
            f" system prompt ~{system_tokens} tokens = {system_tokens // BLOCK_SIZE} blocks;"
            f" {args.groups} groups x {args.prompts_per_group} prompts ({len(distinct)}"
            f" distinct) x {args.rounds} rounds = {len(workload)} requests, max_tokens"
            f" {args.max_tokens}, {args.concurrency} concurrent, seed {args.seed}",
            flush=True,
        )
        columns: list[Column] = []
        for mode in modes:
            started = time.perf_counter()
            columns.append(run_mode(mode, args, workload, tokenizer, tokens))
            print(f"  {mode}: done in {time.perf_counter() - started:.0f} s", flush=True)
    print()
    extra = [
        (
            "index accuracy (predicted tokens held)",
            [f"{c.accuracy.share:.1%}" if c.accuracy.predicted else "-" for c in columns],
        ),
        (
            "  still held when scheduled",
            [
                f"{c.accuracy.share_at_schedule:.1%}" if c.accuracy.predicted else "-"
                for c in columns
            ],
        ),
        ("predicted cached tokens (sum)", [str(c.accuracy.predicted) for c in columns]),
        ("  held on arrival", [str(c.accuracy.confirmed) for c in columns]),
        ("tokens held on arrival (sum)", [str(c.accuracy.on_arrival) for c in columns]),
        ("tokens reused when scheduled (sum)", [str(c.accuracy.reused) for c in columns]),
        (
            "requests over-predicted",
            [f"{c.accuracy.overpredicted}/{c.accuracy.requests}" for c in columns],
        ),
        (
            "EPP KV events stored/removed",
            [
                f"{c.events['BlockStored']:.0f}/{c.events['BlockRemoved']:.0f}" if c.events else "-"
                for c in columns
            ],
        ),
        (
            "EPP KV event gaps/errors",
            [
                f"{c.events['gaps']:.0f}/{c.events['errors']:.0f}" if c.events else "-"
                for c in columns
            ],
        ),
    ]
    print_table([c.outcome for c in columns], extra)
    print()
    by_mode = {c.outcome.mode: c for c in columns}
    base = by_mode.get("approximate")
    for c in columns:
        if c.outcome.mode not in PRECISE_MODES:
            continue
        line = f"{c.outcome.mode}:"
        if c.accuracy.predicted:
            line += f" index accuracy {c.accuracy.share:.1%} (target >= 95%);"
        reference = by_mode.get("sticky", base) if "sticky" in c.outcome.mode else base
        if reference is not None:
            hit, ref_hit = c.outcome.hit_rate, reference.outcome.hit_rate
            # The client's TTFT: a kv-capacity-gate waits in the EPP, where the simulators'
            # own TTFT does not see it.
            p90, ref_p90 = c.outcome.client_ttft_ms[1], reference.outcome.client_ttft_ms[1]
            line += (
                f" hit rate {hit:.1%} vs {ref_hit:.1%} {reference.outcome.mode}"
                f" (target: above); client TTFT p90 {p90:.0f} vs {ref_p90:.0f} ms,"
                f" {p90 / ref_p90 - 1:+.1%} (target <= -30%)"
            )
        print(line)
    print(time.strftime("%a %b %d %H:%M:%S UTC %Y", time.gmtime()))


if __name__ == "__main__":
    main()
