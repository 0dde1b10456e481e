"""Attacks under load (not a test, not run by the suite): the hardening findings replayed
against one running stack while normal traffic flows, each for a bounded time.

Starts one stack (``tests.support.stack``): ``--instances`` (3) simulators, two loopback
model servers of this script added with ``--static-endpoints`` (both answer completions and
``/metrics`` like a small healthy vLLM until their attack turns them hostile), the EPP with
its default flags, and Envoy from ``deploy/envoy/envoy.yaml``. Normal traffic (``--concurrency``
8 closed-loop clients of small ``/v1/completions`` through Envoy, each waiting ``--think``
(50ms) after an answer) runs throughout, in a child
process so that the attacks' own work does not slow its clock. Then, in turn, for
``--phase`` (15s) each:

- ``baseline``: nothing;
- ``a1-1mb-model``: requests whose ``model`` is 1 MB long;
- ``a2-5000-models``: 5,000 requests with distinct model names, by 8 clients back to back;
- ``a2-control-one-model``: the same 5,000 requests, all with one model name (not an attack:
  what that much more traffic alone does to normal traffic's latency);
- ``b-hostile-metrics``: one model server answers ``/metrics`` with one-byte chunks, a
  never-ending chunk-size line, or a 1 GiB declared chunk (in turn, per scrape);
- ``c-second-request``: raw ext_proc streams (TLS, straight to the EPP) carrying a second
  request after the first, four at a time on one connection (the EPP stops reading a
  connection for a while after each such stream);
- ``c2-second-request-reconnecting``: the same, each stream on a new connection (a TLS
  handshake each);
- ``d-100mb-body``: chunked 100 MB request bodies through Envoy;
- ``e-100mb-response``: requests the other model server answers with a 100 MB non-streamed
  body (the prompt is the same each time, so the prefix-cache scorer keeps them where the
  first landed; how many reached that server is printed);
- ``f-5000-idle-streams``: 5,000 ext_proc streams opened (request headers sent) and held;
- ``g-gateway-headers``: clients sending ``x-gateway-*`` headers and ``x-envoy-original-dst-host``
  naming one endpoint (how many reached it is printed: about 1/5 when not steered);
- ``h-restart`` (``--restart``): the EPP is SIGTERMed and started again on the same port.

For each phase it prints the normal traffic's answers by status and its client-side latency
p50/p99 (Envoy + the EPP's routing + a model server answering at once), the EPP's own
scheduling time p50/p99 from ``inference_extension_scheduler_e2e_duration_seconds`` (bucket
upper bounds; attack requests that were scheduled count too), the size of the EPP's
``/metrics`` after the phase (bytes and series), the attack's outcomes, the
EPP's peak resident memory (VmHWM after resetting it through ``/proc/<pid>/clear_refs``, and
the highest sampled VmRSS), the CPU seconds the EPP's event-loop thread, the EPP, Envoy and
this script's attack clients used in the phase (on a small machine the attacker's own CPU
competes with the EPP's), the EPP's warning/error log lines, and whether the target (client
p99 < 50 ms, peak RSS < 300 MB) was met. With ``--client-certificates`` the EPP requires
client certificates on its ext_proc port (``--grpc-client-ca-file``, as an operator would
who cannot keep the port private): Envoy presents one, the attackers of (c) and (f) none.

    .venv/bin/python -m tests.bench.attacks [--phase 15s] [--concurrency 8] [--only b,e]
        [--epp-env MALLOC_ARENA_MAX=2] [--client-certificates]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import os
import re
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import orjson
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from app.durations import parse_duration
from tests.simulator import DEFAULT_MODEL
from tests.support.certs import client_pair, write_served_pair
from tests.support.extproc import completion, envoy_headers, request_body, request_headers
from tests.support.stack import Stack, StackOptions, wait_for

__all__ = ["main"]

MIB = 1 << 20
TARGET_P99_MS = 50.0
TARGET_RSS_MIB = 300.0
BIG_MARKER = "BIG-RESPONSE-PLEASE"
HEALTHY_METRICS = (
    b"vllm:num_requests_waiting 0\nvllm:num_requests_running 0\nvllm:kv_cache_usage_perc 0\n"
)
CHUNKED_HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
BLOCK = b"f" * 65_536
_PREFIXES = ["You are a helpful assistant. " * 20, "Translate into French. " * 15, ""]


# --- the script's own model servers -------------------------------------------------------------


@dataclass
class ModelServer:
    """A loopback HTTP/1.1 model server: small completions and healthy ``/metrics`` unless
    ``hostile_metrics`` (then each scrape gets one of three hostile framings) or the prompt
    carries ``BIG_MARKER`` while ``big_responses`` (then a 100 MB non-streamed answer)."""

    name: str
    port: int = 0
    hostile_metrics: bool = False
    big_responses: bool = False
    requests: Counter[str] = field(default_factory=Counter)
    scrapes: Counter[str] = field(default_factory=Counter)
    _server: asyncio.Server | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                request_line, *lines = head.decode("latin-1").split("\r\n")
                headers = {}
                for line in lines:
                    name, _, value = line.partition(":")
                    headers[name.strip().lower()] = value.strip()
                body = await _read_body(reader, headers)
                if request_line.startswith(("POST /__control/", "GET /__control/")):
                    await self._control(writer, request_line.split()[1])
                    continue
                if request_line.startswith("GET /metrics"):
                    if not await self._metrics(writer):
                        return
                    continue
                await self._completion(writer, body, headers)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _control(self, writer: asyncio.StreamWriter, path: str) -> None:
        """``/__control/<flag>/<0|1>`` sets a flag; ``/__control/stats`` reads the counters."""
        parts = path.strip("/").split("/")
        if len(parts) == 3 and parts[1] in ("hostile_metrics", "big_responses"):
            setattr(self, parts[1], parts[2] == "1")
            if parts[1] == "hostile_metrics" and parts[2] == "1":
                self.scrapes.clear()
        answer = orjson.dumps({"requests": self.requests, "scrapes": self.scrapes})
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(answer) + answer)
        await writer.drain()

    async def _metrics(self, writer: asyncio.StreamWriter) -> bool:
        """Answers one scrape; False when the connection must end."""
        if not self.hostile_metrics:
            self.scrapes["healthy"] += 1
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(HEALTHY_METRICS)
                + HEALTHY_METRICS
            )
            await writer.drain()
            return True
        kind = ("one-byte-chunks", "endless-size-line", "1gib-chunk")[
            sum(self.scrapes.values()) % 3
        ]
        self.scrapes[kind] += 1
        if kind == "one-byte-chunks":
            body = HEALTHY_METRICS + b"#" * (94_000 - len(HEALTHY_METRICS) - 1) + b"\n"
            writer.write(CHUNKED_HEAD + b"".join(b"1\r\n%c\r\n" % b for b in body) + b"0\r\n\r\n")
            await writer.drain()
            return True
        writer.write(CHUNKED_HEAD + (b"" if kind == "endless-size-line" else b"40000000\r\n"))
        while self.hostile_metrics:  # until the EPP hangs up, or the attack ends
            writer.write(BLOCK)
            await writer.drain()
        return False

    async def _completion(
        self, writer: asyncio.StreamWriter, body: bytes, headers: dict[str, str]
    ) -> None:
        tag = headers.get("x-attack", "normal")
        if self.big_responses and BIG_MARKER.encode() in body:
            self.requests["100MB answer"] += 1
            total = 100 * MIB
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                % total
            )
            piece = b'{"choices": [{"text": "' + b"x" * (MIB - 25)
            writer.write(piece)
            sent = len(piece)
            filler = b"x" * MIB
            while sent < total - MIB:
                writer.write(filler)
                await writer.drain()
                sent += MIB
            writer.write(b"x" * (total - sent - 4) + b'"}]}')
            await writer.drain()
            return
        self.requests[tag] += 1
        answer = orjson.dumps(
            {
                "id": "cmpl-1",
                "object": "text_completion",
                "model": DEFAULT_MODEL,
                "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5},
            }
        )
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
            b"x-simulator-instance: %s\r\n\r\n" % (len(answer), self.name.encode()) + answer
        )
        await writer.drain()


async def _read_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
    if "content-length" in headers:
        return await reader.readexactly(int(headers["content-length"]))
    if headers.get("transfer-encoding", "").lower() != "chunked":
        return b""
    parts: list[bytes] = []
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        if size == 0:
            while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers, then the end
                pass
            return b"".join(parts)
        parts.append((await reader.readexactly(size + 2))[:-2])


async def _serve_model_servers() -> None:
    """The child process serving both model servers until killed; prints ``ready name addr``."""
    servers = [ModelServer("hostile-metrics"), ModelServer("big-response")]
    for server in servers:
        await server.start()
        print(f"ready {server.name} {server.address}", flush=True)
    await asyncio.Event().wait()


# --- normal traffic, in a child process ---------------------------------------------------------


async def _normal_worker(url: str, out: Path, concurrency: int, limit: float, think: float) -> None:
    """Closed-loop small completions, each client waiting ``think`` s after an answer, until
    killed (or ``limit`` s); one line per answer: monotonic end time, status, latency ms."""
    deadline = time.monotonic() + limit
    timeout = aiohttp.ClientTimeout(total=10)
    n = 0
    with out.open("w", buffering=1) as f:

        async def client(session: aiohttp.ClientSession, i: int) -> None:
            nonlocal n
            while time.monotonic() < deadline:
                n += 1
                body = orjson.dumps(
                    {
                        "model": DEFAULT_MODEL,
                        "prompt": _PREFIXES[n % len(_PREFIXES)] + f"question {n}",
                        "max_tokens": 4,
                    }
                )
                started = time.perf_counter()
                try:
                    async with session.post(
                        f"{url}/v1/completions",
                        data=body,
                        headers={"content-type": "application/json"},
                    ) as response:
                        await response.read()
                        status: str = str(response.status)
                except (aiohttp.ClientError, TimeoutError) as exc:
                    status = type(exc).__name__
                elapsed = (time.perf_counter() - started) * 1000
                f.write(f"{time.monotonic():.4f} {status} {elapsed:.2f}\n")
                await asyncio.sleep(think if status.isdigit() else max(think, 0.05))

        connector = aiohttp.TCPConnector(limit=concurrency)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            await asyncio.gather(*(client(session, i) for i in range(concurrency)))


@dataclass(frozen=True, slots=True)
class _Answer:
    at: float
    status: str
    ms: float


def _answers(path: Path, start: float, end: float) -> list[_Answer]:
    found = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 3 and start <= float(parts[0]) < end:
            found.append(_Answer(float(parts[0]), parts[1], float(parts[2])))
    return found


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# --- reading the EPP: memory, metrics, log ------------------------------------------------------


def _status_kib(pid: int, key: str) -> int:
    with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def _cpu_of(path: str) -> float:
    """User plus system CPU seconds of ``/proc/<path>/stat`` (a process or one thread); 0
    once it is gone."""
    try:
        with open(f"/proc/{path}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cpu_snapshot(stack: Stack) -> dict[str, float]:
    """CPU seconds so far of the EPP (its event-loop thread, and all its threads), Envoy, and
    this process (the attacks' clients); normal traffic runs in a child of its own."""
    assert stack.epp is not None
    assert stack.epp.process is not None
    pid = stack.epp.process.pid
    envoy = stack.envoy.process if stack.envoy is not None else None
    return {
        "EPP event loop": _cpu_of(f"{pid}/task/{pid}"),
        "EPP all threads": _cpu_of(str(pid)),
        "Envoy": _cpu_of(str(envoy.pid)) if envoy is not None else 0.0,
        "attacker (this script)": _cpu_of(str(os.getpid())),
    }


def _reset_hwm(pid: int) -> bool:
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return False
    return True


_BUCKET = re.compile(
    r'^inference_extension_scheduler_e2e_duration_seconds_bucket\{[^}]*le="([^"]+)"[^}]*\} (\S+)$',
    re.MULTILINE,
)


@dataclass(frozen=True, slots=True)
class _Exposition:
    """What the EPP's ``/metrics`` held: the scheduler histogram's buckets, its size."""

    buckets: dict[float, float]
    size: int = 0
    series: int = 0


def _exposition(url: str) -> _Exposition:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            text = response.read().decode()
    except OSError:
        return _Exposition({})
    buckets: dict[float, float] = {}
    for le, count in _BUCKET.findall(text):
        bound = float("inf") if le == "+Inf" else float(le)
        buckets[bound] = buckets.get(bound, 0.0) + float(count)
    series = sum(1 for line in text.splitlines() if line and not line.startswith("#"))
    return _Exposition(buckets, len(text), series)


def _bucket_quantiles(
    before: dict[float, float], after: dict[float, float]
) -> tuple[int, float, float]:
    """Count, p50 and p99 (ms, bucket upper bounds) of the observations between two scrapes."""
    delta = sorted((b, after[b] - before.get(b, 0.0)) for b in after)
    total = delta[-1][1] if delta else 0.0
    if total <= 0:
        return 0, float("nan"), float("nan")

    def quantile(q: float) -> float:
        for bound, cumulative in delta:
            if cumulative >= q * total:
                return bound * 1000
        return float("inf")

    return int(total), quantile(0.5), quantile(0.99)


_LEVEL = re.compile(r"\b(WARNING|ERROR|CRITICAL)\b|\[(warning|error|critical)\]")


def _log_lines(text: str) -> Counter[str]:
    """Warning and error lines, their variable parts (numbers, addresses) blanked."""
    found: Counter[str] = Counter()
    for line in text.splitlines():
        if _LEVEL.search(line[:60]) or line.startswith("Traceback"):
            stem = re.sub(r"\d+(\.\d+)*", "N", line.split(" ", 2)[-1].split("]", 4)[-1])[:150]
            found[stem] += 1
    return found


@dataclass(frozen=True, slots=True)
class RemoteServer:
    """One of the model servers in the child process, driven over ``/__control``."""

    name: str
    address: str

    async def set(self, session: aiohttp.ClientSession, flag: str, on: bool) -> None:
        url = f"http://{self.address}/__control/{flag}/{int(on)}"
        async with session.post(url, timeout=aiohttp.ClientTimeout(total=10)) as response:
            await response.read()

    async def stats(self, session: aiohttp.ClientSession) -> dict[str, dict[str, int]]:
        url = f"http://{self.address}/__control/stats"
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=10)) as response:
            stats: dict[str, dict[str, int]] = orjson.loads(await response.read())
        return stats


