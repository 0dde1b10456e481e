"""Benchmark (not a test): what the EPP costs on the request path.

Runs the same simulated model servers behind two Envoys from the shipped config: one
with the EPP as ext_proc, one routing directly (the client sets
``x-gateway-destination-endpoint`` itself, picking an instance at random). Both get the
same closed-loop load at the same concurrency; prints requests/s, median and p99
latency, the EPP/direct ratios, and the EPP's CPU seconds per 1,000 requests.

``--workers 1,2,auto`` runs one pod per worker count instead, each with its own
redis-server, simulators and direct Envoy. All pods are up at once and their rounds take
turns, so that the machine's drifting load falls on each alike; it prints one row per
count: requests/s, latency, EPP CPU per request summed over all the pod's processes, how the
requests split over the workers, the memory of each process, the scrapes per second each
model server received, and the requests/s per core that CPU cost projects; then each
round's CPU per request, and each count's against the first, round by round; then, with
``--stream-requests``, a streamed row per count (in each round the pods' plain loads come
back to back, then their streamed ones).
``--envoy-concurrency N`` gives both Envoys N worker threads, each with its own connections
to the EPP (the default 1 needs a single connection for 32 streams).

Then a streamed row: ``--stream-requests`` completions of ``--stream-tokens`` tokens
(``stream: true`` with usage), through both Envoys, with the EPP's CPU per streamed request
and per SSE chunk. The chunks are the response-body messages Envoy sent the EPP (its
``ext_proc.stream_msgs_sent`` counter, per request, less the non-streamed requests' count);
the CPU per chunk is the streamed request's CPU beyond a non-streamed one's, divided by them.
Both figures are also given net of the EPP's idle CPU (its scrapes and refreshes, measured
for ``--idle-seconds`` with no traffic before the rounds): a streamed round lasts longer
than a non-streamed one of the same size, so more of that background falls into it.

With ``--profile DIR``, py-spy (the ``bench`` extra) samples the EPP during its rounds and
writes collapsed stacks to ``DIR/plain.txt`` and ``DIR/streamed.txt`` (one
``frame;frame;... count`` line per stack; ``--profile-native`` adds native frames). Profiling
slows the EPP: its figures are for where the time goes, not for how much.

    .venv/bin/python -m tests.bench.extproc_overhead [--requests 4000] [--concurrency 32]
    .venv/bin/python -m tests.bench.extproc_overhead --workers 1,2,auto
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import orjson

from app.cpus import usable_cpus
from tests.bench.load import closed_loop, cpu_seconds
from tests.bench.pod import rss_mib, sample_pod
from tests.simulator import DEFAULT_MODEL
from tests.support.redis import RedisServer
from tests.support.stack import Stack, StackOptions, wait_for

BODY = orjson.dumps({"model": DEFAULT_MODEL, "prompt": "Benchmark prompt " * 16, "max_tokens": 4})


def _stream_body(tokens: int) -> bytes:
    return orjson.dumps(
        {
            "model": DEFAULT_MODEL,
            "prompt": "Benchmark prompt " * 16,
            "max_tokens": tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )


@contextlib.contextmanager
def _sampled(pid: int, out: Path | None, native: bool) -> Iterator[None]:
    """py-spy samples ``pid`` while the block runs, appending collapsed stacks to ``out``."""
    if out is None:
        yield
        return
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    part = out.with_suffix(f".{os.getpid()}.{out.stat().st_size if out.exists() else 0}")
    command = [spy, "record", "-p", str(pid), "-r", "250", "-f", "raw", "-o", str(part)]
    if native:
        command.append("--native")
    recorder = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield
    finally:
        recorder.send_signal(signal.SIGINT)
        recorder.wait(timeout=60)
        if part.exists():
            with out.open("a") as sink:
                sink.write(part.read_text())
            part.unlink()


def _messages_to_epp(workdir: Path) -> int:
    """Messages the ext_proc Envoy has sent the EPP so far (its ext_proc stats)."""
    admin = (workdir / "envoy.admin").read_text().strip()
    url = f"http://{admin}/stats?filter=ext_proc.stream_msgs_sent$"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    return sum(int(line.rsplit(":", 1)[1]) for line in text.splitlines() if ":" in line)


@dataclass(frozen=True)
class Result:
    name: str
    requests: int
    seconds: float
    latencies_ms: list[float]
    errors: int
    epp_cpu_seconds: float | None

    @property
    def rps(self) -> float:
        return self.requests / self.seconds

    def percentile(self, q: float) -> float:
        ordered = sorted(self.latencies_ms)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass(frozen=True)
class StreamCost:
    """A streamed request's EPP CPU, and per chunk: what it costs beyond a plain request,
    over the response-body messages it added; each also net of the EPP's idle CPU."""

    per_stream: float
    net_stream: float
    chunks: float
    per_chunk: float
    net_chunk: float


