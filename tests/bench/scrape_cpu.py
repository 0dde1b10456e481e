"""Benchmark (not a test): the EPP's CPU cost of scraping 100 model servers every 50 ms.

Runs the EPP's real data layer in a measuring process: a ``Datastore`` with one endpoint per
model server, ``Collectors`` with one ``SourceBinding`` of the ``metrics-data-source``
adapter (its keep-alive HTTP client) and the ``core-metrics-extractor``, polling every
``--interval``. The model servers are lightweight HTTP/1.1 servers on 127.0.0.2, 127.0.0.3,
... in a separate process (their CPU is not counted), each answering ``GET /metrics`` with
the ~11 KB vLLM fixture of the unit tests whose load gauges, LoRA info timestamps and
counters change on every response (the KV usage is a new float every time, as on a loaded
server).

Each variant runs in a fresh process: after ``--warmup`` seconds it measures, over
``--seconds``, the process's CPU time (``time.process_time``) as a fraction of one core,
the achieved poll rate (extractor calls per second; the goal is endpoints / interval), the
CPU spent inside the extractor (timed around each call) and the endpoints in error.

Variants (``--variants``, comma-separated; ``<source>-<loop>``, loop ``uvloop`` or
``asyncio``):

- ``shipped``: the shipped ``metrics-data-source`` (the figure that matters);
- ``minimal``: a prototype in this file, not shipped: one keep-alive HTTP/1.1 connection
  per endpoint on an ``asyncio.Protocol``, a hand-written ``GET`` and a ``Content-Length``
  / chunked reader; it shows what a leaner client would reach;
- ``memory``: no I/O at all, ``poll`` returns a pre-built body: collector scheduling plus
  extraction (``memory-noextract-*``: scheduling alone), to split the total by difference.

A ``-gc-`` in the name (``shipped-gc-uvloop``) tunes the garbage collector first, as the EPP
could at start-up: ``gc.freeze()`` and a youngest-generation threshold of 20,000.

The summary splits the best run of ``shipped-uvloop`` and ``minimal-uvloop`` by difference
with the ``memory`` runs. ``--profile [VARIANT]`` runs VARIANT (``shipped-uvloop``) once more
under py-spy (non-blocking, extractor not timed) and splits its samples into HTTP client,
parsing/extraction, collector scheduling and the event loop's native code. ``--repeat N``
runs every variant N times (the summary keeps the lowest CPU per poll): other processes on
the machine only ever add CPU time (cache misses, slower polls), never remove it.

    .venv/bin/python -m tests.bench.scrape_cpu [--seconds 20] [--repeat 2] [--profile]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import gc
import importlib.util
import ipaddress
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from adapters.prometheus.scrape import MetricsDataSource, MetricsSourceParameters
from domain.datalayer.collector import Collectors, SourceBinding
from domain.datalayer.plugins.core_metrics_extractor import (
    TYPE as EXTRACTOR_TYPE,
)
from domain.datalayer.plugins.core_metrics_extractor import (
    CoreMetricsExtractor,
    CoreMetricsExtractorParameters,
)
from domain.datastore.endpoint import Endpoint
from domain.datastore.store import Datastore
from ports.datalayer import MetricsText, PollingDataSource
from ports.endpoints import EndpointAddress, EndpointEvent, EndpointEventKind, EndpointInfo
from ports.plugins import TypedName
from tests.bench.load import cpu_seconds

FIXTURE = Path(__file__).parents[1] / "unit" / "datalayer" / "fixtures" / "vllm.txt"
HAVE_UVLOOP = importlib.util.find_spec("uvloop") is not None
DEFAULT_VARIANTS = (
    "shipped-uvloop,shipped-asyncio,shipped-gc-uvloop,minimal-uvloop,minimal-asyncio,"
    "minimal-gc-uvloop,memory-uvloop,memory-noextract-uvloop"
)
TARGET_CORE_FRACTION = 0.25
GC_THRESHOLD0 = 20_000


def _new_loop(kind: str) -> asyncio.AbstractEventLoop:
    if kind == "uvloop":
        import uvloop

        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def _run(main: Coroutine[Any, Any, Any], loop_kind: str) -> Any:
    with asyncio.Runner(loop_factory=lambda: _new_loop(loop_kind)) as runner:
        return runner.run(main)


# --- the model servers (separate process) -------------------------------------------------

_SAMPLE_LINE = re.compile(r"^(?P<head>[a-zA-Z_:][^ ]*(?:\{.*\})?) (?P<value>\S+)$")


class _BodyMaker:
    """The vLLM fixture with values that change on every response.

    Running/waiting are small random integers, the KV usage a new random float, the LoRA
    info series carry the current time, and every ``_total``/``_sum``/``_count`` counter
    grows; every other line stays as in the fixture.
    """

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)
        self._static: list[str] = []
        self._dynamic: list[tuple[str, float]] = []  # (kind, base value)
        chunk: list[str] = []
        for line in FIXTURE.read_text().splitlines(keepends=True):
            match = _SAMPLE_LINE.match(line.rstrip("\n"))
            kind = self._kind(match.group("head")) if match else None
            if match is None or kind is None:
                chunk.append(line)
                continue
            chunk.append(match.group("head") + " ")
            self._static.append("".join(chunk))
            chunk = ["\n"]
            self._dynamic.append((kind, float(match.group("value"))))
        self._tail = "".join(chunk)
        self._ticks = 0

    @staticmethod
    def _kind(head: str) -> str | None:
        name = head.split("{", 1)[0]
        if name == "vllm:num_requests_running":
            return "running"
        if name == "vllm:num_requests_waiting":
            return "waiting"
        if name == "vllm:kv_cache_usage_perc":
            return "kv"
        if name == "vllm:lora_requests_info":
            return "time"
        if name.endswith(("_total", "_sum", "_count")):
            return "counter"
        return None

    def body(self) -> bytes:
        self._ticks += 1
        rng = self._rng
        now = time.time()
        parts: list[str] = []
        for static, (kind, base) in zip(self._static, self._dynamic, strict=True):
            parts.append(static)
            if kind == "running":
                parts.append(f"{rng.randint(0, 32)}.0")
            elif kind == "waiting":
                parts.append(f"{rng.randint(0, 8)}.0")
            elif kind == "kv":
                parts.append(repr(rng.random()))
            elif kind == "time":
                parts.append(repr(now - rng.random()))
            else:
                parts.append(repr(base + self._ticks * 3.0))
        parts.append(self._tail)
        return "".join(parts).encode()


class _MetricsServer(asyncio.Protocol):
    """Answers each ``GET`` with a fresh body; keep-alive; pipelining tolerated."""

    def __init__(self, maker: _BodyMaker, counter: list[int]) -> None:
        self._maker = maker
        self._counter = counter
        self._buffer = b""
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        while (end := self._buffer.find(b"\r\n\r\n")) >= 0:
            request, self._buffer = self._buffer[:end], self._buffer[end + 4 :]
            close = b"connection: close" in request.lower()
            body = self._maker.body()
            head = (
                b"HTTP/1.1 200 OK\r\n"
                b"Content-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
                b"Content-Length: %d\r\n\r\n" % len(body)
            )
            assert self._transport is not None
            self._transport.write(head + body)
            self._counter[0] += 1
            if close:
                self._transport.close()
                return


async def _serve(count: int, base_ip: str) -> None:
    loop = asyncio.get_running_loop()
    first = ipaddress.IPv4Address(base_ip)
    counter = [0]
    addresses: list[str] = []
    servers = []
    for i in range(count):
        ip = str(first + i)
        maker = _BodyMaker(seed=i)
        server = await loop.create_server(
            lambda maker=maker: _MetricsServer(maker, counter),  # type: ignore[misc]
            host=ip,
            port=0,
            backlog=64,
        )
        servers.append(server)
        addresses.append(f"{ip}:{server.sockets[0].getsockname()[1]}")
    print("ready " + json.dumps(addresses), flush=True)
    stop = asyncio.Event()
    loop.add_signal_handler(15, stop.set)
    await stop.wait()
    for server in servers:
        server.close()


def start_model_servers(count: int, base_ip: str) -> subprocess.Popen[str]:
    """``count`` model servers in a separate process (this module's ``--serve``), on
    ``base_ip`` and the addresses after it; read them with ``model_server_addresses``."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.bench.scrape_cpu",
            "--serve",
            "--endpoints",
            str(count),
            "--base-ip",
            base_ip,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )


