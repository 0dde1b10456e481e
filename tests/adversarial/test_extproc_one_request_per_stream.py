"""Finding 4: one ext_proc stream carries one request; any other message order is refused
with a gRPC error, and whatever the sequence every exchange is closed exactly once.

Before: a second ``request_headers`` on a stream opened a second exchange and the first
was never closed: its running count and in-flight load stayed booked, and with
``concurrency-detector`` a few such streams turned all later traffic into 429s.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

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
    response_body,
    response_headers,
    response_trailers,
)

pytestmark = pytest.mark.usefixtures("each_transport")

MODEL = "llama"


def _request() -> list[Any]:
    return [request_headers(envoy_headers()), request_body(completion(MODEL), end_of_stream=True)]


async def _run(channel: grpc.aio.Channel, *messages: Any) -> tuple[list[Any], grpc.StatusCode, str]:
    call = open_stream(channel)
    for message in messages:
        await call.write(message)
    await call.done_writing()
    return await read_all(call)


async def test_a_second_request_on_a_stream_is_refused_and_nothing_leaks() -> None:
    director, datastore = director_over()
    processor = CountingProcessor(director)
    async with extproc_channel(processor) as channel:
        for second in (
            [request_headers(envoy_headers(), end_of_stream=True)],  # a headers-only request
            _request(),
            [request_headers(envoy_headers(), end_of_stream=True)],
            [request_headers(envoy_headers())],
        ):
            replies, code, details = await _run(channel, *_request(), *second)
            assert code == grpc.StatusCode.FAILED_PRECONDITION
            assert "one request per stream" in details
            # the first request was routed before the second arrived
            assert [r.WhichOneof("response") for r in replies] == [
                "request_headers",
                "request_body",
            ]
        await processor.wait_all_closed()
        assert director.running(MODEL) == 0
        assert in_flight(datastore) == {}

        # later traffic is routed, not refused with 429
        replies, code, _ = await _run(
            channel,
            *_request(),
            response_headers([(":status", "200"), ("content-type", "application/json")]),
            response_body(b"{}", end_of_stream=True),
        )
    assert code == grpc.StatusCode.OK
    assert [r.WhichOneof("response") for r in replies[:2]] == ["request_headers", "request_body"]
    await processor.wait_all_closed()
    assert all(e.close_calls == 1 for e in processor.exchanges)
    assert director.running(MODEL) == 0
    assert in_flight(datastore) == {}


def _bad_header(name: str, value: bytes = b"v") -> Any:
    headers = base_pb2.HeaderMap(
        headers=[
            *(base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in envoy_headers()),
            base_pb2.HeaderValue(key=name, raw_value=value),
        ]
    )
    return pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=headers))


@pytest.mark.parametrize(
    ("messages", "code", "cause"),
    [
        (
            [request_body(completion(MODEL), end_of_stream=True)],
            grpc.StatusCode.FAILED_PRECONDITION,
            "request_body before request_headers",
        ),
        (
            [response_headers([(":status", "200")])],
            grpc.StatusCode.FAILED_PRECONDITION,
            "response_headers before the request was routed",
        ),
        (
            [response_body(b"{}", end_of_stream=True)],
            grpc.StatusCode.FAILED_PRECONDITION,
            "response_body before the request was routed",
        ),
        (
            [response_trailers([("x", "1")])],
            grpc.StatusCode.FAILED_PRECONDITION,
            "response_trailers before the request was routed",
        ),
        (
            [request_headers(envoy_headers()), response_headers([(":status", "200")])],
            grpc.StatusCode.FAILED_PRECONDITION,
            "response_headers before the request was routed",
        ),
        (
            [_bad_header("x-evil\r\nx-injected")],
            grpc.StatusCode.INVALID_ARGUMENT,
            "header name",
        ),
        ([_bad_header("x-evil\n")], grpc.StatusCode.INVALID_ARGUMENT, "header name"),
        ([_bad_header("x-evil\x00")], grpc.StatusCode.INVALID_ARGUMENT, "header name"),
        ([_bad_header("x-ok", b"a\r\nx-injected: 1")], grpc.StatusCode.INVALID_ARGUMENT, "value"),
    ],
    ids=[
        "body-before-headers",
        "response-headers-alone",
        "response-body-alone",
        "response-trailers-alone",
        "response-before-routing",
        "crlf-in-name",
        "lf-in-name",
        "nul-in-name",
        "crlf-in-value",
    ],
)
async def test_messages_out_of_protocol_are_refused_with_a_clear_error(
    messages: list[Any], code: grpc.StatusCode, cause: str
) -> None:
    director, datastore = director_over()
    processor = CountingProcessor(director)
    async with extproc_channel(processor) as channel:
        replies, got, details = await _run(channel, *messages)
        assert (got, replies) == (code, [])
        assert cause in details
        # the server is unaffected: the next stream is routed
        replies, got, _ = await _run(channel, *_request())
        assert got == grpc.StatusCode.OK
        assert replies[0].WhichOneof("response") == "request_headers"
    await processor.wait_all_closed()
    assert all(e.close_calls == 1 for e in processor.exchanges)
    assert director.running(MODEL) == 0
    assert in_flight(datastore) == {}


async def test_a_flood_of_refused_streams_writes_a_bounded_number_of_log_lines(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # before: one line per refused stream, formatted and written on the event loop, so a
    # peer chose how fast the EPP wrote its log; after: 10 a second, then a count
    caplog.set_level(logging.INFO, logger="adapters.envoy.extproc")
    director, _ = director_over()
    streams = 200
    # one connection, not paused for it (that is the next test's)
    limits = StreamLimits(protocol_error_pause=0)
    async with extproc_channel(CountingProcessor(director), limits=limits) as channel:
        started = time.monotonic()
        for _ in range(streams):
            _, code, _ = await _run(channel, request_body(b"{}", end_of_stream=True))
            assert code == grpc.StatusCode.FAILED_PRECONDITION
        seconds = time.monotonic() - started
    refused = [m for m in caplog.messages if m.startswith("ext_proc stream refused")]
    windows = math.ceil(seconds) + 1  # 1 s windows the flood touched
    assert 1 <= len(refused) <= 10 * windows < streams, (len(refused), seconds)