def _stream_cost(
    plain: Result, streamed: Result, messages: dict[str, int], idle_rate: float
) -> StreamCost:
    per_request = (plain.epp_cpu_seconds or 0.0) / plain.requests
    per_stream = (streamed.epp_cpu_seconds or 0.0) / streamed.requests
    net_request = per_request - idle_rate * plain.seconds / plain.requests
    net_stream = per_stream - idle_rate * streamed.seconds / streamed.requests
    chunks = messages["stream"] / streamed.requests - messages["plain"] / plain.requests
    if chunks <= 0:
        return StreamCost(per_stream, net_stream, chunks, 0.0, 0.0)
    return StreamCost(
        per_stream,
        net_stream,
        chunks,
        (per_stream - per_request) / chunks,
        (net_stream - net_request) / chunks,
    )


async def _load(
    url: str, total: int, concurrency: int, destinations: list[str] | None, body: bytes
) -> tuple[float, list[float], int]:
    rng = random.Random(7)

    def headers() -> dict[str, str]:
        sent = {"content-type": "application/json"}
        if destinations:
            sent["x-gateway-destination-endpoint"] = rng.choice(destinations)
        return sent

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        return await closed_loop(session, url, body, total, concurrency, headers)


def _run(
    name: str,
    url: str,
    total: int,
    concurrency: int,
    destinations: list[str] | None,
    epp_pid: int | None,
    body: bytes = BODY,
) -> Result:
    cpu_before = cpu_seconds(epp_pid) if epp_pid else 0.0
    seconds, latencies, errors = asyncio.run(_load(url, total, concurrency, destinations, body))
    cpu = cpu_seconds(epp_pid) - cpu_before if epp_pid else None
    return Result(name, total, seconds, latencies, errors, cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--simulators", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds per mode")
    parser.add_argument("--plaintext", action="store_true", help="EPP without TLS")
    parser.add_argument(
        "--stream-requests", type=int, default=1000, help="streamed requests per round (0: none)"
    )
    parser.add_argument("--stream-tokens", type=int, default=100, help="tokens per stream")
    parser.add_argument(
        "--itl-ms",
        type=float,
        default=2.0,
        help="the simulators' time per output token: streamed tokens arrive one chunk each",
    )
    parser.add_argument("--profile", type=Path, help="directory for py-spy's collapsed stacks")
    parser.add_argument("--profile-native", action="store_true", help="py-spy --native")
    parser.add_argument(
        "--epp-arg",
        action="append",
        default=[],
        help="extra EPP flag, repeatable (e.g. --epp-arg=--tracing=false)",
    )
    parser.add_argument(
        "--idle-seconds", type=float, default=3.0, help="idle CPU measured this long (net figures)"
    )
    parser.add_argument(
        "--envoy-concurrency",
        type=int,
        default=1,
        help="Envoy worker threads (each opens its own connections to the EPP)",
    )
    parser.add_argument(
        "--workers",
        default="",
        help="comma-separated worker counts (e.g. 1,2,auto): one pod per count, each with "
        "its own redis-server (--redis-url), all up at once, their rounds taking turns",
    )
    args = parser.parse_args()
    if args.workers:
        _workers_bench(args)
        return

    options = StackOptions(
        simulators=args.simulators,
        simulator_args=["--itl-ms", str(args.itl_ms)],
        epp_tls=not args.plaintext,
        epp_args=args.epp_arg,
    )
    with Stack.run(options) as stack:
        _, direct_port = stack.start_envoy(ext_proc=False, name="envoy-direct")
        epp_url, direct_url = stack.url, f"http://127.0.0.1:{direct_port}"
        destinations = list(stack.simulator_addresses.values())
        assert stack.epp is not None
        assert stack.epp.process is not None
        epp_pid = stack.epp.process.pid
        # Warm up both paths (connections, code paths).
        _run("warmup", epp_url, 300, args.concurrency, None, None)
        _run("warmup", direct_url, 300, args.concurrency, destinations, None)
        # what the EPP spends with no traffic (scrapes, refreshes): the "net" figures
        idle_started, idle_before = time.monotonic(), cpu_seconds(epp_pid)
        time.sleep(args.idle_seconds)
        idle_rate = (cpu_seconds(epp_pid) - idle_before) / (time.monotonic() - idle_started)
        epp_runs, direct_runs = [], []
        stream_runs, stream_direct_runs = [], []
        messages = {"plain": 0, "stream": 0}
        stream_body = _stream_body(args.stream_tokens)

        def profile(name: str) -> Path | None:
            if args.profile is None:
                return None
            args.profile.mkdir(parents=True, exist_ok=True)
            return Path(args.profile / f"{name}.txt")

        for _ in range(args.rounds):
            before = _messages_to_epp(stack.workdir)
            with _sampled(epp_pid, profile("plain"), args.profile_native):
                epp_runs.append(
                    _run("epp", epp_url, args.requests, args.concurrency, None, epp_pid)
                )
            messages["plain"] += _messages_to_epp(stack.workdir) - before
            direct_runs.append(
                _run("direct", direct_url, args.requests, args.concurrency, destinations, None)
            )
            if args.stream_requests:
                before = _messages_to_epp(stack.workdir)
                with _sampled(epp_pid, profile("streamed"), args.profile_native):
                    stream_runs.append(
                        _run(
                            "epp",
                            epp_url,
                            args.stream_requests,
                            args.concurrency,
                            None,
                            epp_pid,
                            stream_body,
                        )
                    )
                messages["stream"] += _messages_to_epp(stack.workdir) - before
                stream_direct_runs.append(
                    _run(
                        "direct",
                        direct_url,
                        args.stream_requests,
                        args.concurrency,
                        destinations,
                        None,
                        stream_body,
                    )
                )

    def table(epp: Result, direct: Result) -> None:
        print(f"{'':<22}{'EPP':>12}{'direct':>12}{'EPP/direct':>12}")
        print(f"{'requests/s':<22}{epp.rps:>12.0f}{direct.rps:>12.0f}{epp.rps / direct.rps:>12.2f}")
        for label, q in (("median latency ms", 0.5), ("p99 latency ms", 0.99)):
            a, b = epp.percentile(q), direct.percentile(q)
            print(f"{label:<22}{a:>12.2f}{b:>12.2f}{a / b:>12.2f}")
        print(f"{'errors':<22}{epp.errors:>12}{direct.errors:>12}")

    epp, direct = _merged(epp_runs), _merged(direct_runs)
    print(
        f"concurrency {args.concurrency}, {args.requests} requests x {args.rounds} rounds per mode,"
        f" {args.simulators} simulated servers (ITL {args.itl_ms:g} ms),"
        f" EPP TLS {'off' if args.plaintext else 'on'},"
        f" {os.cpu_count()} CPUs, EPP flags {args.epp_arg or 'default'}"
    )
    table(epp, direct)
    assert epp.epp_cpu_seconds is not None
    per_request = epp.epp_cpu_seconds / epp.requests
    net_request = per_request - idle_rate * epp.seconds / epp.requests
    print(f"EPP CPU seconds per 1,000 requests: {per_request * 1000:.3f}")
    print(
        f"  net of the EPP's idle CPU ({idle_rate * 100:.1f}% of a core with no traffic, "
        f"over {args.idle_seconds:g} s before the rounds): {net_request * 1000:.3f}"
    )
    print(
        f"(median of per-request latency over all rounds; stdev EPP "
        f"{statistics.pstdev(epp.latencies_ms):.2f} ms)"
    )
    if stream_runs:
        streamed = _merged(stream_runs)
        print(
            f"streamed, {args.stream_tokens} tokens, {args.stream_requests} requests x"
            f" {args.rounds} rounds per mode"
        )
        table(streamed, _merged(stream_direct_runs))
        cost = _stream_cost(epp, streamed, messages, idle_rate)
        print(f"EPP CPU ms per streamed request: {cost.per_stream * 1000:.3f}")
        print(
            f"EPP messages per request: plain {messages['plain'] / epp.requests:.1f}, "
            f"streamed {messages['stream'] / streamed.requests:.1f}"
        )
        if cost.chunks > 0:
            print(
                f"EPP CPU us per SSE chunk: {cost.per_chunk * 1e6:.1f} "
                f"({cost.chunks:.1f} chunks each)"
            )
            print(f"  net of the EPP's idle CPU: {cost.net_chunk * 1e6:.1f}")