# --- the attacks ------------------------------------------------------------------------------


@dataclass
class Attack:
    stack: Stack
    hostile_metrics: RemoteServer
    big_response: RemoteServer
    session: aiohttp.ClientSession
    outcomes: Counter[str] = field(default_factory=Counter)
    notes: list[str] = field(default_factory=list)

    async def post(self, body: bytes, headers: dict[str, str] | None = None) -> None:
        try:
            async with self.session.post(
                f"{self.stack.url}/v1/completions",
                data=body,
                headers={"content-type": "application/json", **(headers or {})},
                timeout=aiohttp.ClientTimeout(total=20),
            ) as response:
                await response.read()
                self.outcomes[str(response.status)] += 1
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.outcomes[type(exc).__name__] += 1

    async def workers(self, n: int, deadline: float, one: Callable[[int], Awaitable[None]]) -> None:
        counter = 0

        async def worker() -> None:
            nonlocal counter
            while time.monotonic() < deadline:
                counter += 1
                await one(counter)

        await asyncio.gather(*(worker() for _ in range(n)))

    # (a)
    async def huge_model_name(self, deadline: float) -> None:
        name = "m" * MIB

        async def one(_: int) -> None:
            await self.post(orjson.dumps({"model": name, "prompt": "hi", "max_tokens": 2}))

        await self.workers(2, deadline, one)

    async def many_model_names(self, deadline: float, distinct: bool = True) -> None:
        async def one(i: int) -> None:
            if i <= 5000:
                model = f"model-{i if distinct else 0:05d}-{'z' * 40}"
                body = {"model": model, "prompt": "hi", "max_tokens": 2}
                await self.post(orjson.dumps(body))
            else:
                await asyncio.sleep(0.1)

        await self.workers(8, deadline, one)
        sent = min(5000, sum(self.outcomes.values()))
        self.notes.append(f"{sent} requests, {'distinct model names' if distinct else 'one model'}")

    async def one_model_name(self, deadline: float) -> None:
        """The control of (a2): the same requests at the same pace, all with one model."""
        await self.many_model_names(deadline, distinct=False)

    # (b)
    async def hostile_scrapes(self, deadline: float) -> None:
        await self.hostile_metrics.set(self.session, "hostile_metrics", True)
        try:
            await asyncio.sleep(max(0.0, deadline - time.monotonic()))
        finally:
            await self.hostile_metrics.set(self.session, "hostile_metrics", False)
        scrapes = (await self.hostile_metrics.stats(self.session))["scrapes"]
        self.outcomes.update({f"scrapes served {k}": v for k, v in scrapes.items()})

    # (c) and (f): raw ext_proc streams, straight to the EPP
    def channel(self, n: int) -> grpc.aio.Channel:
        target = f"127.0.0.1:{self.stack.epp_port}"
        options = [("grpc.ssl_target_name_override", "epp"), ("grpc.use_local_subchannel_pool", 1)]
        options.append(("attack.channel", n))
        if not self.stack.options.epp_tls:
            return grpc.aio.insecure_channel(target, options=options)
        served = _served_certificate(self.stack)
        pem = served or ssl.get_server_certificate(("127.0.0.1", self.stack.epp_port)).encode()
        return grpc.aio.secure_channel(target, grpc.ssl_channel_credentials(pem), options=options)

    async def second_request(self, deadline: float, reconnect: bool = False) -> None:
        """Streams that each carry a valid request and then a second one. ``reconnect``: each
        stream on a connection of its own (a TLS handshake each), so that no connection is
        refused twice."""
        channel = self.channel(0)
        stub = pb_grpc.ExternalProcessorStub(channel)
        request = [
            request_headers(envoy_headers()),
            request_body(completion(DEFAULT_MODEL), end_of_stream=True),
        ]

        async def one(i: int) -> None:
            if reconnect:
                own = self.channel(1000 + i)
                try:
                    await stream(pb_grpc.ExternalProcessorStub(own))
                finally:
                    await own.close()
            else:
                await stream(stub)

        async def stream(stub: pb_grpc.ExternalProcessorStub) -> None:
            call = stub.Process(timeout=10)
            try:
                for message in (*request, *request):
                    await call.write(message)
                await call.done_writing()
                while await call.read() is not grpc.aio.EOF:
                    pass
            except grpc.aio.AioRpcError:
                pass
            except asyncio.InvalidStateError:
                pass
            code = await call.code()
            self.outcomes[f"grpc {code.name}"] += 1
            if code != grpc.StatusCode.FAILED_PRECONDITION and len(self.notes) < 3:
                self.notes.append(f"grpc {code.name}: {(await call.details())[:160]}")

        try:
            await self.workers(32 if reconnect else 4, deadline, one)
        finally:
            await channel.close()

    async def second_request_reconnecting(self, deadline: float) -> None:
        await self.second_request(deadline, reconnect=True)

    async def idle_streams(self, deadline: float) -> None:
        channels = [self.channel(i) for i in range(10)]
        calls: list[Any] = []
        # Not awaited one by one: past the EPP's streams-per-connection limit a stream waits
        # on the client's side until another on its connection ends.
        writes: list[asyncio.Task[None]] = []
        try:
            for i in range(5000):
                call = pb_grpc.ExternalProcessorStub(channels[i % 10]).Process(timeout=120)
                calls.append(call)
                writes.append(asyncio.create_task(call.write(request_headers(envoy_headers()))))
                if i % 100 == 99:
                    await asyncio.sleep(0)
                if time.monotonic() > deadline:
                    break
            await asyncio.sleep(max(0.0, deadline - time.monotonic()))
            opened = sum(1 for w in writes if w.done() and not w.cancelled() and not w.exception())
            self.notes.append(f"{opened} of {len(calls)} streams opened (request headers written)")
            for call in calls:
                if call.done():
                    details = (await call.details() or "")[:60]
                    self.outcomes[f"grpc {(await call.code()).name} {details}"] += 1
                else:
                    self.outcomes["held to the end"] += 1
        finally:
            for call in calls:
                call.cancel()
            for write in writes:
                write.cancel()
            for channel in channels:
                await channel.close()

    # (d)
    async def huge_request_body(self, deadline: float) -> None:
        async def one(_: int) -> None:
            try:
                async with asyncio.timeout(30):
                    status, sent = await self._chunked_upload(100 * MIB)
                self.outcomes[status] += 1
                self.notes.append(f"{sent / MIB:.1f} MiB sent before the answer")
            except (TimeoutError, ConnectionError, asyncio.IncompleteReadError) as exc:
                self.outcomes[type(exc).__name__] += 1

        await self.workers(2, deadline, one)
        if self.notes:
            sizes = sorted(float(n.split()[0]) for n in self.notes)
            self.notes[:] = [f"MiB sent before the answer: min {sizes[0]}, max {sizes[-1]}"]

    async def _chunked_upload(self, total: int) -> tuple[str, int]:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.stack.envoy_port)
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json"
            b"\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        status = asyncio.create_task(reader.readline())
        chunk = b"x" * (256 * 1024)
        sent = 0
        try:
            with contextlib.suppress(ConnectionError):
                while sent < total and not status.done():
                    writer.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
                    await writer.drain()
                    sent += len(chunk)
                if not status.done():
                    writer.write(b"0\r\n\r\n")
            line = await asyncio.wait_for(status, 20)
            return line.decode(errors="replace").strip()[:40] or "(closed)", sent
        finally:
            status.cancel()
            writer.close()

    # (e)
    async def huge_response(self, deadline: float) -> None:
        await self.big_response.set(self.session, "big_responses", True)
        sent_before = (await self.big_response.stats(self.session))["requests"].get(
            "100MB answer", 0
        )
        sizes: Counter[str] = Counter()

        async def one(i: int) -> None:
            # a new prompt each time: no prefix affinity, so about 1 in 5 lands there
            body = orjson.dumps({"model": DEFAULT_MODEL, "prompt": f"{i} {BIG_MARKER}"})
            try:
                async with self.session.post(
                    f"{self.stack.url}/v1/completions",
                    data=body,
                    headers={"content-type": "application/json"},
                    timeout=aiohttp.ClientTimeout(total=60),
                ) as response:
                    size = 0
                    async for piece in response.content.iter_chunked(MIB):
                        size += len(piece)
                    self.outcomes[str(response.status)] += 1
                    sizes["100 MB bodies received" if size >= 100 * MIB else "small"] += 1
            except (aiohttp.ClientError, TimeoutError) as exc:
                self.outcomes[type(exc).__name__] += 1

        try:
            await self.workers(2, deadline, one)
        finally:
            await self.big_response.set(self.session, "big_responses", False)
        sent = (await self.big_response.stats(self.session))["requests"].get("100MB answer", 0)
        self.notes.append(
            f"{sent - sent_before} 100 MB answers sent by the hostile server; "
            f"client got {dict(sizes)}"
        )

    # (g)
    async def gateway_headers(self, deadline: float) -> None:
        target = self.big_response.address
        before = (await self.big_response.stats(self.session))["requests"].get("g", 0)
        headers = {
            "x-attack": "g",
            "x-gateway-destination-endpoint": target,
            "x-envoy-original-dst-host": target,
            "x-gateway-model-name-rewrite": "someone-elses-model",
            "x-gateway-inference-objective": "critical",
            "x-gateway-inference-fairness-id": "me-first",
        }

        async def one(i: int) -> None:
            await self.post(completion(DEFAULT_MODEL, f"hello {i}"), headers)

        await self.workers(4, deadline, one)
        reached = (await self.big_response.stats(self.session))["requests"].get("g", 0) - before
        self.notes.append(
            f"{reached} of {sum(self.outcomes.values())} reached the endpoint the headers named "
            f"(1 of {self.stack.options.simulators + 2} endpoints)"
        )

    # (h)
    async def restart(self, deadline: float) -> None:
        stack = self.stack
        old = stack.epp
        assert old is not None
        started = time.monotonic()
        old.signal(signal.SIGTERM)
        code = await asyncio.to_thread(old.wait, 40)
        self.notes.append(f"old EPP exited {code} after {time.monotonic() - started:.1f}s")
        argv = list(old.argv)
        argv[argv.index("--grpc-port") + 1] = str(stack.epp_port)
        new = stack._spawn("epp-restarted", argv, stack.options.epp_env)
        stack.epp = new
        ports = await asyncio.to_thread(
            wait_for, functools.partial(Stack._ports_of, new), timeout=60, what="the new EPP"
        )
        stack.epps[0] = new
        stack.replica_ports[0] = ports
        stack.epp_port, stack.epp_health_port, stack.epp_metrics_port = ports
        serving = functools.partial(Stack._serving, new, stack.epp_health_port)
        await asyncio.to_thread(wait_for, serving, timeout=60, what="SERVING")
        self.notes.append(f"new EPP serving {time.monotonic() - started:.1f}s after SIGTERM")
        await asyncio.sleep(max(0.0, deadline - time.monotonic()))