def model_server_addresses(server: subprocess.Popen[str]) -> list[str]:
    """The ``ip:port`` of each model server ``server`` started, once they listen."""
    assert server.stdout is not None
    ready = server.stdout.readline()
    if not ready.startswith("ready "):
        raise SystemExit(f"the model servers did not start: {ready!r}")
    addresses: list[str] = json.loads(ready.removeprefix("ready "))
    return addresses


# --- the prototype client and the in-memory source ------------------------------------------


class _Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection; one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._buffer = bytearray()
        self._waiter: asyncio.Future[tuple[int, bytes]] | None = None
        self._body_start = -1
        self._length = -1  # -1: not known yet; -2: chunked
        self._status = 0
        self._close_after = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(OSError(f"connection lost: {exc or 'closed by peer'}"))

    def request(self, data: bytes) -> asyncio.Future[tuple[int, bytes]]:
        assert self.transport is not None
        self._waiter = asyncio.get_running_loop().create_future()
        self._body_start = -1
        self._length = -1
        self.transport.write(data)
        return self._waiter

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        if self._waiter is None or self._waiter.done():
            return
        buffer = self._buffer
        if self._body_start < 0:
            end = buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            self._parse_head(bytes(buffer[:end]))
            self._body_start = end + 4
        if self._length >= 0:
            stop = self._body_start + self._length
            if len(buffer) < stop:
                return
            body = bytes(buffer[self._body_start : stop])
            del buffer[:stop]
        else:  # chunked: wait for the last chunk, then decode
            if buffer.find(b"\r\n0\r\n\r\n", self._body_start - 2) < 0:
                return
            body, used = _dechunk(buffer, self._body_start)
            del buffer[:used]
        self._waiter.set_result((self._status, body))
        if self._close_after and self.transport is not None:
            self.transport.close()

    def _parse_head(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        self._status = int(lines[0][9:12])
        self._close_after = False
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                self._length = int(value)
            elif name == b"transfer-encoding" and b"chunked" in value.lower():
                self._length = -2
            elif name == b"connection" and value.strip().lower() == b"close":
                self._close_after = True
        if self._length == -1:
            raise OSError("response without Content-Length or chunked encoding")


def _dechunk(buffer: bytearray, start: int) -> tuple[bytes, int]:
    chunks: list[bytes] = []
    pos = start
    while True:
        eol = buffer.index(b"\r\n", pos)
        size = int(bytes(buffer[pos:eol]).split(b";", 1)[0], 16)
        pos = eol + 2
        if size == 0:
            return b"".join(chunks), buffer.index(b"\r\n", pos) + 2
        chunks.append(bytes(buffer[pos : pos + size]))
        pos += size + 2


class MinimalHttpSource:
    """Prototype ``PollingDataSource``: ``GET /metrics`` over one keep-alive connection per
    endpoint (polls of one endpoint are sequential), no TLS, no redirects, no compression."""

    def __init__(self, path: str = "/metrics") -> None:
        self.typed_name = TypedName("minimal-metrics-data-source", "minimal-metrics-data-source")
        self._path = path
        self._connections: dict[str, _Connection] = {}
        self._requests: dict[str, bytes] = {}

    def output_type(self) -> type:
        return MetricsText

    async def poll(self, endpoint: EndpointInfo) -> MetricsText:
        host = endpoint.metrics_host or endpoint.address.host_port()
        connection = self._connections.get(host)
        if connection is None or connection.closed:
            name, _, port = host.rpartition(":")
            _, protocol = await asyncio.get_running_loop().create_connection(
                _Connection, name.strip("[]"), int(port)
            )
            connection = self._connections[host] = protocol
            self._requests[host] = (
                f"GET {self._path} HTTP/1.1\r\nHost: {host}\r\nAccept: */*\r\n\r\n".encode()
            )
        try:
            status, body = await connection.request(self._requests[host])
        except BaseException:
            # the connection's state is unknown (e.g. timed out mid-response): drop it
            if connection.transport is not None:
                connection.transport.close()
            connection.closed = True
            raise
        if status != 200:
            raise ValueError(f"GET http://{host}{self._path}: status {status}")
        return MetricsText(body=body, fetched_at=time.monotonic())

    async def close(self) -> None:
        for connection in self._connections.values():
            if connection.transport is not None:
                connection.transport.close()
        self._connections.clear()


class MemorySource:
    """A ``PollingDataSource`` without I/O: returns pre-built, changing bodies."""

    def __init__(self, bodies: list[bytes]) -> None:
        self.typed_name = TypedName("memory", "memory")
        self._bodies = bodies
        self._next = 0

    def output_type(self) -> type:
        return MetricsText

    async def poll(self, endpoint: EndpointInfo) -> MetricsText:
        self._next = (self._next + 1) % len(self._bodies)
        return MetricsText(body=self._bodies[self._next], fetched_at=time.monotonic())

    async def close(self) -> None:
        return None


class TimedExtractor:
    """Wraps an extractor (or none): counts calls and (if ``timed``) this thread's CPU time
    inside them. Timing costs two ``clock_gettime`` syscalls per call (about 1 µs here)."""

    def __init__(self, inner: CoreMetricsExtractor | None, *, timed: bool = True) -> None:
        self.typed_name = TypedName("timed", "timed")
        self._inner = inner
        self._timed = timed
        self.calls = 0
        self.cpu = 0.0

    def expected_input_type(self) -> type:
        return MetricsText

    def extract(self, data: object, endpoint: Endpoint, now: float) -> None:
        self.calls += 1
        if self._inner is None:
            return
        if not self._timed:
            self._inner.extract(data, endpoint, now)
            return
        start = time.thread_time()
        try:
            self._inner.extract(data, endpoint, now)
        finally:
            self.cpu += time.thread_time() - start


# --- the measuring process --------------------------------------------------------------------


@dataclass(frozen=True)
class Measurement:
    variant: str
    endpoints: int
    seconds: float
    cpu_seconds: float
    system_cpu_seconds: float
    polls: int
    extract_cpu_seconds: float
    endpoints_in_error: int
    sample_error: str | None
    distinct_waiting_values: int

    @property
    def core_fraction(self) -> float:
        return self.cpu_seconds / self.seconds

    @property
    def polls_per_second(self) -> float:
        return self.polls / self.seconds

    @property
    def cpu_us_per_poll(self) -> float:
        return self.cpu_seconds / self.polls * 1e6 if self.polls else float("nan")

    @property
    def extract_us_per_poll(self) -> float:
        return self.extract_cpu_seconds / self.polls * 1e6 if self.polls else float("nan")


async def _measure(
    variant: str,
    addresses: list[str],
    interval: float,
    warmup: float,
    seconds: float,
    steady: Callable[[], None],
    *,
    timed: bool = True,
) -> Measurement:
    source_kind = variant.split("-", 1)[0]
    datastore = Datastore()
    source: PollingDataSource
    if source_kind == "shipped":
        source = MetricsDataSource(
            TypedName("metrics-data-source", "metrics-data-source"), MetricsSourceParameters()
        )
    elif source_kind == "minimal":
        source = MinimalHttpSource()
    elif source_kind == "memory":
        maker = _BodyMaker(seed=0)
        source = MemorySource([maker.body() for _ in range(5000)])
    else:
        raise SystemExit(f"unknown source in variant {variant!r}")
    extractor = CoreMetricsExtractor(
        TypedName(EXTRACTOR_TYPE, EXTRACTOR_TYPE), CoreMetricsExtractorParameters()
    )
    counting = TimedExtractor(None if "noextract" in variant else extractor, timed=timed)
    collectors = Collectors(
        datastore=datastore,
        bindings=[SourceBinding(source, (counting,))],
        interval=interval,
        poll_timeout=1.0,
    )
    for i, address in enumerate(addresses):
        ip, _, port = address.rpartition(":")
        datastore.apply(
            EndpointEvent(
                kind=EndpointEventKind.ADD_OR_UPDATE,
                endpoint=EndpointInfo(
                    name=f"ep-{i}",
                    address=EndpointAddress(ip=ip, port=int(port)),
                    pod_name=f"vllm-{i}",
                    namespace="default",
                ),
            )
        )
    if "-gc-" in variant:
        # what a tuned EPP could do at start-up: keep the start-up heap out of collections
        # and collect the youngest generation less often
        gc.collect()
        gc.freeze()
        gc.set_threshold(GC_THRESHOLD0, 20, 100)
    collectors.start()
    try:
        await asyncio.sleep(warmup)
        steady()
        waiting_seen: set[int] = set()
        cpu0, sys0, wall0 = time.process_time(), os.times().system, time.monotonic()
        polls0, extract0 = counting.calls, counting.cpu
        end = wall0 + seconds
        while (left := end - time.monotonic()) > 0:
            await asyncio.sleep(min(1.0, left))
            waiting_seen.update(
                e.metrics.waiting_queue_size for e in datastore.endpoints() if e.metrics is not None
            )
        cpu1, sys1, wall1 = time.process_time(), os.times().system, time.monotonic()
        polls1, extract1 = counting.calls, counting.cpu
        errors = [
            error
            for e in datastore.endpoints()
            if (error := collectors.error_of(e.name)) is not None
        ]
    finally:
        await collectors.stop()
    return Measurement(
        variant=variant,
        endpoints=len(addresses),
        seconds=wall1 - wall0,
        cpu_seconds=cpu1 - cpu0,
        system_cpu_seconds=sys1 - sys0,
        polls=polls1 - polls0,
        extract_cpu_seconds=extract1 - extract0,
        endpoints_in_error=len(errors),
        sample_error=errors[0] if errors else None,
        distinct_waiting_values=len(waiting_seen),
    )


def _worker(args: argparse.Namespace) -> None:
    addresses = json.loads(Path(args.addresses_file).read_text())
    loop_kind = args.worker.rsplit("-", 1)[1]
    measurement = _run(
        _measure(
            args.worker,
            addresses,
            args.interval,
            args.warmup,
            args.seconds,
            lambda: print("steady", flush=True),
            timed=not args.profiled,
        ),
        loop_kind,
    )
    print("result " + json.dumps(measurement.__dict__), flush=True)


# --- the orchestrator -------------------------------------------------------------------------


def _py_spy() -> str | None:
    candidate = Path(sys.executable).parent / "py-spy"
    return str(candidate) if candidate.exists() else shutil.which("py-spy")


_CATEGORIES = (
    "HTTP client (Python side)",
    "parsing/extraction",
    "collector scheduling (Python side)",
    "event loop native code (I/O syscalls, timers)",
    "other",
)
_HTTP_FRAMES = ("aiohttp/", "yarl/", "multidict/", "scrape.py", "MinimalHttpSource", "_Connection")


def _classify(stack: str) -> str:
    """A py-spy stack (root first, ``;``-separated ``function (file:line)`` frames)."""
    if "core_metrics_extractor.py" in stack or "prometheus_text.py" in stack:
        return "parsing/extraction"
    if any(frame in stack for frame in _HTTP_FRAMES):
        return "HTTP client (Python side)"
    leaf = stack.rsplit(";", 1)[-1]
    if leaf.startswith(("Runner.run ", "BaseEventLoop.run_until_complete ")):
        return "event loop native code (I/O syscalls, timers)"
    if "collector.py" in stack or "asyncio/" in stack:
        return "collector scheduling (Python side)"
    return "other"


def _profile_split(raw_path: Path) -> tuple[dict[str, int], collections.Counter[str]]:
    split = dict.fromkeys(_CATEGORIES, 0)
    leaves: collections.Counter[str] = collections.Counter()
    for line in raw_path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        samples = int(count)
        split[_classify(stack)] += samples
        leaf = stack.rsplit(";", 1)[-1]
        leaves[re.sub(r":\d+\)", ")", leaf)] += samples
    return split, leaves


def _run_variant(
    variant: str,
    args: argparse.Namespace,
    addresses_file: Path,
    server_pid: int,
    profile_to: Path | None = None,
) -> tuple[Measurement, float]:
    """Runs one variant in a fresh process; returns it and the servers' share of a core.

    With ``profile_to``, the extractor is not timed and py-spy (non-blocking, so the
    process is never stopped) records the steady state into that file."""
    command = [
        sys.executable,
        "-m",
        "tests.bench.scrape_cpu",
        "--worker",
        variant,
        "--addresses-file",
        str(addresses_file),
        "--interval",
        str(args.interval),
        "--warmup",
        str(args.warmup),
        "--seconds",
        str(args.seconds),
    ]
    if profile_to is not None:
        command.append("--profiled")
    worker = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    assert worker.stdout is not None
    spy: subprocess.Popen[bytes] | None = None
    result: Measurement | None = None
    server_cpu0 = server_cpu = 0.0
    for line in worker.stdout:
        if line.startswith("steady"):
            server_cpu0 = cpu_seconds(server_pid)
            py_spy = _py_spy()
            if profile_to is not None and py_spy is not None:
                spy = subprocess.Popen(
                    [
                        py_spy,
                        "record",
                        "--nonblocking",
                        "-p",
                        str(worker.pid),
                        "-f",
                        "raw",
                        "-r",
                        "250",
                        "-d",
                        str(max(1, int(args.seconds) - 1)),
                        "-o",
                        str(profile_to),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
        elif line.startswith("result "):
            server_cpu = cpu_seconds(server_pid) - server_cpu0
            result = Measurement(**json.loads(line.removeprefix("result ")))
    if worker.wait() != 0 or result is None:
        raise SystemExit(f"variant {variant} failed (exit {worker.returncode})")
    if spy is not None:
        spy.wait()
    return result, server_cpu / result.seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--endpoints", type=int, default=100)
    parser.add_argument("--interval", type=float, default=0.05, help="seconds between polls")
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--seconds", type=float, default=20.0, help="measured steady state")
    parser.add_argument("--variants", default=DEFAULT_VARIANTS)
    parser.add_argument(
        "--repeat", type=int, default=1, help="runs per variant; the summary uses the best"
    )
    parser.add_argument("--base-ip", default="127.0.0.2")
    parser.add_argument(
        "--profile",
        nargs="?",
        const="shipped-uvloop",
        metavar="VARIANT",
        help="also run VARIANT (default shipped-uvloop) once more under py-spy",
    )
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--profiled", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--addresses-file", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.serve:
        _run(_serve(args.endpoints, args.base_ip), "uvloop" if HAVE_UVLOOP else "asyncio")
        return
    if args.worker:
        _worker(args)
        return

    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not HAVE_UVLOOP:
        print("uvloop is not installed: skipping the uvloop variants")
        variants = [v for v in variants if not v.endswith("-uvloop")]
    server = start_model_servers(args.endpoints, args.base_ip)
    rows: list[Measurement] = []
    profile: Path | None = None
    try:
        addresses = model_server_addresses(server)
        with tempfile.TemporaryDirectory(prefix="scrape-cpu-") as tmp:
            addresses_file = Path(tmp) / "addresses.json"
            addresses_file.write_text(json.dumps(addresses))
            target = args.endpoints / args.interval
            print(
                f"{args.endpoints} model servers ({FIXTURE.stat().st_size:,}-byte vLLM body,"
                f" changing values), poll every {args.interval * 1000:.0f} ms"
                f" (target {target:,.0f} polls/s); {args.warmup:.0f} s warm-up,"
                f" {args.seconds:.0f} s measured per run; {os.cpu_count()} CPUs,"
                f" load average {os.getloadavg()[0]:.1f} at start"
            )
            for variant in variants:
                runs = []
                for _ in range(args.repeat):
                    measurement, server_share = _run_variant(
                        variant, args, addresses_file, server.pid
                    )
                    runs.append(measurement)
                    _print_row(measurement, server_share, target)
                rows.append(min(runs, key=lambda m: m.cpu_us_per_poll))
            if args.profile and _py_spy() is not None:
                recorded = Path(tempfile.gettempdir()) / f"scrape_cpu_{args.profile}.raw"
                measurement, server_share = _run_variant(
                    args.profile, args, addresses_file, server.pid, recorded
                )
                print("  (again under py-spy, extractor not timed:)")
                _print_row(measurement, server_share, target)
                profile = recorded if recorded.exists() else None
    finally:
        server.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(5)
        if server.poll() is None:
            server.kill()
    _print_summary(rows, profile, args.profile, args.endpoints / args.interval)


def _print_row(m: Measurement, server_share: float, target: float) -> None:
    verdict = "ok" if m.core_fraction <= TARGET_CORE_FRACTION else "OVER"
    print(
        f"  {m.variant:<23} {m.core_fraction:6.1%} of a core {verdict:<4}"
        f" (system {m.system_cpu_seconds / m.seconds:5.1%})"
        f"  {m.polls_per_second:6,.0f} polls/s ({m.polls_per_second / target:4.0%})"
        f"  {m.cpu_us_per_poll:4.0f} µs/poll (extract {m.extract_us_per_poll:3.0f})"
        f"  in error {m.endpoints_in_error}  servers {server_share:5.1%}",
        flush=True,
    )
    if m.sample_error:
        print(f"      e.g. {m.sample_error}")


def _print_summary(
    rows: list[Measurement], profile: Path | None, profiled_variant: str | None, target: float
) -> None:
    by_name = {m.variant: m for m in rows}
    print()
    print(f"Target: ≤ {TARGET_CORE_FRACTION:.0%} of one core with the shipped client.")
    if any(m.polls_per_second < 0.95 * target for m in rows):
        print("Some runs fell behind the poll rate: the machine was busy, CPU figures are high.")
    memory = by_name.get("memory-uvloop")
    bare = by_name.get("memory-noextract-uvloop")
    if memory is not None and bare is not None:
        print(
            "Split by difference (µs CPU per poll; % of one core at the measured rate):"
            " scheduling = memory-noextract, extraction = memory minus memory-noextract,"
            " HTTP client = <client> minus memory"
        )
        for name in ("shipped-uvloop", "minimal-uvloop"):
            m = by_name.get(name)
            if m is None:
                continue
            rate = m.polls_per_second / 1e6
            parts = {
                "HTTP client": m.cpu_us_per_poll - memory.cpu_us_per_poll,
                "parsing/extraction": memory.cpu_us_per_poll - bare.cpu_us_per_poll,
                "collector scheduling": bare.cpu_us_per_poll,
            }
            text = ", ".join(f"{k} {v:.0f} µs ({v * rate:.1%})" for k, v in parts.items())
            print(f"  {name}: total {m.cpu_us_per_poll:.0f} µs ({m.core_fraction:.1%}) = {text}")
    if profile is None:
        return
    split, leaves = _profile_split(profile)
    total = sum(split.values()) or 1
    print(f"\npy-spy samples of {profiled_variant} ({profile}, non-idle samples only):")
    for category in _CATEGORIES:
        print(f"  {category:<46} {split[category] / total:6.1%}")
    print("  hottest leaf frames:")
    for leaf, count in leaves.most_common(12):
        print(f"    {count / total:6.1%}  {leaf}")


if __name__ == "__main__":
    main()
