"""Model servers whose ``/metrics`` misbehave, next to healthy ones, through a real Envoy.

``FlakyModelServer`` is a minimal HTTP/1.1 server on its own loopback IP: it answers
completions correctly, and ``/metrics`` according to its mode: ``ok`` (an idle vLLM), or one
of the faults: ``status-500``, ``garbage`` (200 with a body that is not the Prometheus text
format), ``truncated`` (the connection closes halfway through the announced body) and
``hang`` (no answer until the mode changes; the EPP gives up after its 1 s poll timeout).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import orjson
import pytest

from app.config import REFERENCE_DEFAULT_CONFIG_TEXT
from tests.simulator import DEFAULT_MODEL, INSTANCE_HEADER
from tests.support.stack import Stack, StackOptions, trusted_header

pytestmark = pytest.mark.e2e

T = TypeVar("T")

FAULTS = ("status-500", "garbage", "truncated", "hang")
FLAKY_IPS = {
    "status-500": "127.0.0.115",
    "garbage": "127.0.0.116",
    "truncated": "127.0.0.117",
    "hang": "127.0.0.118",
}
SHEDDING_IP = "127.0.0.119"
FRESHNESS_IP = "127.0.0.120"
FRESHNESS_BASE_IP = "127.0.0.121"  # two simulators: .121 and .122
HEALTHY_BASE_IP = "127.0.0.111"  # two simulators: .111 and .112
#: Polls (of /metrics, by the EPP) observed after a log line before counting the lines.
POLLS = 3

DECISION_HEADER = "x-epp-decision"
# Set by the test stack's trusted filter (Envoy strips a client's x-gateway-* headers).
OBJECTIVE_HEADER = trusted_header("x-gateway-inference-objective")

IDLE_METRICS = b"""\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 0.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.0
"""
GARBAGE = b"\x00\xff<html><body>Bad Gateway</body></html>\nvllm:num_requests_waiting{{{oops\n"


class FlakyModelServer:
    """A model server on ``host`` (a free port) with a switchable ``/metrics`` behaviour.

    Runs its own event loop in a thread; use as a context manager. ``mode`` may be changed
    at any time (a hanging ``/metrics`` request is then answered per the new mode).
    ``metrics_requests`` counts the ``/metrics`` requests received.
    """

    def __init__(self, host: str, mode: str) -> None:
        self.host = host
        self.port = 0
        self.metrics_requests = 0
        self._mode = mode
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"flaky {host}", daemon=True
        )
        self._server: asyncio.Server | None = None
        self._changed: asyncio.Event | None = None
        self._closing = False
        self._connections: dict[asyncio.Task[Any], asyncio.StreamWriter] = {}

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def name(self) -> str:
        """What it sends as the simulator's instance header."""
        return f"flaky-{self.host}"

    @property
    def mode(self) -> str:
        return self._mode

    @mode.setter
    def mode(self, mode: str) -> None:
        self._mode = mode
        self._loop.call_soon_threadsafe(self._wake)

    def __enter__(self) -> FlakyModelServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(5)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    async def _start(self) -> None:
        self._changed = asyncio.Event()
        self._server = await asyncio.start_server(self._serve, self.host, 0)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def _stop(self) -> None:
        assert self._server is not None
        self._server.close()
        self._closing = True
        self._wake()
        for writer in self._connections.values():
            writer.close()
        await asyncio.gather(*self._connections, return_exceptions=True)
        await self._server.wait_closed()

    def _wake(self) -> None:
        assert self._changed is not None
        self._changed.set()
        self._changed = asyncio.Event()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections[task] = writer
        try:
            while not self._closing and await self._one(reader, writer):
                pass
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            del self._connections[task]
            writer.close()

    async def _one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Serves one request; whether the connection stays open."""
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        method, path, _ = head[0].split(" ", 2)
        headers = {
            key.strip().lower(): value.strip()
            for key, _, value in (line.partition(":") for line in head[1:] if line)
        }
        body = await _read_body(reader, headers)
        if method == "GET" and path == "/metrics":
            self.metrics_requests += 1
            return await self._metrics(writer)
        if method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
            model = orjson.loads(body).get("model", "")
            answer = {
                "id": "cmpl-flaky",
                "object": "text_completion",
                "created": int(time.time()),
                "model": model,
                "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
            await self._send(writer, 200, orjson.dumps(answer), "application/json")
            return True
        await self._send(writer, 404, b"not found", "text/plain")
        return True

    async def _metrics(self, writer: asyncio.StreamWriter) -> bool:
        while self._mode == "hang":
            assert self._changed is not None
            await self._changed.wait()
            if self._closing:
                return False
        mode = self._mode
        if mode == "ok":
            await self._send(writer, 200, IDLE_METRICS, "text/plain; version=0.0.4")
        elif mode == "status-500":
            await self._send(writer, 500, b"internal error", "text/plain")
        elif mode == "garbage":
            await self._send(writer, 200, GARBAGE, "text/plain; version=0.0.4")
        elif mode == "truncated":
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\n"
                b"Content-Length: %d\r\n\r\n"
                % len(IDLE_METRICS)
                + IDLE_METRICS[: len(IDLE_METRICS) // 2]
            )
            await writer.drain()
            return False
        else:
            raise AssertionError(f"unknown mode {mode!r}")
        return True

    async def _send(
        self, writer: asyncio.StreamWriter, status: int, body: bytes, content_type: str
    ) -> None:
        reason = {200: "OK", 404: "Not Found", 500: "Internal Server Error"}[status]
        writer.write(
            f"HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\n{INSTANCE_HEADER}: {self.name}\r\n\r\n".encode()
            + body
        )
        await writer.drain()


async def _read_body(reader: asyncio.StreamReader, headers: Mapping[str, str]) -> bytes:
    if "chunked" in headers.get("transfer-encoding", "").lower():
        parts: list[bytes] = []
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0].strip(), 16)
            if size == 0:
                await reader.readuntil(b"\r\n")
                return b"".join(parts)
            parts.append(await reader.readexactly(size))
            await reader.readexactly(2)
    return await reader.readexactly(int(headers.get("content-length", "0")))


# -- helpers ---------------------------------------------------------------------------------


async def poll(condition: Callable[[], Awaitable[T | None]], *, within: float, what: str) -> T:
    """Awaits ``condition()`` until it returns something truthy; fails after ``within`` s."""
    deadline = time.monotonic() + within
    while True:
        value = await condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {within}s waiting for {what}"
        await asyncio.sleep(0.02)


@dataclass(frozen=True)
class Reply:
    status: int
    instance: str
    decision: str
    body: bytes

    def scores_of(self, endpoint: str) -> dict[str, float]:
        """The per-scorer scores of ``endpoint`` in the ``x-epp-decision`` header."""
        start = self.decision.index(f"{endpoint}=")
        detail = self.decision[
            self.decision.index("(", start) + 1 : self.decision.index(")", start)
        ]
        return {k: float(v) for k, _, v in (d.partition("=") for d in detail.split())}


async def complete(
    session: aiohttp.ClientSession,
    url: str,
    *,
    headers: Mapping[str, str] | None = None,
    prompt: str = "Hello there",
) -> Reply:
    body = orjson.dumps({"model": DEFAULT_MODEL, "prompt": prompt, "max_tokens": 1})
    async with session.post(
        f"{url}/v1/completions",
        data=body,
        headers=dict(headers or {}),
        timeout=aiohttp.ClientTimeout(total=5),
    ) as response:
        data = await response.read()
        return Reply(
            response.status,
            response.headers.get(INSTANCE_HEADER, ""),
            response.headers.get(DECISION_HEADER, ""),
            data,
        )


@dataclass
class Fleet:
    stack: Stack
    servers: dict[str, FlakyModelServer]

    def log(self) -> str:
        assert self.stack.epp is not None
        return self.stack.epp.log()


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    """Two simulators and one flaky server per fault, in its fault mode from the start."""
    with contextlib.ExitStack() as stack:
        servers = {
            fault: stack.enter_context(FlakyModelServer(FLAKY_IPS[fault], fault))
            for fault in FAULTS
        }
        options = StackOptions(
            simulators=2,
            simulator_base_ip=HEALTHY_BASE_IP,
            extra_endpoints=[s.address for s in servers.values()],
            # the reference's default: its metric scorers give a failing endpoint 0
            epp_args=["--explain-decisions", "--config-text", REFERENCE_DEFAULT_CONFIG_TEXT],
        )
        yield Fleet(stack.enter_context(Stack.run(options)), servers)


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as client:
        yield client


# -- tests -----------------------------------------------------------------------------------


@pytest.mark.parametrize("fault", FAULTS)
async def test_a_failing_metrics_endpoint_is_logged_once_and_recovers(
    fleet: Fleet, session: aiohttp.ClientSession, fault: str
) -> None:
    server = fleet.servers[fault]
    url = fleet.stack.url
    failing = f"endpoint {server.address}: metrics collection failing"
    recovered = f"endpoint {server.address}: metrics collection recovered"

    async def logged(line: str, times: int) -> bool:
        return fleet.log().count(line) >= times

    async def polled_again(count: int) -> None:
        target = server.metrics_requests + count

        async def polled() -> bool:
            return server.metrics_requests >= target

        await poll(polled, within=count * 1.5 + 2, what=f"{count} more polls of {fault}")

    # Failing from the start: one warning, however many polls fail.
    await poll(lambda: logged(failing, 1), within=5, what="the failure to be logged")
    await polled_again(POLLS)
    assert fleet.log().count(failing) == 1
    assert recovered not in fleet.log()

    # The EPP keeps serving; the endpoint it has no metrics for scores 0 and gets nothing.
    replies = [await complete(session, url) for _ in range(20)]
    assert {r.status for r in replies} == {200}
    assert server.name not in {r.instance for r in replies}
    assert replies[-1].scores_of(server.address) == {
        "queue-scorer": 0.0,
        "kv-cache-utilization-scorer": 0.0,
        "prefix-cache-scorer": 0.0,
    }

    # Good metrics again: one recovery line, and it takes its share of the traffic.
    server.mode = "ok"
    await poll(lambda: logged(recovered, 1), within=5, what="the recovery to be logged")
    await polled_again(POLLS)
    assert fleet.log().count(recovered) == 1
    assert fleet.log().count(failing) == 1

    async def served_by_it() -> bool:
        return (await complete(session, url)).instance == server.name

    await poll(served_by_it, within=10, what="the recovered endpoint to get a request")

    # Failing again: one more warning. Its metrics are now stale, yet the reference blend's
    # scorers keep scoring the last snapshot (they do not look at its age).
    server.mode = fault
    await poll(lambda: logged(failing, 2), within=5, what="the new failure to be logged")
    await polled_again(POLLS)
    assert fleet.log().count(failing) == 2
    reply = await complete(session, url)
    assert reply.scores_of(server.address)["queue-scorer"] == 1.0
    assert reply.scores_of(server.address)["kv-cache-utilization-scorer"] == 1.0
    assert fleet.stack.epp is not None
    fleet.stack.epp.check_alive()


async def test_stale_metrics_count_as_saturated_for_sheddable_requests(
    tmp_path: Path, session: aiohttp.ClientSession
) -> None:
    """The saturation detector counts an endpoint without fresh metrics as saturated: with
    only such endpoints, a sheddable request (negative priority) is rejected with 429
    while the others are still served."""
    objectives = tmp_path / "objectives.yaml"
    objectives.write_text(
        """\
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceObjective
metadata: {name: batch}
spec: {priority: -1, poolRef: {name: pool}}
"""
    )
    sheddable = {OBJECTIVE_HEADER: "batch"}
    with FlakyModelServer(SHEDDING_IP, "status-500") as server:
        options = StackOptions(
            simulators=0,
            extra_endpoints=[server.address],
            epp_args=["--static-objectives", str(objectives)],
        )
        with Stack.run(options) as stack:
            url = stack.url
            reply = await complete(session, url, headers=sheddable)
            assert reply.status == 429, reply.body
            assert b"sheddable request dropped" in reply.body
            reply = await complete(session, url)
            assert (reply.status, reply.instance) == (200, server.name)

            server.mode = "ok"

            async def served() -> bool:
                return (await complete(session, url, headers=sheddable)).status == 200

            await poll(served, within=5, what="fresh metrics to admit sheddable requests")

            server.mode = "status-500"

            async def shed() -> bool:
                return (await complete(session, url, headers=sheddable)).status == 429

            await poll(shed, within=5, what="stale metrics to shed sheddable requests")
            reply = await complete(session, url)
            assert (reply.status, reply.instance) == (200, server.name)


def _long_prompt(tag: str) -> str:
    """About 500 tokens that share no prefix block with another tag's."""
    return (f"[{tag}] " + "the cluster routes every request to a warm cache " * 40)[:2000]