# --- the phases -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Phase:
    name: str
    run: Callable[[Attack, float], Awaitable[None]]
    #: what normal traffic may be answered in the phase
    statuses: frozenset[str] = frozenset({"200"})


PHASES = [
    Phase("baseline", lambda a, d: asyncio.sleep(max(0.0, d - time.monotonic()))),
    Phase("a1-1mb-model", Attack.huge_model_name),
    Phase("a2-5000-models", Attack.many_model_names),
    Phase("a2-control-one-model", Attack.one_model_name),
    Phase("b-hostile-metrics", Attack.hostile_scrapes),
    Phase("c-second-request", Attack.second_request),
    Phase("c2-second-request-reconnecting", Attack.second_request_reconnecting),
    Phase("d-100mb-body", Attack.huge_request_body),
    Phase("e-100mb-response", Attack.huge_response),
    Phase("f-5000-idle-streams", Attack.idle_streams),
    Phase("g-gateway-headers", Attack.gateway_headers),
    # while no EPP answers, Envoy answers the retryable 503 (finding 7), never another 5xx
    Phase("h-restart", Attack.restart, frozenset({"200", "503"})),
]


async def _sample_rss(stack: Stack, peak: list[int]) -> None:
    while True:
        if stack.epp is not None and stack.epp.process is not None:
            peak[0] = max(peak[0], _status_kib(stack.epp.process.pid, "VmRSS"))
        await asyncio.sleep(0.1)


