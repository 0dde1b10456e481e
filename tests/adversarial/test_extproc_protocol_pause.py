"""A peer that breaks the ext_proc protocol in a loop (issue 12's attack phase c: raw streams
that each carry a second request) gets little of the EPP: after each such stream, the native
transport does not read that connection for a while (``--protocol-error-pause``), while
every other connection, Envoy's, is served as before.

Before: the attacker's four streams at a time on one connection were routed 1,000-1,400
times a second, and normal traffic's p99 through Envoy reached 48-81 ms on a 2-core machine.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from adapters.envoy.extproc import StreamLimits
from adapters.envoy.h2 import connection as h2connection
from tests.adversarial.extproc_support import (
    CountingProcessor,
    director_over,
    extproc_server,
    in_flight,
    open_stream,
    read_all,
)
from tests.support.extproc import completion, envoy_headers, request_body, request_headers

MODEL = "llama"
DEADLINE = 5.0


def _request() -> list[Any]:
    return [request_headers(envoy_headers()), request_body(completion(MODEL), end_of_stream=True)]


@contextlib.asynccontextmanager
async def _served(processor: Any, pause: float) -> AsyncIterator[tuple[Any, ...]]:
    """The native ext_proc server, and two channels to it on connections of their own."""
    limits = StreamLimits(protocol_error_pause=pause)
    async with extproc_server(processor, limits=limits, transport="native") as target:
        own = [("grpc.use_local_subchannel_pool", 1)]
        channels = [grpc.aio.insecure_channel(target, options=own) for _ in range(2)]
        try:
            yield tuple(channels)
        finally:
            for channel in channels:
                await channel.close()


async def _run(channel: grpc.aio.Channel, *messages: Any) -> tuple[list[Any], grpc.StatusCode]:
    call = open_stream(channel)
    for message in messages:
        await call.write(message)
    await call.done_writing()
    replies, code, _ = await read_all(call)
    return replies, code


async def test_a_connection_that_sent_a_second_request_waits_while_envoys_is_routed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(h2connection, "PENALTY_FIRST", 3600.0)  # the pause outlasts the test
    director, datastore = director_over()
    processor = CountingProcessor(director)
    async with _served(processor, pause=3600.0) as (attacker, gateway):
        _, code = await _run(attacker, *_request(), *_request())
        assert code == grpc.StatusCode.FAILED_PRECONDITION
        # the attacker's next stream is not read; the gateway's are routed meanwhile
        waiting = asyncio.ensure_future(_run(attacker, *_request()))
        for _ in range(3):
            replies, code = await asyncio.wait_for(_run(gateway, *_request()), DEADLINE)
            assert code == grpc.StatusCode.OK
            assert [r.WhichOneof("response") for r in replies] == [
                "request_headers",
                "request_body",
            ]
        assert not waiting.done()
        assert len(processor.exchanges) == 4  # the attacker's first request, the gateway's 3
        waiting.cancel()
    await processor.wait_all_closed()
    assert in_flight(datastore) == {}


async def test_the_paused_connection_is_routed_again_once_the_pause_ends() -> None:
    director, _ = director_over()
    processor = CountingProcessor(director)
    async with _served(processor, pause=0.05) as (attacker, _gateway):
        for _ in range(3):  # 10, 20, 40 ms: each within the 50 ms bound
            _, code = await _run(attacker, *_request(), *_request())
            assert code == grpc.StatusCode.FAILED_PRECONDITION
        replies, code = await asyncio.wait_for(_run(attacker, *_request()), DEADLINE)
        assert code == grpc.StatusCode.OK
        assert replies[0].WhichOneof("response") == "request_headers"
    await processor.wait_all_closed()
