"""Finding: idle ext_proc streams opened by a hostile peer on its own connections starved
Envoy's streams (5,000 of them: normal traffic through Envoy saw 503s).

Two things let them: every stream counted against one server-wide limit
(``--max-concurrent-streams``, and gRPC's queue of calls not yet taken by the server, which
cancels every new call past 3,000), and one connection could carry any number of streams.
Now a connection carries at most ``--max-streams-per-connection`` streams (Envoy opens more
connections when its are full), and streams that have not had their request routed are
bounded on their own (``--max-unrouted-streams``): past it the oldest is closed, so held
streams give way to Envoy's, which carry their request at once.

Through the real Envoy with the shipped config, the server-wide limits scaled down: hostile
connections hold more idle streams than the whole server admits, yet concurrent requests
through Envoy (more of them than one connection may carry) all get 200.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import Counter
from collections.abc import Iterator
from typing import Any

import aiohttp
import grpc
import orjson
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from tests.simulator import DEFAULT_MODEL
from tests.support.extproc import envoy_headers, request_headers
from tests.support.stack import Stack, StackOptions

pytestmark = pytest.mark.e2e

MAX_STREAMS = 300
PER_CONNECTION = 100  # the default, and the shipped Envoy's max_concurrent_streams
MAX_UNROUTED = 150  # more than Envoy has unrouted at once here: its requests all come at once
HOSTILE_CONNECTIONS = 4  # x PER_CONNECTION = 400 idle streams, more than the EPP admits
CONCURRENT_REQUESTS = 120  # more than one connection may carry


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    options = StackOptions(
        simulators=1,
        simulator_args=["--itl-ms", "40"],
        epp_args=[
            "--max-concurrent-streams",
            str(MAX_STREAMS),
            "--max-unrouted-streams",
            str(MAX_UNROUTED),
        ],
    )
    with Stack.run(options) as running:
        yield running


def _hostile_channel(stack: Stack, n: int, pem: bytes) -> grpc.aio.Channel:
    """A channel on a connection of its own, straight to the EPP's ext_proc port."""
    return grpc.aio.secure_channel(
        f"127.0.0.1:{stack.epp_port}",
        grpc.ssl_channel_credentials(pem),
        options=[
            ("grpc.ssl_target_name_override", "epp"),
            ("grpc.use_local_subchannel_pool", 1),
            ("hostile.connection", n),
        ],
    )


async def _completion(session: aiohttp.ClientSession, url: str) -> int:
    body = orjson.dumps({"model": DEFAULT_MODEL, "prompt": "hello", "max_tokens": 5})
    async with session.post(f"{url}/v1/completions", data=body) as response:
        await response.read()
        return response.status


async def test_idle_streams_on_other_connections_do_not_keep_envoys_out(stack: Stack) -> None:
    pem = ssl.get_server_certificate(("127.0.0.1", stack.epp_port)).encode()
    channels = [_hostile_channel(stack, n, pem) for n in range(HOSTILE_CONNECTIONS)]
    calls: list[Any] = []
    writes: list[asyncio.Task[None]] = []
    try:
        for channel in channels:
            for _ in range(PER_CONNECTION):
                call = pb_grpc.ExternalProcessorStub(channel).Process(timeout=60)
                calls.append(call)
                writes.append(asyncio.create_task(call.write(request_headers(envoy_headers()))))
        # every hostile stream has reached the EPP (its headers are sent, or it was closed)
        await asyncio.wait_for(asyncio.wait(writes), 30)
        # ... and the EPP has closed the oldest past the unrouted bound (a loaded machine
        # takes a while to close them; until then they still count against the server-wide
        # limit, which is not what this test is about)
        deadline = asyncio.get_running_loop().time() + 30
        while sum(not call.done() for call in calls) > MAX_UNROUTED:
            assert asyncio.get_running_loop().time() < deadline, "idle streams never closed"
            await asyncio.sleep(0.05)
        async with aiohttp.ClientSession() as session:
            statuses = await asyncio.gather(
                *(_completion(session, stack.url) for _ in range(CONCURRENT_REQUESTS))
            )
        # before: the idle streams filled the server and every request was answered 503
        assert Counter(statuses) == {200: CONCURRENT_REQUESTS}

        # the oldest idle streams were closed to make room (the hostile client sees its
        # writes fail); no more than the unrouted limit are still held
        held = [call for call in calls if not call.done()]
        assert len(held) <= MAX_UNROUTED
    finally:
        for call in calls:
            call.cancel()
        for channel in channels:
            await channel.close()