async def _run_phase(
    phase: Phase,
    stack: Stack,
    servers: tuple[RemoteServer, RemoteServer],
    session: aiohttp.ClientSession,
    normal_log: Path,
    seconds: float,
) -> bool:
    assert stack.epp is not None
    assert stack.epp.process is not None
    pid = stack.epp.process.pid
    hwm_reset = _reset_hwm(pid)
    log_start = len(stack.epp.log())
    envoy_log_start = len(stack.envoy.log()) if stack.envoy is not None else 0
    before = await asyncio.to_thread(_exposition, stack.epp_metrics_url)
    attack = Attack(stack, servers[0], servers[1], session)
    peak = [0]
    sampler = asyncio.create_task(_sample_rss(stack, peak))
    cpu_before = _cpu_snapshot(stack)
    start = time.monotonic()
    try:
        async with asyncio.timeout(seconds + 60):
            await phase.run(attack, start + seconds)
    except TimeoutError:
        attack.notes.append("the attack did not end within its phase + 60 s")
    except Exception as exc:
        attack.notes.append(f"the attack failed: {exc!r}"[:300])
    end = time.monotonic()
    cpu_after = _cpu_snapshot(stack)
    # the restart phase has a new process: its peak is the new one's
    assert stack.epp.process is not None
    new_pid = stack.epp.process.pid
    hwm = _status_kib(new_pid, "VmHWM") if (hwm_reset or new_pid != pid) else 0
    sampler.cancel()
    after = await asyncio.to_thread(_exposition, stack.epp_metrics_url)
    buckets_before = before.buckets if new_pid == pid else {}
    log = (stack.epp.log()[log_start:] if new_pid == pid else stack.epp.log()) or ""
    answers = _answers(normal_log, start, end)
    statuses = Counter(a.status for a in answers)
    ok = [a.ms for a in answers if a.status == "200"]
    p50, p99 = _percentile(ok, 0.5), _percentile(ok, 0.99)
    scheduled, s50, s99 = _bucket_quantiles(buckets_before, after.buckets)
    peak_mib = max(hwm, peak[0]) / 1024
    met = p99 < TARGET_P99_MS and peak_mib < TARGET_RSS_MIB and set(statuses) <= phase.statuses
    load = os.getloadavg()[0]
    print(f"== {phase.name} ({end - start:.1f} s, load average {load:.2f})", flush=True)
    print(
        f"   normal traffic: {dict(sorted(statuses.items()))}; client latency of the 200s "
        f"p50 {p50:.1f} ms, p99 {p99:.1f} ms"
    )
    print(
        f"   EPP scheduling (histogram, {scheduled} decisions): p50 <= {s50:.2f} ms, "
        f"p99 <= {s99:.2f} ms"
    )
    print(f"   EPP /metrics after the phase: {after.size / 1024:.0f} KiB, {after.series} series")
    if new_pid == pid:
        used = ", ".join(f"{who} {cpu_after[who] - cpu_before[who]:.2f}" for who in cpu_before)
        cores = os.cpu_count() or 1
        print(
            f"   CPU seconds in the phase: {used} (of {cores * (end - start):.1f} on {cores} cores)"
        )
    print(f"   attack: {dict(attack.outcomes)}")
    for note in attack.notes:
        print(f"   attack: {note}")
    print(
        f"   EPP peak RSS: {peak_mib:.1f} MiB (VmHWM {hwm / 1024:.1f}"
        f"{'' if hwm_reset else ', not reset'}, sampled VmRSS {peak[0] / 1024:.1f}); "
        f"RSS now {_status_kib(new_pid, 'VmRSS') / 1024:.1f} MiB"
    )
    envoy_log = stack.envoy.log()[envoy_log_start:] if stack.envoy is not None else ""
    for who, text in (("EPP", log), ("Envoy", envoy_log)):
        lines = _log_lines(text)
        if lines:
            print(f"   {who} log: {sum(lines.values())} warning/error lines:")
            for stem, count in lines.most_common(4):
                print(f"     {count:5d} x {stem}")
    print(
        f"   target (normal traffic {' or '.join(sorted(phase.statuses))}, p99 < "
        f"{TARGET_P99_MS:.0f} ms, peak RSS < "
        f"{TARGET_RSS_MIB:.0f} MB): {'MET' if met else 'NOT MET'}",
        flush=True,
    )
    return met


