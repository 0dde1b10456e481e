"""Finding: behind an Envoy without the ``ext_proc_graceful_grpc_close`` runtime flag (Envoy's
default, and what a gateway whose ext_proc filter is not ours runs: the llm-d router's
standalone chart ships FULL_DUPLEX_STREAMED both ways, trailers SEND, ``message_timeout``
1000s and no runtime layer), clients that hang up truncated other users' responses.

Envoy resets the ext_proc stream of every request whose client went away. The native
transport counted those resets as "rapid reset" abuse, and past 200 on one connection with
resets outnumbering completions it ended the connection with ENHANCE_YOUR_CALM, failing every
call on it: every other response streaming through that connection was cut. A stream reset
after the EPP answered it is not abuse; only resets of streams not yet answered count now,
at a rate, and even then the connection is asked to go away while its calls finish.

Through a real Envoy with the shipped config less that runtime flag: clients that hang up
after the first streamed chunk, hundreds of times, while other clients stream whole
responses; none of theirs is truncated.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Iterator
from urllib.parse import urlsplit

import aiohttp
import orjson
import pytest

from tests.simulator import DEFAULT_MODEL
from tests.support.stack import Stack, StackOptions

pytestmark = pytest.mark.e2e

HANGING_CLIENTS = 12
NORMAL_CLIENTS = 4
HANG_UPS = 400  # twice what the transport used to allow on one connection
NORMAL_RESPONSES = 40
DEADLINE = 120.0


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    options = StackOptions(
        simulators=2,
        # 20 ms a token: a response streams for a while, and a hang-up meets it mid-way
        simulator_args=["--itl-ms", "20"],
        envoy_graceful_close=False,
    )
    with Stack.run(options) as running:
        yield running


def _body(max_tokens: int) -> bytes:
    return orjson.dumps(
        {"model": DEFAULT_MODEL, "prompt": "hello", "max_tokens": max_tokens, "stream": True}
    )


async def _hang_up_after_first_chunk(url: str) -> bool:
    """One streamed request whose client closes its connection once the first chunk is in
    (True if it got that far; False for any other answer)."""
    address = urlsplit(url)
    reader, writer = await asyncio.open_connection(address.hostname, address.port)
    try:
        async with asyncio.timeout(10):
            return await _first_chunk(reader, writer)
    except TimeoutError:
        return False
    finally:
        writer.transport.abort()  # gone without a word, as a client that timed out


async def _first_chunk(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
    body = _body(50)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    received = b""
    while b"data: " not in received:
        chunk = await reader.read(4096)
        if not chunk or (len(received) >= 12 and not received.startswith(b"HTTP/1.1 200")):
            return False
        received += chunk
    return received.startswith(b"HTTP/1.1 200")


async def _whole_response(session: aiohttp.ClientSession, url: str) -> str:
    """A streamed request read to its end: "whole", or what went wrong."""
    try:
        async with session.post(f"{url}/v1/completions", data=_body(20)) as response:
            text = (await response.read()).decode()
    except aiohttp.ClientError as exc:
        return f"truncated: {type(exc).__name__}"
    if response.status != 200:
        return f"status {response.status}"
    return "whole" if text.rstrip().endswith("data: [DONE]") else "truncated: no [DONE]"


async def test_clients_hanging_up_truncate_no_other_response(stack: Stack) -> None:
    hang_ups: Counter[bool] = Counter()
    outcomes: Counter[str] = Counter()
    done = asyncio.Event()

    def enough() -> None:
        if hang_ups[True] >= HANG_UPS and outcomes.total() >= NORMAL_RESPONSES:
            done.set()

    async def hanging_client() -> None:
        while not done.is_set():
            hang_ups[await _hang_up_after_first_chunk(stack.url)] += 1
            enough()

    async def normal_client(session: aiohttp.ClientSession) -> None:
        while not done.is_set():
            outcomes[await _whole_response(session, stack.url)] += 1
            enough()

    async with aiohttp.ClientSession() as session:
        clients = [asyncio.create_task(hanging_client()) for _ in range(HANGING_CLIENTS)]
        clients += [asyncio.create_task(normal_client(session)) for _ in range(NORMAL_CLIENTS)]
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), DEADLINE)
            done.set()
            # each client ends its request in progress (a hang-up within 10 s)
            await asyncio.wait(clients, timeout=30)
        finally:
            for client in clients:
                client.cancel()
    assert hang_ups[True] >= HANG_UPS, f"only {hang_ups} hang-ups in {DEADLINE}s"
    # before: 250-odd hang-ups ended Envoy's ext_proc connection (ENHANCE_YOUR_CALM), and
    # every response streaming through it was cut; after: every one whole
    assert outcomes == Counter(whole=outcomes.total()), outcomes
