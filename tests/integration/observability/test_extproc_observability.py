"""The ext_proc adapter's observability: one ``gateway.request`` span per stream, continuing
the caller's trace and handed to the domain, and the request id on every log record."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from adapters.envoy.server import GrpcServers, ServerOptions
from ports.errors import ErrorCode, RequestError
from ports.observer import REQUEST_ID
from ports.requests import InboundRequest, RoutingDecision
from tests.fakes import DEFAULT_ENDPOINT, FakeProcessor
from tests.fakes.observer import RecordedSpan, RecordingObserver
from tests.support.extproc import (
    completion,
    envoy_headers,
    request_body,
    request_headers,
    response_body,
    response_headers,
)

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"
DEADLINE = 5.0


@dataclass
class Observed:
    processor: FakeProcessor
    observer: RecordingObserver
    servers: GrpcServers
    #: ``REQUEST_ID`` as the domain saw it while routing, per request
    seen_ids: list[str] = field(default_factory=list)


@pytest.fixture
async def observed() -> AsyncIterator[Observed]:
    observer = RecordingObserver()
    seen_ids: list[str] = []

    def decide(request: InboundRequest) -> RoutingDecision:
        seen_ids.append(REQUEST_ID.get())
        if b"refuse" in (request.body or b""):
            return RoutingDecision(error=RequestError(code=ErrorCode.BAD_REQUEST, message="no"))
        return RoutingDecision(endpoints=(DEFAULT_ENDPOINT,), body=request.body or b"")

    processor = FakeProcessor(decide)
    servers = GrpcServers(
        processor,
        ServerOptions(
            host="127.0.0.1",
            grpc_port=0,
            health_port=0,
            certificate=None,
        ),
        observer=observer,
    )
    await servers.start()
    try:
        yield Observed(processor, observer, servers, seen_ids)
    finally:
        await servers.drain(0)


async def _exchange(servers: GrpcServers, *headers: tuple[str, str], body: bytes) -> list[Any]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{servers.bound_grpc_port}") as channel:
        call: Any = pb_grpc.ExternalProcessorStub(channel).Process(timeout=30)
        await call.write(request_headers(envoy_headers(*headers)))
        await call.write(request_body(body, end_of_stream=True))
        replies = [await asyncio.wait_for(call.read(), DEADLINE)]
        if replies[0].WhichOneof("response") != "immediate_response":
            replies.append(await asyncio.wait_for(call.read(), DEADLINE))
            await call.write(response_headers([(":status", "200")]))
            replies.append(await asyncio.wait_for(call.read(), DEADLINE))
            await call.write(response_body(b"{}", end_of_stream=True))
            replies.append(await asyncio.wait_for(call.read(), DEADLINE))
            await call.done_writing()
        assert await asyncio.wait_for(call.read(), DEADLINE) is grpc.aio.EOF
        return replies


async def _ended(span: RecordedSpan) -> None:
    deadline = asyncio.get_running_loop().time() + DEADLINE
    while not span.ended:
        assert asyncio.get_running_loop().time() < deadline, "span never ended"
        await asyncio.sleep(0.005)


async def test_each_stream_is_a_gateway_span_continuing_the_callers_trace(
    observed: Observed,
) -> None:
    processor, observer = observed.processor, observed.observer
    await _exchange(
        observed.servers, ("traceparent", TRACEPARENT), ("x-request-id", "rid-1"), body=completion()
    )
    (span,) = observer.spans_named("gateway.request")
    assert span.trace_id == TRACE_ID
    assert span.remote_parent_id == "00f067aa0ba902b7"
    assert span.attributes["request_id"] == "rid-1"
    (exchange,) = processor.exchanges
    assert exchange.request.span is span  # the domain's spans descend from it
    await _ended(span)
    assert span.end_calls == 1
    assert not span.errors


async def test_a_refused_request_marks_the_gateway_span(observed: Observed) -> None:
    replies = await _exchange(observed.servers, body=completion(prompt="refuse"))
    assert replies[0].WhichOneof("response") == "immediate_response"
    (span,) = observed.observer.spans_named("gateway.request")
    await _ended(span)
    assert span.errors == ["BadRequest: no"]


async def test_the_request_id_is_set_for_everything_the_stream_runs(observed: Observed) -> None:
    servers = observed.servers
    await asyncio.gather(
        _exchange(servers, ("x-request-id", "rid-a"), body=completion()),
        _exchange(servers, ("x-request-id", "rid-b"), body=completion()),
        _exchange(servers, body=completion()),  # no id: the adapter makes one
    )
    # each stream's routing ran with its own request's id, the generated one included
    assert sorted(observed.seen_ids) == sorted(
        e.request.request_id for e in observed.processor.exchanges
    )
    assert {"rid-a", "rid-b"} < set(observed.seen_ids)
    assert REQUEST_ID.get() == ""  # nothing leaks into the test's own context
