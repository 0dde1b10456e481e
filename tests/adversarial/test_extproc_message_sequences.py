"""Finding 4, as a property: whatever ext_proc messages a gateway sends on its streams, in
any order, repeated, on several streams at once, cancelled at any point, every exchange
the adapter opens is closed exactly once, and the Director's running count, per-request
state and the in-flight load per endpoint all return to zero.

The real grpc.aio servicer runs in process on loopback; the Director is the real one with
``concurrency-detector`` (one request per endpoint), so a leak would also show as 429s.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adapters.envoy.extproc import StreamLimits
from tests.adversarial.extproc_support import (
    CountingProcessor,
    director_over,
    extproc_channel,
    in_flight,
    open_stream,
    read_all,
)
from tests.support.extproc import (
    completion,
    envoy_headers,
    request_body,
    request_headers,
    request_trailers,
    response_body,
    response_headers,
    response_trailers,
)

pytestmark = pytest.mark.usefixtures("each_transport")

MODEL = "llama"
BODY = completion(MODEL, prompt="hello " * 20)
CANCEL = "cancel"


def _bad_headers() -> Any:
    headers = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key="x-a\r\nb", raw_value=b"1")])
    return pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=headers))


def _metadata_only() -> Any:
    message = pb.ProcessingRequest()
    message.metadata_context.filter_metadata["envoy.lb.subset_hint"].update(
        {"x-gateway-destination-endpoint-subset": ["10.0.0.1:8000"]}
    )
    return message


#: message makers by name (what the generated sequences are made of)
MESSAGES: dict[str, Any] = {
    "request_headers": lambda: request_headers(envoy_headers()),
    "request_headers_eos": lambda: request_headers(envoy_headers(), end_of_stream=True),
    "request_headers_bad": _bad_headers,
    "request_body_part": lambda: request_body(BODY[:20], end_of_stream=False),
    "request_body_end": lambda: request_body(BODY[20:], end_of_stream=True),
    "request_body_whole": lambda: request_body(BODY, end_of_stream=True),
    "request_trailers": lambda: request_trailers([("x-t", "1")]),
    "response_headers_json": lambda: response_headers(
        [(":status", "200"), ("content-type", "application/json")]
    ),
    "response_headers_sse": lambda: response_headers(
        [(":status", "200"), ("content-type", "text/event-stream")]
    ),
    "response_headers_eos": lambda: response_headers([(":status", "204")], end_of_stream=True),
    "response_body_part": lambda: response_body(b'data: {"a":1}\n\n', end_of_stream=False),
    "response_body_end": lambda: response_body(
        b'{"usage":{"prompt_tokens":3,"completion_tokens":2}}', end_of_stream=True
    ),
    "response_trailers": lambda: response_trailers([("x-t", "1")]),
    "metadata_only": _metadata_only,
}

#: the sequences Envoy itself sends, so the generator starts from (and shrinks to) them
PROTOCOL = [
    "request_headers",
    "request_body_part",
    "request_body_end",
    "response_headers_sse",
    "response_body_part",
    "response_body_end",
]

step = st.sampled_from([*MESSAGES, CANCEL])
stream_script = st.one_of(
    st.lists(step, max_size=10),
    # a well-formed exchange with something inserted, repeated or cut short
    st.tuples(st.integers(0, len(PROTOCOL)), st.lists(step, max_size=4), st.booleans()).map(
        lambda t: PROTOCOL[: t[0]] + t[1] + (PROTOCOL[t[0] :] if t[2] else [])
    ),
)


@dataclass(slots=True)
class Outcome:
    code: grpc.StatusCode | None
    replies: int


async def _drive(channel: grpc.aio.Channel, script: list[str]) -> Outcome:
    call = open_stream(channel)
    reader = asyncio.ensure_future(read_all(call))
    cancelled = False
    for name in script:
        if name == CANCEL:
            call.cancel()
            cancelled = True
            break
        if reader.done():
            break  # the server ended the stream
        try:
            await call.write(MESSAGES[name]())
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
            break
        await asyncio.sleep(0)  # let replies interleave with writes
    if not cancelled:
        with contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError):
            await call.done_writing()
    try:
        async with asyncio.timeout(10):
            replies, code, _ = await reader
    except (grpc.aio.AioRpcError, asyncio.CancelledError):
        return Outcome(None, 0)
    return Outcome(code, len(replies))


def test_every_exchange_is_closed_once_whatever_the_message_sequence() -> None:
    with asyncio.Runner() as runner:
        processor = CountingProcessor(runner.run(_director())[0])
        # the sequences break the protocol on purpose, on one connection: not paused for it
        limits = StreamLimits(protocol_error_pause=0)
        server = runner.run(_enter(extproc_channel(processor, limits=limits)))
        channel, stack = server
        try:

            @settings(
                max_examples=150,
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow],
            )
            @given(scripts=st.lists(stream_script, min_size=1, max_size=3))
            def run(scripts: list[list[str]]) -> None:
                runner.run(_example(channel, processor, scripts))

            run()
        finally:
            runner.run(stack.aclose())


async def _director() -> Any:
    return director_over()  # on the loop: the Director's asyncio parts bind to it


async def _enter(manager: Any) -> tuple[grpc.aio.Channel, contextlib.AsyncExitStack]:
    stack = contextlib.AsyncExitStack()
    channel = await stack.enter_async_context(manager)
    return channel, stack


async def _example(
    channel: grpc.aio.Channel,
    processor: CountingProcessor,
    scripts: list[list[str]],
) -> None:
    # a fresh Director per example: a failing example fails alone, and shrinks
    director, datastore = director_over()
    processor.director = director
    processor.exchanges.clear()
    await asyncio.gather(*(_drive(channel, script) for script in scripts))
    await processor.wait_all_closed()
    closes = [e.close_calls for e in processor.exchanges]
    assert all(count == 1 for count in closes), closes
    assert director.running(MODEL) == 0
    assert len(director.states) == 0
    assert in_flight(datastore) == {}
    # and the EPP still routes: nothing is booked that would make it refuse
    outcome_call = open_stream(channel)
    for message in (request_headers(envoy_headers()), request_body(BODY, end_of_stream=True)):
        await outcome_call.write(message)
    first = await outcome_call.read()
    assert first.WhichOneof("response") == "request_headers", first
    outcome_call.cancel()
    await processor.wait_all_closed()
    assert director.running(MODEL) == 0
    assert in_flight(datastore) == {}