async def _attacks(
    stack: Stack, servers: tuple[RemoteServer, RemoteServer], normal_log: Path, args: Any
) -> dict[str, bool]:
    results: dict[str, bool] = {}
    await asyncio.sleep(3)  # the normal traffic warms up, not measured
    if args.trace_memory:
        await _memory_snapshot(stack, args.memory_out, "start")
    connector = aiohttp.TCPConnector(limit=64)
    async with aiohttp.ClientSession(connector=connector) as session:
        for phase in PHASES:
            if args.only and not any(phase.name.startswith(o) for o in args.only):
                continue
            if phase.name == "h-restart" and not args.restart:
                continue
            results[phase.name] = await _run_phase(
                phase, stack, servers, session, normal_log, args.phase
            )
            await asyncio.sleep(2)  # settle, not measured
            if args.trace_memory:
                await _memory_snapshot(stack, args.memory_out, phase.name)
        for server in servers:
            stats = await server.stats(session)
            print(f"model server {server.name} ({server.address}): {stats}")
    return results


def _text(path: Path) -> str:
    return path.read_text() if path.exists() else ""


async def _memory_snapshot(stack: Stack, out: Path, after: str) -> None:
    """Has ``tests.bench.traced_epp`` append a snapshot (diff against the first) and prints it."""
    assert stack.epp is not None
    size = len(_text(out))
    stack.epp.signal(signal.SIGUSR1)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        text = _text(out)
        if text[size:].rstrip().endswith("s)"):
            print(f"   tracemalloc after {after}:")
            print("\n".join("   " + line for line in text[size:].rstrip().splitlines()))
            return
    print(f"   tracemalloc after {after}: no snapshot within 60 s")


