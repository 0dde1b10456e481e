"""Finding: a 100 MB request body went through the EPP's memory and was routed.

Through the real Envoy: a chunked upload (no Content-Length) larger than
``--max-request-body-bytes`` is answered 413 once the limit is crossed, and the EPP's
resident memory does not grow by the body's size; a body within the limit is routed. With
the default flags, a body just within the default limit (16 MiB) is routed too: Envoy sends
a body in chunks, each its own ext_proc message, far smaller than the default
``--grpc-max-recv-msg-size`` (4 MiB).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import orjson
import pytest

from tests.simulator import DEFAULT_MODEL
from tests.support.stack import Stack, StackOptions

pytestmark = pytest.mark.e2e

MIB = 1 << 20


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    options = StackOptions(simulators=1, epp_args=["--max-request-body-bytes", "1Mi"])
    with Stack.run(options) as running:
        yield running


def _rss_mib(stack: Stack) -> float:
    assert stack.epp is not None
    assert stack.epp.process is not None
    with open(f"/proc/{stack.epp.process.pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


async def _chunked_upload(stack: Stack, total: int) -> tuple[bytes, int]:
    """POSTs ``total`` bytes in chunks until Envoy answers; the status line and the bytes
    sent by then."""
    reader, writer = await asyncio.open_connection("127.0.0.1", stack.envoy_port)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
    )
    status = asyncio.create_task(reader.readline())
    chunk = b"x" * (256 * 1024)
    sent = 0
    try:
        while sent < total and not status.done():
            writer.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
            await writer.drain()
            sent += len(chunk)
        return await asyncio.wait_for(status, 10), sent
    except ConnectionError:
        return await asyncio.wait_for(status, 10), sent
    finally:
        writer.close()


async def test_a_body_beyond_the_limit_is_a_413(stack: Stack) -> None:
    before = _rss_mib(stack)
    status, sent = await _chunked_upload(stack, 100 * MIB)
    # before: the 100 MB were buffered by the EPP and routed; after: 413 near the limit
    assert status.startswith(b"HTTP/1.1 413"), status
    assert sent < 50 * MIB, sent
    assert _rss_mib(stack) - before < 30, (before, _rss_mib(stack))


async def test_a_body_within_the_limit_is_routed(stack: Stack) -> None:
    body = orjson.dumps({"model": DEFAULT_MODEL, "prompt": "x " * 200_000, "max_tokens": 2})
    assert 256 * 1024 < len(body) < MIB
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{stack.url}/v1/completions", data=body) as response,
    ):
        assert response.status == 200, await response.text()


@pytest.fixture(scope="module")
def default_stack() -> Iterator[Stack]:
    with Stack.run(StackOptions(simulators=1)) as running:
        yield running


@pytest.mark.parametrize("upload", ["content-length", "chunked"])
async def test_a_body_just_within_the_default_limit_is_routed(
    default_stack: Stack, upload: str
) -> None:
    # a large body, not a long prompt (the simulated model's context is about 1.6 MiB)
    padding = "y" * (16 * MIB - 1024)
    body = orjson.dumps({"model": DEFAULT_MODEL, "prompt": "hi", "max_tokens": 2, "user": padding})
    assert 4 * MIB < len(body) < 16 * MIB
    data: Any = body
    if upload == "chunked":

        async def chunks() -> AsyncIterator[bytes]:
            for start in range(0, len(body), 4 * MIB):
                yield body[start : start + 4 * MIB]

        data = chunks()
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{default_stack.url}/v1/completions", data=data) as response,
    ):
        # a message limit below what Envoy sends would fail the ext_proc stream: 500 or 503
        assert response.status == 200, await response.text()