async def test_the_default_profile_sends_new_prefixes_away_from_a_failing_metrics_endpoint(
    session: aiohttp.ClientSession,
) -> None:
    """With no config (the default profile), an endpoint whose ``/metrics`` fails gets no
    new prefix while the others have fresh metrics, and gets them again once its scrapes
    succeed; a prefix already sticky to it alone stays on it (its cache is warm)."""
    with FlakyModelServer(FRESHNESS_IP, "ok") as server:
        options = StackOptions(
            simulators=2,
            simulator_base_ip=FRESHNESS_BASE_IP,
            extra_endpoints=[server.address],
            epp_args=["--explain-decisions"],
        )
        with Stack.run(options) as stack:
            url = stack.url
            tags = iter(range(1_000_000))

            async def new_prefix() -> Reply:
                reply = await complete(session, url, prompt=_long_prompt(f"new {next(tags)}"))
                assert reply.status == 200, reply.body
                return reply

            # Healthy: it takes its share of new prefixes; one of them becomes warm there.
            async def warmed() -> str | None:
                prompt = _long_prompt(f"warm {next(tags)}")
                reply = await complete(session, url, prompt=prompt)
                return prompt if reply.instance == server.name else None

            warm = await poll(warmed, within=20, what="a prefix placed on the flaky server")

            # Its /metrics fails: once its metrics are stale (2 s), new prefixes skip it.
            server.mode = "status-500"

            async def skipped() -> bool:
                return f"{server.address}=" not in (await new_prefix()).decision

            await poll(skipped, within=10, what="the failing endpoint to be filtered out")
            replies = [await new_prefix() for _ in range(20)]
            assert server.name not in {r.instance for r in replies}
            assert len({r.instance for r in replies}) == 2  # both healthy ones share them

            # The prefix that was already there stays (sticky), failing scrapes or not.
            for _ in range(3):
                reply = await complete(session, url, prompt=warm)
                assert (reply.status, reply.instance) == (200, server.name), reply.decision

            # Scraped again: it gets new prefixes again.
            server.mode = "ok"

            async def served_new() -> bool:
                return (await new_prefix()).instance == server.name

            await poll(served_new, within=20, what="a new prefix on the recovered endpoint")