def _stop(process: subprocess.Popen[Any]) -> None:
    process.terminate()
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(5)


def _served_certificate(stack: Stack) -> bytes | None:
    """The EPP's certificate when the bench gave it one (``--client-certificates``)."""
    args = list(stack.options.epp_args)
    if "--cert-path" not in args:
        return None
    return (Path(args[args.index("--cert-path") + 1]) / "tls.crt").read_bytes()


def _run(args: Any) -> int:
    model_servers = subprocess.Popen(
        [sys.executable, "-m", "tests.bench.attacks", "--model-servers"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert model_servers.stdout is not None
        ready = [model_servers.stdout.readline().split() for _ in range(2)]
        servers = (RemoteServer(*ready[0][1:]), RemoteServer(*ready[1][1:]))
        with tempfile.TemporaryDirectory(prefix="epp-attacks-") as tmp:
            args.memory_out = Path(tmp) / "tracemalloc.txt"
            args.certificates = Path(tmp) / "certificates"
            results = _run_stack(args, servers)
    finally:
        _stop(model_servers)
    print("summary: " + ", ".join(f"{k} {'met' if v else 'NOT MET'}" for k, v in results.items()))
    return 0 if all(results.values()) else 1


def _client_certificates(directory: Path) -> tuple[list[str], tuple[Path, Path]]:
    """The EPP's flags requiring client certificates, and the certificate and key Envoy
    presents (the attackers present none)."""
    write_served_pair(directory)
    ca, certificate, key = client_pair(directory, "gateway")
    return ["--cert-path", str(directory), "--grpc-client-ca-file", str(ca)], (certificate, key)


def _run_stack(args: Any, servers: tuple[RemoteServer, RemoteServer]) -> dict[str, bool]:
    epp_args: list[str] = []
    envoy_certificate = None
    if args.client_certificates:
        epp_args, envoy_certificate = _client_certificates(args.certificates)
    epp_args += args.epp_arg
    options = StackOptions(
        epp_args=epp_args,
        epp_client_certificate=envoy_certificate,
        simulators=args.instances,
        extra_endpoints=[s.address for s in servers],
        epp_module="tests.bench.traced_epp" if args.trace_memory else "app",
        epp_env={
            **dict(item.split("=", 1) for item in args.epp_env),
            **({"EPP_TRACEMALLOC_OUT": str(args.memory_out)} if args.trace_memory else {}),
        },
    )
    with Stack.run(options) as stack:
        assert stack.epp is not None
        assert stack.epp.process is not None
        print(
            f"stack: {args.instances} simulators and 2 model servers of this script "
            f"({', '.join(s.address for s in servers)}), EPP pid {stack.epp.process.pid} "
            f"(RSS {_status_kib(stack.epp.process.pid, 'VmRSS') / 1024:.1f} MiB), Envoy "
            f"{stack.url}; normal traffic: {args.concurrency} clients, "
            f"{args.think * 1000:.0f} ms think time; {args.phase:.0f} s per phase",
            flush=True,
        )
        normal_log = stack.workdir / "normal.log"
        limit = (len(PHASES) + 2) * (args.phase + 70) + 60
        argv = [stack.url, str(normal_log), str(args.concurrency), str(limit), str(args.think)]
        worker = subprocess.Popen(
            [sys.executable, "-m", "tests.bench.attacks", "--normal-worker", *argv],
            stdin=subprocess.DEVNULL,
        )
        try:
            return asyncio.run(_attacks(stack, servers, normal_log, args))
        finally:
            _stop(worker)


def main() -> int:
    if sys.argv[1:] == ["--model-servers"]:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(_serve_model_servers())
        return 0
    if len(sys.argv) == 7 and sys.argv[1] == "--normal-worker":
        url, out, concurrency, limit, think = sys.argv[2:]
        asyncio.run(_normal_worker(url, Path(out), int(concurrency), float(limit), float(think)))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--phase", type=parse_duration, default=parse_duration("15s"))
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--think", type=parse_duration, default=parse_duration("50ms"))
    parser.add_argument("--instances", type=int, default=3)
    parser.add_argument(
        "--trace-memory",
        action="store_true",
        help="run the EPP with tracemalloc (tests.bench.traced_epp) and print what grew "
        "after each phase (slows the EPP down)",
    )
    parser.add_argument("--restart", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument(
        "--client-certificates",
        action="store_true",
        help="the EPP requires client certificates (--grpc-client-ca-file): Envoy presents "
        "one, the raw-stream attackers (c, f) none",
    )
    parser.add_argument(
        "--epp-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="add to the EPP's environment (repeatable), e.g. MALLOC_ARENA_MAX=2",
    )
    parser.add_argument(
        "--epp-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="add to the EPP's flags (repeatable), e.g. --epp-arg=--extproc-transport=grpcio",
    )
    parser.add_argument(
        "--only", type=lambda s: s.split(","), default=None, help="phase name prefixes"
    )
    args = parser.parse_args()
    return _run(args)


if __name__ == "__main__":
    raise SystemExit(main())