@dataclass(frozen=True)
class PodRow:
    workers: int
    epp: Result
    direct: Result
    split: dict[int, float]
    rss_mib: list[float]
    scrapes_per_second: float
    idle_cpu_per_second: float
    #: each process's CPU seconds over the EPP rounds, and idle (per second), pod order
    cpu_by_process: list[float]
    idle_by_process: list[float]
    #: CPU ms per request of each EPP round, in order
    round_cpu_ms: list[float]
    #: the streamed rounds (none without ``--stream-requests``) and the messages the EPP got
    stream: Result | None
    stream_direct: Result | None
    messages: dict[str, int]


def _merged(runs: list[Result]) -> Result:
    cpu = [r.epp_cpu_seconds for r in runs if r.epp_cpu_seconds is not None]
    return Result(
        runs[0].name,
        sum(r.requests for r in runs),
        sum(r.seconds for r in runs),
        [x for r in runs for x in r.latencies_ms],
        sum(r.errors for r in runs),
        sum(cpu) if cpu else None,
    )


class _Pod:
    """One pod of ``workers`` processes, up with its own Envoys, simulators and redis-server
    for the whole bench, so that the pods' rounds can take turns."""

    def __init__(self, args: argparse.Namespace, workers: int, exits: contextlib.ExitStack):
        self.args, self.workers = args, workers
        redis = RedisServer()
        redis.start()
        exits.callback(redis.stop)
        options = StackOptions(
            simulators=args.simulators,
            simulator_args=["--itl-ms", str(args.itl_ms)],
            epp_tls=not args.plaintext,
            epp_args=[*args.epp_arg, "--redis-url", redis.url, "--workers", str(workers)],
            envoy_concurrency=args.envoy_concurrency,
        )
        stack = exits.enter_context(Stack.run(options))
        assert stack.epp is not None
        assert stack.epp.process is not None
        self.stack, self.pid = stack, stack.epp.process.pid
        self.sims = list(stack.simulator_urls.values())

        def serving() -> bool:
            try:
                sample = sample_pod(self.pid, stack.epp_metrics_port, self.sims)
            except OSError:
                return False
            return len(sample.per_worker) == workers and len(sample.pids) == (
                workers + 1 if workers > 1 else 1
            )

        wait_for(serving, timeout=120, what=f"{workers} worker(s) serving")
        _, direct_port = stack.start_envoy(ext_proc=False, name="envoy-direct")
        self.epp_url, self.direct_url = stack.url, f"http://127.0.0.1:{direct_port}"
        self.destinations = list(stack.simulator_addresses.values())
        self.epp_runs: list[Result] = []
        self.direct_runs: list[Result] = []
        self.stream_runs: list[Result] = []
        self.stream_direct_runs: list[Result] = []
        self.messages = {"plain": 0, "stream": 0}

    def warm_up(self) -> None:
        _run("warmup", self.epp_url, 300, self.args.concurrency, None, None)
        _run("warmup", self.direct_url, 300, self.args.concurrency, self.destinations, None)

    def measure_idle(self) -> None:
        """The pod's CPU with no request: scrapes, relays, shared-load refreshes, gauges.
        From here on, the scrapes are counted (idle included)."""
        self.first = sample_pod(self.pid, self.stack.epp_metrics_port, self.sims)
        self.sampled_at = time.monotonic()
        started = time.monotonic()
        before = [cpu_seconds(p) for p in self.first.pids]
        time.sleep(self.args.idle_seconds)
        seconds = time.monotonic() - started
        self.idle_by_process = [
            (cpu_seconds(p) - b) / seconds for p, b in zip(self.first.pids, before, strict=True)
        ]
        self.by_process = [0.0 for _ in self.first.pids]

    def plain_round(self) -> None:
        args = self.args
        self.epp_runs.append(self._epp_round("plain", args.requests, BODY))
        self.direct_runs.append(
            _run(
                "direct", self.direct_url, args.requests, args.concurrency, self.destinations, None
            )
        )

    def stream_round(self) -> None:
        args = self.args
        if args.stream_requests:
            body = _stream_body(args.stream_tokens)
            self.stream_runs.append(self._epp_round("stream", args.stream_requests, body))
            self.stream_direct_runs.append(
                _run(
                    "direct",
                    self.direct_url,
                    args.stream_requests,
                    args.concurrency,
                    self.destinations,
                    None,
                    body,
                )
            )

    def _epp_round(self, kind: str, requests: int, body: bytes) -> Result:
        """One load through the EPP: its CPU summed over the pod's processes, and the
        messages Envoy sent the EPP added to ``messages[kind]``."""
        messages = _messages_to_epp(self.stack.workdir)
        before = [cpu_seconds(p) for p in self.first.pids]
        run = _run("epp", self.epp_url, requests, self.args.concurrency, None, None, body)
        spent = [cpu_seconds(p) - b for p, b in zip(self.first.pids, before, strict=True)]
        self.messages[kind] += _messages_to_epp(self.stack.workdir) - messages
        if kind == "plain":
            self.by_process = [a + b for a, b in zip(self.by_process, spent, strict=True)]
        return Result(run.name, run.requests, run.seconds, run.latencies_ms, run.errors, sum(spent))

    def row(self) -> PodRow:
        last = sample_pod(self.pid, self.stack.epp_metrics_port, self.sims)
        scrape_seconds = time.monotonic() - self.sampled_at
        first = self.first
        served = {w: last.per_worker.get(w, 0) - n for w, n in first.per_worker.items()}
        total = sum(served.values()) or 1
        scraped = [b - a for a, b in zip(first.scrapes, last.scrapes, strict=True)]
        return PodRow(
            workers=self.workers,
            epp=_merged(self.epp_runs),
            direct=_merged(self.direct_runs),
            split={w: n / total for w, n in sorted(served.items())},
            rss_mib=[rss_mib(p) for p in first.pids],
            scrapes_per_second=statistics.mean(scraped) / scrape_seconds,
            idle_cpu_per_second=sum(self.idle_by_process),
            cpu_by_process=self.by_process,
            idle_by_process=self.idle_by_process,
            round_cpu_ms=[(r.epp_cpu_seconds or 0.0) / r.requests * 1000 for r in self.epp_runs],
            stream=_merged(self.stream_runs) if self.stream_runs else None,
            stream_direct=_merged(self.stream_direct_runs) if self.stream_direct_runs else None,
            messages=dict(self.messages),
        )


