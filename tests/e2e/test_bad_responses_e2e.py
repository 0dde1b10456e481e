"""Responses that go wrong, through a real Envoy with and without response bodies sent to the
EPP (decision 0028): a response that never ends, one SSE event of 10 MB, a model server that
closes the connection in the middle of a chunk. Whatever the response does, the request stops
running in the EPP (its in-flight load and state released) when the response's stream ends,
or at the EPP's ``--stream-idle-timeout`` when it never does.
"""

from __future__ import annotations

import asyncio
import http.client
import threading
import time
from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from tests.e2e.test_model_server_faults import IDLE_METRICS, _read_body
from tests.simulator import DEFAULT_MODEL
from tests.support.stack import Stack, StackOptions, metric_sum, wait_for

pytestmark = pytest.mark.e2e

HOST = "127.0.0.131"
RUNNING = "inference_objective_running_requests"
HUGE = 10 * 1024 * 1024
IDLE_TIMEOUT = 2.0


class BadModelServer:
    """Answers ``/metrics`` as an idle vLLM, and a completion as its prompt says:
    ``never-ends`` (SSE headers and one event, then nothing), ``huge`` (one SSE event of
    10 MB, then ``[DONE]``), ``cut`` (a chunk announced and half sent, then the connection
    closed)."""

    def __init__(self) -> None:
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    def __enter__(self) -> BadModelServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(5)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._serve, HOST, 0)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def _stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for writer in self._writers:
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
                path = head[0].split(" ")[1]
                headers = {
                    k.strip().lower(): v.strip()
                    for k, _, v in (line.partition(":") for line in head[1:] if line)
                }
                body = await _read_body(reader, headers)
                if path == "/metrics":
                    writer.write(
                        b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n"
                        b"Content-Length: %d\r\n\r\n%s" % (len(IDLE_METRICS), IDLE_METRICS)
                    )
                    await writer.drain()
                    continue
                await self._complete(orjson.loads(body)["prompt"], writer)
                return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _complete(self, mode: str, writer: asyncio.StreamWriter) -> None:
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        first = b'data: {"choices":[{"index":0,"text":"a"}]}\n\n'
        writer.write(b"%x\r\n%s\r\n" % (len(first), first))
        await writer.drain()
        if mode == "never-ends":
            await asyncio.Event().wait()  # until the connection is closed
        elif mode == "huge":
            event = b'data: {"choices":[{"index":0,"text":"' + b"x" * HUGE + b'"}]}\n\n'
            done = b"data: [DONE]\n\n"
            writer.write(
                b"%x\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(event), event, len(done), done)
            )
            await writer.drain()
        elif mode == "cut":
            writer.write(b"400\r\n" + b"data: " + b"y" * 200)
            await writer.drain()


def _post(port: int, mode: str, *, timeout: float) -> tuple[int, bytes | Exception]:
    """POSTs a streamed completion whose prompt names the server's mode; the status and the
    body read, or what reading it raised."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        body = orjson.dumps({"model": DEFAULT_MODEL, "prompt": mode, "stream": True})
        connection.request("POST", "/v1/completions", body, {"content-type": "application/json"})
        response = connection.getresponse()
        try:
            return response.status, response.read()
        except (OSError, http.client.HTTPException) as exc:
            return response.status, exc
    finally:
        connection.close()


@pytest.fixture(scope="module")
def stacks() -> Iterator[tuple[Stack, dict[str, int]]]:
    with BadModelServer() as server:
        options = StackOptions(
            simulators=0,
            extra_endpoints=[f"{HOST}:{server.port}"],
            epp_args=["--stream-idle-timeout", f"{IDLE_TIMEOUT:g}s"],
            extproc_faults=True,  # a stream the EPP ends at its idle timeout fails in Envoy
        )
        with Stack.run(options) as stack:
            _, lean = stack.start_envoy(ext_proc=True, name="envoy-lean", response_body=False)
            yield stack, {"bodies": stack.envoy_port, "no-bodies": lean}


def _running(stack: Stack) -> float:
    return metric_sum(stack.epp_metrics_url, RUNNING)


def _released(stack: Stack, within: float) -> None:
    wait_for(lambda: _running(stack) == 0, timeout=within, what="the request to stop running")


MODES = ["bodies", "no-bodies"]


@pytest.mark.parametrize("envoy", MODES)
def test_a_response_that_never_ends_is_released_at_the_idle_timeout(
    stacks: tuple[Stack, dict[str, int]], envoy: str
) -> None:
    stack, ports = stacks
    outcome: list[Any] = []
    client = threading.Thread(
        target=lambda: outcome.append(_post(ports[envoy], "never-ends", timeout=30)), daemon=True
    )
    started = time.monotonic()
    client.start()
    wait_for(lambda: _running(stack) == 1, timeout=10, what="the request to run")
    # the client still waits; the EPP lets the request go after its idle timeout
    _released(stack, within=IDLE_TIMEOUT + 10)
    assert time.monotonic() - started >= IDLE_TIMEOUT
    if envoy == "bodies":
        # Envoy cannot go on without its ext_proc stream: the client's response is cut
        client.join(timeout=30)
        status, body = outcome[0]
        assert status == 200
        assert isinstance(body, Exception)


@pytest.mark.parametrize("envoy", MODES)
def test_an_event_of_10_mb_reaches_the_client_and_the_request_ends(
    stacks: tuple[Stack, dict[str, int]], envoy: str
) -> None:
    stack, ports = stacks
    status, body = _post(ports[envoy], "huge", timeout=60)
    assert status == 200
    assert isinstance(body, bytes)
    assert len(body) > HUGE
    assert body.endswith(b"data: [DONE]\n\n")
    _released(stack, within=10)


@pytest.mark.parametrize("envoy", MODES)
def test_a_server_closing_mid_chunk_ends_the_request(
    stacks: tuple[Stack, dict[str, int]], envoy: str
) -> None:
    stack, ports = stacks
    status, body = _post(ports[envoy], "cut", timeout=30)
    # the client sees the response fail: cut short, or Envoy's 502 when it had not sent the
    # response's headers on yet
    assert status == 502 or isinstance(body, Exception), (status, body)
    _released(stack, within=10)
