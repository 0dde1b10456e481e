"""Benchmark (not a test): what metrics and tracing cost on the request path.

Two parts, in one run:

1. Through Envoy: identical stacks (simulated model servers, the EPP, Envoy from the
   shipped config), one per mode, all running at once and loaded in alternating rounds
   with the same closed-loop load: tracing off (``--tracing=false``; metrics are always on,
   as in the reference), and tracing on exporting OTLP/gRPC to a receiver in this script
   (one per mode) with ``parentbased_traceidratio`` at 0.1 and at 1.0, each twice: with
   ours (``adapters.otel``) and with the OpenTelemetry SDK's own spans,
   ``BatchSpanProcessor`` and ``OTLPSpanExporter`` (``tests.bench.sdk_epp``: the same EPP,
   spans, sampler and receiver; only the span recording and export differ). Prints
   requests/s, latency, the EPP's CPU seconds per 1,000 requests, each against tracing off,
   the spans each mode exported per request, and the SDK against ours at each ratio.
2. In process, without network (steadier on a busy machine): CPU per request through the
   ext_proc servicer and the Director with no observer, with the Prometheus metrics only,
   and with metrics and tracing at 0 (nothing sampled), 0.1 and 1.0 (finished spans
   encoded into OTLP export requests by the export thread, then dropped instead of
   sent), ours and the SDK's: what the metrics and the tracing cost the EPP's Python
   request path.

    .venv/bin/python -m tests.bench.observability_overhead [--rounds 120] [--blocks 4]
        [--modes off,ours-0.1,sdk-0.1,ours-1.0,sdk-1.0]

The SDK modes need the SDK's OTLP exporter, ``opentelemetry-exporter-otlp-proto-grpc``
(the ``bench`` extra); without it the script names the command that installs it.

On a small virtual machine the CPU's speed drifts (the same busy loop can take half the
time a few seconds later), so the modes take turns in short rounds, the order alternating,
and each change is computed over the same cycles, with a bootstrap interval. The stacks are
started afresh for each of ``--blocks`` blocks, each mode on another address range each
time, because a process can be a few percent faster or slower than its twin for its whole
life; the per-block changes show how much.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import cast

import aiohttp
import orjson
from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from adapters.envoy.extproc import ExtProcServicer
from adapters.otel.export import OtlpEncoder
from adapters.otel.spans import RecordingSpan
from adapters.otel.tracing import OtelTracing
from adapters.prometheus.exporter import PrometheusObserver
from app.observability import EppObserver
from ports.observer import NoopObserver, Observer
from tests.bench.load import closed_loop, cpu_seconds
from tests.bench.sdk_tracing import INSTALL_HINT, SdkTracing, otlp_exporter_available
from tests.integration.observability.otlp_receiver import OtlpReceiver
from tests.simulator import DEFAULT_MODEL
from tests.support.extproc import (
    envoy_headers,
    replay,
    request_body,
    request_headers,
    response_body,
    response_headers,
)
from tests.support.stack import Stack, StackOptions
from tests.unit.observability.support import observed_director

BODY = orjson.dumps({"model": DEFAULT_MODEL, "prompt": "Benchmark prompt " * 16, "max_tokens": 4})
RESPONSE = orjson.dumps(
    {
        "model": DEFAULT_MODEL,
        "choices": [{"text": "ok"}],
        "usage": {"prompt_tokens": 70, "completion_tokens": 4, "total_tokens": 74},
    }
)


#: The modes through Envoy, in their order (tracing off first: the base), by key.
MODE_KEYS = ("off", "ours-0.1", "sdk-0.1", "ours-1.0", "sdk-1.0")


@dataclass
class Mode:
    name: str
    epp_args: list[str]
    epp_env: dict[str, str]
    key: str = "off"
    epp_module: str = "app"
    receiver: OtlpReceiver | None = None
    stack: Stack | None = None
    sent: int = 0
    seconds: float = 0.0
    requests: int = 0
    errors: int = 0
    cpu: float = 0.0
    latencies_ms: list[float] = field(default_factory=list)
    round_rps: list[float] = field(default_factory=list)
    round_cpu_per_k: list[float] = field(default_factory=list)
    round_seconds: list[float] = field(default_factory=list)
    round_cpu: list[float] = field(default_factory=list)

    @property
    def rps(self) -> float:
        return self.requests / self.seconds

    @property
    def cpu_per_k(self) -> float:
        return self.cpu / self.requests * 1000

    def percentile(self, q: float) -> float:
        ordered = sorted(self.latencies_ms)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _round(
    mode: Mode, session: aiohttp.ClientSession, total: int, concurrency: int, *, record: bool
) -> None:
    stack = mode.stack
    assert stack is not None
    assert stack.epp is not None
    assert stack.epp.process is not None
    pid = stack.epp.process.pid
    cpu_before = cpu_seconds(pid)
    seconds, latencies, errors = await closed_loop(session, stack.url, BODY, total, concurrency)
    mode.sent += total
    if record:
        cpu = cpu_seconds(pid) - cpu_before
        mode.round_rps.append(total / seconds)
        mode.round_cpu_per_k.append(cpu / total * 1000)
        mode.round_seconds.append(seconds)
        mode.round_cpu.append(cpu)
        mode.cpu += cpu
        mode.seconds += seconds
        mode.requests += total
        mode.errors += errors
        mode.latencies_ms += latencies


async def _cycles(modes: Sequence[Mode], args: argparse.Namespace, cycles: int) -> None:
    """Short rounds, one per mode per cycle, the order alternating: this machine's CPU
    speed drifts (a busy loop's time can halve within seconds), and modes measured close
    together see the same speed."""
    async with contextlib.AsyncExitStack() as sessions:
        opened = [
            await sessions.enter_async_context(
                aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=args.concurrency))
            )
            for _ in modes
        ]
        pairs = list(zip(modes, opened, strict=True))
        for mode, session in pairs:  # warm up connections and code paths
            await _round(mode, session, 300, args.concurrency, record=False)
        for i in range(cycles):
            for mode, session in pairs if i % 2 == 0 else pairs[::-1]:
                await _round(mode, session, args.requests, args.concurrency, record=True)


def _modes(keys: Sequence[str], stack: contextlib.ExitStack) -> list[Mode]:
    """The modes ``keys`` name, each traced one with an OTLP receiver of its own (started
    on ``stack``), so that what each exported is counted apart."""

    def traced(key: str, name: str, ratio: str, module: str) -> Mode:
        receiver = OtlpReceiver(count_only=True).start()
        stack.callback(receiver.stop)
        env = {
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
            "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
            "OTEL_TRACES_SAMPLER_ARG": ratio,
        }
        return Mode(name, [], env, key=key, epp_module=module, receiver=receiver)

    make = {
        "off": lambda: Mode("tracing off", ["--tracing=false"], {}),
        "ours-0.1": lambda: traced("ours-0.1", "ours 0.1 (otlp)", "0.1", "app"),
        "sdk-0.1": lambda: traced("sdk-0.1", "SDK 0.1 (otlp)", "0.1", "tests.bench.sdk_epp"),
        "ours-1.0": lambda: traced("ours-1.0", "ours 1.0 (otlp)", "1.0", "app"),
        "sdk-1.0": lambda: traced("sdk-1.0", "SDK 1.0 (otlp)", "1.0", "tests.bench.sdk_epp"),
    }
    return [make[key]() for key in MODE_KEYS if key in keys]


def _through_envoy(args: argparse.Namespace, modes: list[Mode], blocks: list[range]) -> None:
    """Runs the modes; ``blocks`` receives each block's cycle indices."""
    per_block = max(1, args.rounds // args.blocks)
    for block in range(args.blocks):
        # Fresh processes per block, each mode on another address range each time: a
        # process can run a few percent faster or slower than its twin for its whole life.
        with contextlib.ExitStack() as running:
            for i, mode in enumerate(modes):
                options = StackOptions(
                    simulators=args.simulators,
                    simulator_base_ip=f"127.0.0.{2 + 10 * ((i + block) % len(modes))}",
                    epp_args=mode.epp_args,
                    epp_env=mode.epp_env,
                    epp_module=mode.epp_module,
                    epp_tls=not args.plaintext,
                )
                mode.stack = running.enter_context(Stack.run(options))
            first = len(modes[0].round_seconds)
            asyncio.run(_cycles(modes, args, per_block))
            blocks.append(range(first, len(modes[0].round_seconds)))
    # the EPPs flushed their last spans when they stopped


def _spans_received(mode: Mode) -> str:
    """What ``mode``'s receiver got: spans, traces (SERVER spans), per request sent."""
    receiver = mode.receiver
    if receiver is None:
        return "-"
    traces = receiver.server_spans
    per_trace = receiver.count / traces if traces else 0.0
    return (
        f"{receiver.count} spans in {traces} traces of {mode.sent} requests: "
        f"{receiver.count / mode.sent:.2f} spans per request, {traces / mode.sent:.1%} "
        f"traced, {per_trace:.2f} spans per trace"
    )


class _SdkEncodeOnly(SpanExporter):
    """Encodes spans as the SDK's ``OTLPSpanExporter`` does before sending (the SDK's
    ``encode_spans`` into one ``ExportTraceServiceRequest``, serialized), and drops them."""

    def __init__(self) -> None:
        from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

        self._encode = encode_spans
        self.spans = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self._encode(spans).SerializeToString()
        self.spans += len(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None


class _EncodeOnly:
    """Encodes spans as the OTLP exporter does (on the loop, then the request in the
    export thread), and drops the request instead of sending it."""

    def __init__(self) -> None:
        self._encoder = OtlpEncoder(Resource.create({}), InstrumentationScope(name="bench"))
        self.spans = 0

    def encode(self, spans: Sequence[RecordingSpan]) -> bytes:
        return self._encoder.fragment(spans)

    def export_encoded(self, fragments: Sequence[bytes], count: int) -> bool:
        self._encoder.request(fragments)
        self.spans += count
        return True

    def shutdown(self) -> None:
        return None


def _request_path_cpu(observer: Observer, requests: int, rounds: int) -> list[float]:
    """CPU microseconds per request through the ext_proc servicer and the Director (no
    network): request headers with an ``x-request-id``, the body, response headers and
    body, as Envoy sends them; one value per round, each including the export of its
    spans (flushed at its end)."""
    tracing = observer.tracing if isinstance(observer, EppObserver) else None
    servicer = ExtProcServicer(observed_director(observer), observer)
    messages = [
        request_headers(envoy_headers(("x-request-id", "bench"))),
        request_body(BODY, end_of_stream=True),
        response_headers([(":status", "200"), ("content-type", "application/json")]),
        response_body(RESPONSE, end_of_stream=True),
    ]

    async def run() -> list[float]:
        per_round = []
        for _ in range(rounds):
            started = time.process_time()
            for _ in range(requests):
                await replay(servicer, messages, parse=False)
            if tracing is not None:
                tracing.force_flush()
            per_round.append((time.process_time() - started) / requests * 1e6)
        return per_round

    return asyncio.run(run())


def _in_process(requests: int, *, sdk: bool) -> Mapping[str, float]:
    def traced(ratio: str) -> EppObserver:
        env = {"OTEL_TRACES_SAMPLER_ARG": ratio}
        return EppObserver(PrometheusObserver(), OtelTracing(env, sink=_EncodeOnly()))

    def sdk_traced(ratio: str) -> EppObserver:
        env = {"OTEL_TRACES_SAMPLER_ARG": ratio}
        # EppObserver uses only start_span, force_flush and shutdown of its tracing
        tracing = cast(OtelTracing, SdkTracing(env, exporter=_SdkEncodeOnly()))
        return EppObserver(PrometheusObserver(), tracing)

    observers: dict[str, Observer] = {
        "no observer": NoopObserver(),
        "metrics only": EppObserver(PrometheusObserver()),
        "metrics + tracing 0": traced("0"),
        "metrics + tracing 0.1": traced("0.1"),
        "metrics + tracing 1.0": traced("1.0"),
    }
    if sdk:
        observers |= {
            "metrics + SDK tracing 0": sdk_traced("0"),
            "metrics + SDK tracing 0.1": sdk_traced("0.1"),
            "metrics + SDK tracing 1.0": sdk_traced("1.0"),
        }
    results: dict[str, list[float]] = {name: [] for name in observers}
    for observer in observers.values():  # warm-up
        _request_path_cpu(observer, 300, 1)
    for _ in range(5):  # interleaved, so load changes on the machine hit every mode alike
        for name, observer in observers.items():
            results[name] += _request_path_cpu(observer, requests, 1)
    for observer in observers.values():
        if isinstance(observer, EppObserver) and observer.tracing is not None:
            observer.tracing.shutdown()
    return {name: statistics.median(values) for name, values in results.items()}


def _change(mode: Mode, base: Mode, cycles: Sequence[int], *, cpu: bool) -> float:
    """The change of throughput (or of CPU per request) against ``base`` over ``cycles``:
    each mode's totals over the same cycles."""
    if cpu:
        ours = sum(mode.round_cpu[i] for i in cycles)
        theirs = sum(base.round_cpu[i] for i in cycles)
    else:  # the same requests per round: throughput is inverse to the time taken
        ours = sum(base.round_seconds[i] for i in cycles)
        theirs = sum(mode.round_seconds[i] for i in cycles)
    return ours / theirs - 1


def _summary(mode: Mode, base: Mode, blocks: Sequence[range], *, cpu: bool) -> str:
    """The change over all cycles, a 95% bootstrap interval (cycles resampled within their
    block), the median of the per-cycle changes, and each block's change."""
    rng = random.Random(0)
    everything = [i for block in blocks for i in block]
    resampled = sorted(
        _change(mode, base, [i for b in blocks for i in rng.choices(b, k=len(b))], cpu=cpu)
        for _ in range(2000)
    )
    low, high = resampled[int(0.025 * len(resampled))], resampled[int(0.975 * len(resampled))]
    per_cycle = statistics.median(_change(mode, base, [i], cpu=cpu) for i in everything)
    per_block = ", ".join(f"{_change(mode, base, b, cpu=cpu):+.1%}" for b in blocks)
    return (
        f"{_change(mode, base, everything, cpu=cpu):+.1%} [{low:+.1%}, {high:+.1%}], "
        f"median {per_cycle:+.1%}; blocks {per_block}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--requests", type=int, default=400, help="per mode per round")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--simulators", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=120, help="cycles (a round per mode)")
    parser.add_argument("--blocks", type=int, default=4, help="fresh processes this often")
    parser.add_argument("--plaintext", action="store_true", help="EPP without TLS")
    parser.add_argument("--in-process-requests", type=int, default=2000)
    parser.add_argument(
        "--modes",
        default=",".join(MODE_KEYS),
        help=f"the modes through Envoy, comma-separated, 'off' among them (of {MODE_KEYS})",
    )
    args = parser.parse_args()
    keys = [key.strip() for key in args.modes.split(",") if key.strip()]
    if "off" not in keys or not set(keys) <= set(MODE_KEYS):
        parser.error(f"--modes: 'off' and any of {', '.join(MODE_KEYS[1:])}")
    sdk = otlp_exporter_available()
    if not sdk and any(key.startswith("sdk-") for key in keys):
        sys.exit(f"{INSTALL_HINT}; or leave the SDK out: --modes off,ours-0.1,ours-1.0")

    blocks: list[range] = []
    with contextlib.ExitStack() as receivers:
        modes = _modes(keys, receivers)
        _through_envoy(args, modes, blocks)
    # the receivers stopped after the EPPs (which flushed their last spans when stopped)

    base = modes[0]
    print(
        f"Through Envoy: concurrency {args.concurrency}, {args.requests} requests x "
        f"{args.rounds} rounds per mode in {args.blocks} blocks of fresh processes, "
        f"{args.simulators} simulated servers per stack, "
        f"EPP TLS {'off' if args.plaintext else 'on'}, {os.cpu_count()} CPUs; metrics on in all"
    )
    print(
        f"{'mode':<22}{'req/s':>9}{'vs off':>9}{'median ms':>11}{'p99 ms':>9}"
        f"{'EPP CPU s/1k':>14}{'vs off':>9}{'errors':>8}"
    )
    for mode in modes:
        print(
            f"{mode.name:<22}{mode.rps:>9.0f}{mode.rps / base.rps - 1:>+9.1%}"
            f"{mode.percentile(0.5):>11.2f}{mode.percentile(0.99):>9.2f}"
            f"{mode.cpu_per_k:>14.3f}{mode.cpu_per_k / base.cpu_per_k - 1:>+9.1%}"
            f"{mode.errors:>8}"
        )
    print("spans each mode's OTLP receiver got (requests sent include the warm-up):")
    for mode in modes[1:]:
        print(f"  {mode.name:<22} {_spans_received(mode)}")
    print(
        "change against tracing off over the same cycles: all rounds "
        "[95% bootstrap interval over cycles], median of the per-cycle changes"
    )
    for mode in modes[1:]:
        print(f"  {mode.name:<22} req/s {_summary(mode, base, blocks, cpu=False)}")
        print(f"  {'':<22} EPP CPU per request {_summary(mode, base, blocks, cpu=True)}")
    by_key = {mode.key: mode for mode in modes}
    pairs = [
        (by_key[f"sdk-{ratio}"], by_key[f"ours-{ratio}"])
        for ratio in ("0.1", "1.0")
        if f"sdk-{ratio}" in by_key and f"ours-{ratio}" in by_key
    ]
    if pairs:
        print("the SDK against ours at the same ratio, over the same cycles (as above)")
    for theirs, ours in pairs:
        print(f"  {theirs.name:<22} req/s {_summary(theirs, ours, blocks, cpu=False)}")
        print(f"  {'':<22} EPP CPU per request {_summary(theirs, ours, blocks, cpu=True)}")
    print()
    results = _in_process(args.in_process_requests, sdk=sdk)
    bare = results["no observer"]
    print(
        "In process: CPU per request through the ext_proc servicer and the Director "
        f"(no network), median of 5 interleaved rounds of {args.in_process_requests}"
    )
    for name, micros in results.items():
        print(f"  {name:<27}{micros:>8.1f} us  ({micros - bare:+.1f} us)")


if __name__ == "__main__":
    main()