def _workers_bench(args: argparse.Namespace) -> None:
    counts: list[int] = []
    for text in args.workers.split(","):
        count = usable_cpus() if text.strip() == "auto" else int(text)
        if count not in counts:
            counts.append(count)
    with contextlib.ExitStack() as exits:
        # Every pod is up for the whole bench, and their rounds take turns (the first pod's
        # round, then the next's, ...; each round's order rotated): the machine's load drifts
        # over minutes, and one pod measured after the other would carry that drift.
        pods = [_Pod(args, count, exits) for count in counts]
        for pod in pods:
            pod.warm_up()
        for pod in pods:
            pod.measure_idle()
        for i in range(args.rounds):
            turn = pods[i % len(pods) :] + pods[: i % len(pods)]
            # the pods' plain rounds back to back, then their streamed ones, so that each
            # pair compared is as close in time as it can be
            for pod in turn:
                pod.plain_round()
            for pod in turn:
                pod.stream_round()
        rows = [pod.row() for pod in pods]
    print(
        f"concurrency {args.concurrency}, Envoy threads {args.envoy_concurrency}, "
        f"{args.requests} requests x {args.rounds} rounds per "
        f"pod and mode, {args.simulators} simulated servers (ITL {args.itl_ms:g} ms), EPP TLS "
        f"{'off' if args.plaintext else 'on'}, --redis-url on, {os.cpu_count()} CPUs (shared "
        f"by Envoy, the simulators, the load and the EPP: throughput cannot scale here), "
        f"EPP flags {args.epp_arg or 'default'}"
    )
    header = (
        f"{'workers':>7}{'EPP r/s':>9}{'direct':>8}{'ratio':>7}{'p50 ms':>8}{'p99 ms':>8}"
        f"{'CPU ms/req':>11}{'net':>7}{'idle %':>7}{'r/s/core':>9}{'errors':>7}  {'split %':<10}"
        f"{'scrapes/s':>10}  RSS MiB (supervisor, workers)"
    )
    print(header)
    for row in rows:
        epp, direct = row.epp, row.direct
        cpu_ms = (epp.epp_cpu_seconds or 0.0) / epp.requests * 1000
        net_ms = cpu_ms - row.idle_cpu_per_second * epp.seconds / epp.requests * 1000
        split = "/".join(f"{share * 100:.0f}" for share in row.split.values())
        rss = ", ".join(f"{m:.0f}" for m in row.rss_mib)
        print(
            f"{row.workers:>7}{epp.rps:>9.0f}{direct.rps:>8.0f}{epp.rps / direct.rps:>7.2f}"
            f"{epp.percentile(0.5):>8.2f}{epp.percentile(0.99):>8.2f}{cpu_ms:>11.3f}"
            f"{net_ms:>7.3f}{row.idle_cpu_per_second * 100:>7.1f}"
            f"{1000 / cpu_ms if cpu_ms else 0:>9.0f}{epp.errors:>7}  {split:<10}"
            f"{row.scrapes_per_second:>10.1f}  {rss}"
        )
    for row in rows:
        rounds = ", ".join(f"{ms:.3f}" for ms in row.round_cpu_ms)
        print(f"{row.workers} worker(s), CPU ms/req by round: {rounds}")
    if len(rows) > 1:
        base = rows[0]
        for row in rows[1:]:
            pairs = [b / a - 1 for a, b in zip(base.round_cpu_ms, row.round_cpu_ms, strict=True)]
            print(
                f"{row.workers} workers against {base.workers}, CPU per request round by round: "
                + ", ".join(f"{p * 100:+.1f}%" for p in pairs)
                + f" (median {statistics.median(pairs) * 100:+.1f}%)"
            )
    for row in rows:
        if len(row.cpu_by_process) > 1:
            by = ", ".join(f"{c / row.epp.requests * 1000:.3f}" for c in row.cpu_by_process)
            idle = ", ".join(f"{c * 100:.1f}" for c in row.idle_by_process)
            print(
                f"{row.workers} workers, by process (supervisor, workers): CPU ms/req {by}; "
                f"idle % {idle}"
            )
    if any(row.stream for row in rows):
        print(
            f"streamed, {args.stream_tokens} tokens, {args.stream_requests} requests x "
            f"{args.rounds} rounds per pod and mode"
        )
        print(
            f"{'workers':>7}{'EPP r/s':>9}{'direct':>8}{'ratio':>7}{'p50 ms':>8}{'p99 ms':>8}"
            f"{'CPU ms/stream':>14}{'net':>7}{'chunks':>8}{'us/chunk':>9}{'net':>7}{'errors':>7}"
        )
    for row in rows:
        if row.stream is None or row.stream_direct is None:
            continue
        stream, direct = row.stream, row.stream_direct
        cost = _stream_cost(row.epp, stream, row.messages, row.idle_cpu_per_second)
        print(
            f"{row.workers:>7}{stream.rps:>9.0f}{direct.rps:>8.0f}{stream.rps / direct.rps:>7.2f}"
            f"{stream.percentile(0.5):>8.2f}{stream.percentile(0.99):>8.2f}"
            f"{cost.per_stream * 1000:>14.3f}{cost.net_stream * 1000:>7.3f}{cost.chunks:>8.1f}"
            f"{cost.per_chunk * 1e6:>9.1f}{cost.net_chunk * 1e6:>7.1f}{stream.errors:>7}"
        )
    print(
        "CPU ms/req: all the pod's processes (supervisor and workers) over the EPP rounds "
        "(the plain ones; CPU ms/stream: the streamed ones); net: less the pod's idle CPU "
        "(idle %: of one core, measured before the rounds) over the same time; r/s/core: "
        "1000 / CPU ms per request, a projection of requests/s per core of the pod, not a "
        "measurement (a streamed round lasts longer per request, so the pod's idle CPU weighs "
        "more on it); split: the requests each worker served over all the pod's rounds; "
        "scrapes/s: GET /metrics per second each model server received; chunks: the "
        "response-body messages Envoy sent the EPP per streamed request beyond a plain "
        "one's, and us/chunk the streamed request's CPU beyond a plain one's over them."
    )


if __name__ == "__main__":
    main()
