"""Finding: clients got 500 instead of a retryable 503 while the EPP drained or restarted.

Through the real Envoy with the shipped config: a request arriving while the EPP drains
(after SIGTERM, with a request still in flight) or after it has exited is answered 503
(``status_on_error`` of the ext_proc filter), while the in-flight request still completes.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator

import aiohttp
import pytest

from tests.support.stack import Stack, StackOptions

pytestmark = pytest.mark.e2e

_SERVING = 1  # grpc.health.v1 HealthCheckResponse.SERVING


class _HeldModelServer:
    """A model server on loopback that answers completions with an event stream whose end
    waits for ``release``, and ``/metrics`` with nothing."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.port = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                await reader.readexactly(length)
                if b" /metrics " in head.split(b"\r\n", 1)[0]:
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
                    await writer.drain()
                    continue
                event = b'data: {"choices": [{"text": "hi"}]}\n\n'
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                    b"Transfer-Encoding: chunked\r\n\r\n"
                    + f"{len(event):x}\r\n".encode()
                    + event
                    + b"\r\n"
                )
                await writer.drain()
                await self.release.wait()
                done = b"data: [DONE]\n\n"
                writer.write(f"{len(done):x}\r\n".encode() + done + b"\r\n0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@contextlib.asynccontextmanager
async def _stack(model_server: _HeldModelServer) -> AsyncIterator[Stack]:
    server = await asyncio.start_server(model_server.handle, "127.0.0.1", 0)
    model_server.port = server.sockets[0].getsockname()[1]
    running = Stack.run(
        StackOptions(
            simulators=0,
            extra_endpoints=[f"127.0.0.1:{model_server.port}"],
            extproc_faults=True,  # the EPP goes away under open streams, on purpose
        )
    )
    stack = await asyncio.to_thread(running.__enter__)
    try:
        yield stack
    finally:
        model_server.release.set()
        await asyncio.to_thread(running.__exit__, None, None, None)
        server.close()


async def _status(session: aiohttp.ClientSession, stack: Stack) -> int:
    async with session.post(
        f"{stack.url}/v1/completions", json={"model": "m", "prompt": "p", "stream": True}
    ) as response:
        await response.read()
        return response.status


async def _until(condition: object, within: float, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not await asyncio.to_thread(condition):  # type: ignore[arg-type]
        if loop.time() > deadline:
            raise AssertionError(f"not within {within}s: {what}")
        await asyncio.sleep(0.02)


async def test_a_draining_or_stopped_epp_gives_a_retryable_503() -> None:
    model_server = _HeldModelServer()
    async with _stack(model_server) as stack, aiohttp.ClientSession() as session:
        assert stack.epp is not None
        # In flight: its response headers went through the EPP, its end is held.
        held = await session.post(
            f"{stack.url}/v1/completions", json={"model": "m", "prompt": "p", "stream": True}
        )
        assert held.status == 200

        stack.epp.signal(signal.SIGTERM)
        await _until(lambda: stack.epp_readiness() != _SERVING, 10, "the EPP to drain")
        # before: 500; after: 503, which a client may retry
        assert await _status(session, stack) == 503
        assert stack.epp.process is not None
        assert stack.epp.process.poll() is None  # still draining: the held request is open

        model_server.release.set()
        assert (await held.read()).endswith(b"data: [DONE]\n\n")  # it finished in the drain
        held.release()
        code = await asyncio.to_thread(stack.epp.wait, 15)
        assert code == 0
        # the EPP is gone (a restart): before 500, after 503
        assert await _status(session, stack) == 503
