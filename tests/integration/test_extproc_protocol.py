"""The ext_proc protocol at the gRPC level: a real ``GrpcServers``, a client acting as Envoy.

Each test drives one or more ``Process`` streams the way Envoy does in FULL_DUPLEX_STREAMED
mode and asserts on the ``ProcessingResponse`` messages Envoy would receive. Most tests
route with the real Director over a Datastore; the fake processor is used where a test
needs control over the decision or the timing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from adapters.envoy.server import GrpcServers
from adapters.envoy.tls import self_signed_certificate
from domain.datastore import Datastore
from domain.requestcontrol.director import Director
from ports.endpoints import EndpointAddress, EndpointEvent, EndpointEventKind, EndpointInfo
from ports.errors import ErrorCode, RequestError
from ports.requests import RequestProcessor, RoutingDecision
from tests.fakes import FakeProcessor
from tests.support.director import configured_director
from tests.support.extproc import (
    ENVOY_CHUNK,
    Headers,
    completion,
    dynamic_metadata,
    envoy_headers,
    metadata_context,
    request_body,
    request_body_chunks,
    request_headers,
    request_trailers,
    response_body,
    response_headers,
    response_trailers,
    set_headers,
    streamed,
    values_of,
)

DEADLINE = 5.0
MAX_CHUNK = 62_000
ENDPOINT_IPS = ("10.0.0.1", "10.0.0.2", "10.0.0.3")
ENDPOINTS = tuple(f"{ip}:8000" for ip in ENDPOINT_IPS)
DESTINATION = "x-gateway-destination-endpoint"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"

Connect = Callable[[RequestProcessor], Awaitable[grpc.aio.Channel]]
#: the ``start_servers`` fixture of conftest.py
StartServers = Callable[..., Awaitable[GrpcServers]]


class EnvoyStream:
    """One ``Process`` stream, driven the way Envoy drives it."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.call: Any = pb_grpc.ExternalProcessorStub(channel).Process(timeout=30)

    async def send(self, *messages: Any) -> None:
        for message in messages:
            await self.call.write(message)

    async def read(self) -> Any:
        reply = await asyncio.wait_for(self.call.read(), DEADLINE)
        assert reply is not grpc.aio.EOF, "the EPP ended the stream"
        return reply

    async def read_request_replies(self) -> tuple[Any, list[Any]]:
        """The request-header reply and the request-body replies up to end of stream."""
        header_reply = await self.read()
        assert header_reply.WhichOneof("response") == "request_headers", header_reply
        body_replies = [await self.read()]
        while not streamed(body_replies[-1], "request_body")[1]:
            body_replies.append(await self.read())
        return header_reply, body_replies

    async def route(
        self, body: bytes, headers: Headers | None = None, **header_kw: Any
    ) -> tuple[Any, bytes]:
        """Send a whole request; return the header reply and the forwarded body."""
        await self.send(
            request_headers(headers if headers is not None else envoy_headers(), **header_kw),
            *request_body_chunks(body),
        )
        header_reply, body_replies = await self.read_request_replies()
        return header_reply, b"".join(streamed(r, "request_body")[0] for r in body_replies)

    async def read_immediate(self) -> tuple[int, bytes]:
        reply = await self.read()
        assert reply.WhichOneof("response") == "immediate_response", reply
        return reply.immediate_response.status.code, reply.immediate_response.body

    async def expect_end(self) -> None:
        """The EPP closed the stream normally (gRPC OK)."""
        assert await asyncio.wait_for(self.call.read(), DEADLINE) is grpc.aio.EOF
        assert await self.call.code() == grpc.StatusCode.OK

    async def finish(self) -> None:
        """Envoy half-closes; the EPP ends the stream with OK and no further reply."""
        await self.call.done_writing()
        await self.expect_end()


# --- fixtures ----------------------------------------------------------------------------------


def endpoint_event(ip: str, port: int = 8000) -> EndpointEvent:
    return EndpointEvent(
        kind=EndpointEventKind.ADD_OR_UPDATE,
        endpoint=EndpointInfo(name=f"{ip}:{port}", address=EndpointAddress(ip=ip, port=port)),
    )


@pytest.fixture
def datastore() -> Datastore:
    store = Datastore()
    for ip in ENDPOINT_IPS:
        store.apply(endpoint_event(ip))
    store.mark_synced()
    return store


@pytest.fixture
def director(datastore: Datastore) -> Director:
    return configured_director(datastore)


@pytest.fixture
async def connect(start_servers: StartServers) -> AsyncIterator[Connect]:
    """Start the servers for a processor and open a plaintext channel to ext_proc."""
    channels: list[grpc.aio.Channel] = []

    async def _connect(processor: RequestProcessor) -> grpc.aio.Channel:
        servers = await start_servers(processor)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{servers.bound_grpc_port}")
        channels.append(channel)
        return channel

    yield _connect
    for channel in channels:
        await channel.close()


@pytest.fixture
async def epp(connect: Connect, director: Director) -> grpc.aio.Channel:
    """A channel to an EPP routing with the real Director over three endpoints."""
    return await connect(director)


async def routed(channel: grpc.aio.Channel, body: bytes | None = None) -> EnvoyStream:
    """A stream whose request has been routed; the response path is next."""
    stream = EnvoyStream(channel)
    await stream.route(body if body is not None else completion())
    return stream


# --- request path: the held header reply -------------------------------------------------------


async def test_header_reply_is_held_until_request_body_end_of_stream(
    epp: grpc.aio.Channel,
) -> None:
    stream = EnvoyStream(epp)
    body = completion(prompt="x" * 40_000)
    first, rest = body[:ENVOY_CHUNK], body[ENVOY_CHUNK:]
    await stream.send(request_headers(envoy_headers()), request_body(first, end_of_stream=False))

    pending = asyncio.ensure_future(stream.call.read())
    done, _ = await asyncio.wait({pending}, timeout=0.2)
    assert not done, "the EPP replied before the request body ended"

    await stream.send(request_body(rest, end_of_stream=True))
    header_reply = await asyncio.wait_for(pending, DEADLINE)
    assert header_reply.WhichOneof("response") == "request_headers"
    # Only known once the whole body arrived: the reply really was held.
    pairs = set_headers(header_reply.request_headers.response)
    assert values_of(pairs, "content-length") == [str(len(body))]


async def test_header_reply_sets_destination_content_length_and_reset_headers(
    epp: grpc.aio.Channel,
) -> None:
    body = completion()
    incoming = envoy_headers(
        ("content-length", str(len(body))),
        ("x-request-id", "req-1"),
        ("authorization", "Bearer secret"),
        ("x-custom", "a value, with commas"),
        ("x-gateway-inference-fairness-id", "tenant-a"),
        ("x-gateway-inference-objective", "critical"),
        ("x-gateway-model-name-rewrite", "llama"),
        ("x-gateway-destination-endpoint-subset", "10.9.9.9:8000"),
        ("x-gateway-destination-endpoint", "6.6.6.6:80"),
        ("x-gateway-destination-endpoint-served", "6.6.6.6:80"),
    )
    stream = EnvoyStream(epp)
    header_reply, forwarded = await stream.route(body, incoming)

    common = header_reply.request_headers.response
    assert common.clear_route_cache is True
    pairs = set_headers(common)
    destination = pairs[0]
    assert destination[0] == DESTINATION
    assert destination[1] in ENDPOINTS
    assert pairs[1] == ("Content-Length", str(len(forwarded)))
    assert forwarded == body

    re_set = dict(pairs[2:])
    assert re_set == {
        "x-request-id": "req-1",
        "authorization": "Bearer secret",
        "content-type": "application/json",
        "x-forwarded-proto": "http",
        "x-custom": "a value, with commas",
    }
    # system headers (and a spoofed destination) are never re-set
    assert values_of(pairs, DESTINATION) == [destination[1]]
    assert values_of(pairs, "content-length") == [str(len(forwarded))]
    for name in (
        "x-gateway-inference-fairness-id",
        "x-gateway-inference-objective",
        "x-gateway-model-name-rewrite",
        "x-gateway-destination-endpoint-subset",
        "x-gateway-destination-endpoint-served",
    ):
        assert values_of(pairs, name) == []
    assert all(option.header.raw_value for option in common.header_mutation.set_headers)
    assert dynamic_metadata(header_reply) == {"envoy.lb": {DESTINATION: destination[1]}}
    await stream.finish()


async def test_emitted_scores_cover_every_scored_endpoint(
    connect: Connect, datastore: Datastore
) -> None:
    channel = await connect(configured_director(datastore, emit_endpoint_scores=True))
    stream = EnvoyStream(channel)
    header_reply, _ = await stream.route(completion())
    lb = dynamic_metadata(header_reply)["envoy.lb"]
    destination = lb[DESTINATION]
    scores = lb["x-gateway-destination-endpoint-scores"]
    assert set(scores) == set(ENDPOINTS)
    assert scores[destination] == max(scores.values())
    await stream.finish()


async def test_scores_are_not_emitted_by_default(epp: grpc.aio.Channel) -> None:
    stream = EnvoyStream(epp)
    header_reply, _ = await stream.route(completion())
    assert "x-gateway-destination-endpoint-scores" not in dynamic_metadata(header_reply)["envoy.lb"]
    await stream.finish()


async def test_exchange_receives_the_request_as_envoy_sent_it(connect: Connect) -> None:
    fake = FakeProcessor()
    stream = EnvoyStream(await connect(fake))
    body = completion(prompt="y" * 50_000)
    headers = base_pb2.HeaderMap(
        headers=[
            base_pb2.HeaderValue(key=":path", raw_value=b"/v1/completions"),
            base_pb2.HeaderValue(key="x-raw", raw_value=b"from raw_value"),
            base_pb2.HeaderValue(key="x-plain", value="from value"),
            base_pb2.HeaderValue(key="x-both", value="ignored", raw_value=b"raw wins"),
        ]
    )
    hint = {SUBSET_KEY: ["10.0.0.1:8000", 7]}
    await stream.send(
        pb.ProcessingRequest(
            request_headers=pb.HttpHeaders(headers=headers),
            metadata_context=metadata_context({SUBSET_NAMESPACE: hint, "other": {"n": 2}}),
        ),
        *request_body_chunks(body),
    )
    header_reply, _ = await stream.read_request_replies()

    request = fake.last.request
    assert request.body == body
    assert request.headers["x-raw"] == "from raw_value"
    assert request.headers["x-plain"] == "from value"
    assert request.headers["x-both"] == "raw wins"
    assert request.headers[":path"] == "/v1/completions"
    assert request.headers["x-request-id"] == request.request_id
    assert request.metadata == {
        SUBSET_NAMESPACE: {SUBSET_KEY: ["10.0.0.1:8000", 7.0]},
        "other": {"n": 2.0},
    }
    re_set = dict(set_headers(header_reply.request_headers.response))
    assert re_set["x-plain"] == "from value"
    assert re_set["x-both"] == "raw wins"
    await stream.finish()
    await fake.wait_until(lambda: fake.open_exchanges == 0)
    assert fake.last.close_calls == 1


# --- request path: destinations ----------------------------------------------------------------


async def test_several_endpoints_form_a_comma_list_with_ipv6_bracketed(connect: Connect) -> None:
    decision = RoutingDecision(
        endpoints=(EndpointAddress(ip="::1", port=8000), EndpointAddress(ip="10.0.0.2", port=8000)),
        body=b'{"model":"m","prompt":"p"}',
        headers=(("x-plugin", "on"),),
        dynamic_metadata={"envoy.lb": {"x-plugin-key": "v"}, "my.plugin": {"score": 1.5}},
    )
    fake = FakeProcessor(decision)
    stream = EnvoyStream(await connect(fake))
    header_reply, forwarded = await stream.route(
        completion(), envoy_headers(("x-mine", "1"), ("x-plugin", "spoofed by the client"))
    )

    pairs = set_headers(header_reply.request_headers.response)
    assert pairs[:2] == [
        (DESTINATION, "[::1]:8000,10.0.0.2:8000"),
        ("Content-Length", str(len(decision.body))),
    ]
    assert ("x-mine", "1") in pairs[2:]
    # A header the EPP sets comes last and only once: the client's copy cannot override it.
    assert [p for p in pairs if p[0] == "x-plugin"] == [("x-plugin", "on")]
    assert pairs[-1] == ("x-plugin", "on")
    assert forwarded == decision.body
    assert dynamic_metadata(header_reply) == {
        "envoy.lb": {DESTINATION: "[::1]:8000,10.0.0.2:8000", "x-plugin-key": "v"},
        "my.plugin": {"score": 1.5},
    }
    await stream.finish()


async def test_large_body_comes_back_in_streamed_chunks_of_at_most_62000_bytes(
    epp: grpc.aio.Channel,
) -> None:
    body = completion(prompt="lorem ipsum " * 17_000)
    assert len(body) > 200_000
    stream = EnvoyStream(epp)
    await stream.send(request_headers(envoy_headers()), *request_body_chunks(body))
    header_reply, body_replies = await stream.read_request_replies()

    chunks = [streamed(r, "request_body") for r in body_replies]
    assert [len(c) for c, _ in chunks[:-1]] == [MAX_CHUNK] * (len(chunks) - 1)
    assert 0 < len(chunks[-1][0]) <= MAX_CHUNK
    assert [eos for _, eos in chunks] == [False] * (len(chunks) - 1) + [True]
    assert b"".join(c for c, _ in chunks) == body
    pairs = set_headers(header_reply.request_headers.response)
    assert values_of(pairs, "content-length") == [str(len(body))]
    await stream.finish()


async def test_model_rewrite_forwards_target_and_restores_incoming_name_in_response(
    epp: grpc.aio.Channel,
) -> None:
    body = completion(model="incoming-model", prompt="hi", max_tokens=8)
    stream = EnvoyStream(epp)
    header_reply, forwarded = await stream.route(
        body, envoy_headers(("x-gateway-model-name-rewrite", "target-model-v2"))
    )
    assert json.loads(forwarded) == {"model": "target-model-v2", "prompt": "hi", "max_tokens": 8}
    pairs = set_headers(header_reply.request_headers.response)
    assert values_of(pairs, "content-length") == [str(len(forwarded))]
    assert values_of(pairs, "x-gateway-model-name-rewrite") == []

    upstream = json.dumps(
        {
            "id": "cmpl-1",
            "object": "text_completion",
            "model": "target-model-v2",
            "choices": [{"index": 0, "text": "hello"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        },
        separators=(",", ":"),
    ).encode()
    split = upstream.index(b"target-model") + 6  # split inside the model name
    await stream.send(response_headers([(":status", "200"), ("content-type", "application/json")]))
    assert (await stream.read()).WhichOneof("response") == "response_headers"
    await stream.send(
        response_body(upstream[:split], end_of_stream=False),
        response_body(upstream[split:], end_of_stream=True),
    )
    returned, eos = streamed(await stream.read(), "response_body")
    assert eos is True
    assert json.loads(returned)["model"] == "incoming-model"
    assert returned == upstream.replace(b'"target-model-v2"', b'"incoming-model"')
    await stream.finish()


async def test_headers_only_request_is_routed_at_once(epp: grpc.aio.Channel) -> None:
    stream = EnvoyStream(epp)
    await stream.send(
        request_headers(envoy_headers(path="/v1/models", method="GET"), end_of_stream=True)
    )
    reply = await stream.read()
    assert reply.WhichOneof("response") == "request_headers"
    pairs = set_headers(reply.request_headers.response)
    assert pairs[0][0] == DESTINATION
    assert pairs[0][1] in ENDPOINTS
    assert values_of(pairs, "content-length") == []
    assert dynamic_metadata(reply) == {"envoy.lb": {DESTINATION: pairs[0][1]}}

    await stream.send(response_headers([(":status", "200")], end_of_stream=True))
    assert (await stream.read()).WhichOneof("response") == "response_headers"
    await stream.finish()


async def test_headers_only_request_with_empty_datastore_gets_500(connect: Connect) -> None:
    datastore = Datastore()
    datastore.mark_synced()
    channel = await connect(configured_director(datastore))
    stream = EnvoyStream(channel)
    await stream.send(
        request_headers(envoy_headers(path="/v1/models", method="GET"), end_of_stream=True)
    )
    assert await stream.read_immediate() == (
        500,
        b"inference error: Internal - no pods available in datastore",
    )
    await stream.expect_end()


async def test_request_id_is_generated_when_absent(epp: grpc.aio.Channel) -> None:
    stream = EnvoyStream(epp)
    header_reply, _ = await stream.route(completion())
    ids = values_of(set_headers(header_reply.request_headers.response), "x-request-id")
    assert len(ids) == 1
    assert uuid.UUID(ids[0]).version == 4
    await stream.finish()


async def test_request_id_is_kept_when_present(epp: grpc.aio.Channel) -> None:
    stream = EnvoyStream(epp)
    header_reply, _ = await stream.route(completion(), envoy_headers(("x-request-id", "abc-42")))
    ids = values_of(set_headers(header_reply.request_headers.response), "x-request-id")
    assert ids == ["abc-42"]
    await stream.finish()


# --- request path: subset hint -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("hint", "allowed"),
    [
        pytest.param(["10.0.0.2:9999"], {"10.0.0.2:8000"}, id="list-port-ignored"),
        pytest.param(
            ["10.0.0.1:8000", "10.0.0.3:1"], {"10.0.0.1:8000", "10.0.0.3:8000"}, id="list"
        ),
        pytest.param(
            "10.0.0.2:8000, 10.0.0.3:8000", {"10.0.0.2:8000", "10.0.0.3:8000"}, id="comma-string"
        ),
        pytest.param(
            [1, True, None, {"ip": "10.0.0.1"}, "10.0.0.3:8000"],
            {"10.0.0.3:8000"},
            id="non-strings-ignored",
        ),
    ],
)
async def test_subset_hint_limits_destinations(
    epp: grpc.aio.Channel, hint: object, allowed: set[str]
) -> None:
    seen: set[str] = set()
    for _ in range(12):
        stream = EnvoyStream(epp)
        header_reply, _ = await stream.route(
            completion(), metadata={SUBSET_NAMESPACE: {SUBSET_KEY: hint}}
        )
        destination = set_headers(header_reply.request_headers.response)[0]
        assert destination[0] == DESTINATION
        seen.add(destination[1])
        await stream.finish()
    assert seen <= allowed


async def test_empty_subset_hint_gets_503(epp: grpc.aio.Channel) -> None:
    stream = EnvoyStream(epp)
    await stream.send(
        request_headers(envoy_headers(), metadata={SUBSET_NAMESPACE: {SUBSET_KEY: []}}),
        *request_body_chunks(completion()),
    )
    assert await stream.read_immediate() == (
        503,
        b"inference error: ServiceUnavailable - "
        b"failed to find endpoint candidates for serving the request",
    )
    await stream.expect_end()


async def test_ipv6_endpoint_is_bracketed_and_matched_by_subset_hint(
    connect: Connect, datastore: Datastore
) -> None:
    datastore.apply(endpoint_event("fd00::7"))
    channel = await connect(configured_director(datastore))
    for hint in (["[fd00::7]:9000"], "fd00::7", "10.0.0.9:8000,[fd00::7]:1"):
        stream = EnvoyStream(channel)
        header_reply, _ = await stream.route(
            completion(), metadata={SUBSET_NAMESPACE: {SUBSET_KEY: hint}}
        )
        pairs = set_headers(header_reply.request_headers.response)
        assert pairs[0] == (DESTINATION, "[fd00::7]:8000"), hint
        assert dynamic_metadata(header_reply) == {"envoy.lb": {DESTINATION: "[fd00::7]:8000"}}
        await stream.finish()


async def test_concurrent_streams_do_not_mix(epp: grpc.aio.Channel) -> None:
    async def one(index: int) -> None:
        stream = EnvoyStream(epp)
        body = completion(prompt=f"prompt {index} " * (index * 500 + 1))
        header_reply, forwarded = await stream.route(
            body, envoy_headers(("x-request-id", f"req-{index}"))
        )
        pairs = set_headers(header_reply.request_headers.response)
        assert values_of(pairs, "x-request-id") == [f"req-{index}"]
        assert pairs[0][1] in ENDPOINTS
        assert forwarded == body
        await stream.send(
            response_headers([(":status", "200"), ("content-type", "text/event-stream")])
        )
        assert (await stream.read()).WhichOneof("response") == "response_headers"
        event = f"data: {index}\n\n".encode()
        await stream.send(response_body(event, end_of_stream=True))
        assert streamed(await stream.read(), "response_body") == (event, True)
        await stream.finish()

    await asyncio.gather(*(one(i) for i in range(20)))


# --- request path: what gets no reply ----------------------------------------------------------


async def test_duplicate_end_of_stream_body_chunk_is_ignored(epp: grpc.aio.Channel) -> None:
    body = completion()
    stream = EnvoyStream(epp)
    await stream.send(
        request_headers(envoy_headers()),
        request_body(body, end_of_stream=True),
        request_body(body, end_of_stream=True),  # Envoy repeats EoS on large bodies
    )
    _, body_replies = await stream.read_request_replies()
    assert b"".join(streamed(r, "request_body")[0] for r in body_replies) == body

    # the next reply belongs to the response path, not to a second routing
    await stream.send(response_headers([(":status", "200"), ("content-type", "application/json")]))
    assert (await stream.read()).WhichOneof("response") == "response_headers"
    await stream.send(response_body(b'{"ok":true}', end_of_stream=True))
    assert streamed(await stream.read(), "response_body") == (b'{"ok":true}', True)
    await stream.finish()


async def test_request_trailers_get_no_reply(epp: grpc.aio.Channel) -> None:
    stream = await routed(epp)
    await stream.send(
        request_trailers([("x-trailer", "1")]),
        response_headers([(":status", "200"), ("content-type", "application/json")]),
    )
    assert (await stream.read()).WhichOneof("response") == "response_headers"
    await stream.finish()


# --- response path -----------------------------------------------------------------------------


async def test_response_headers_reply_only_marks(epp: grpc.aio.Channel) -> None:
    stream = await routed(epp)
    await stream.send(
        response_headers(
            [(":status", "200"), ("content-type", "application/json"), ("x-upstream", "u")]
        )
    )
    reply = await stream.read()
    assert reply.WhichOneof("response") == "response_headers"
    pairs = set_headers(reply.response_headers.response)
    # the debug marker only: the response's own headers are not set again to their values
    # (Envoy refuses the x-envoy-* ones and counts each as a rejected mutation)
    assert pairs == [("x-went-into-resp-headers", "true")]
    await stream.finish()


async def test_streaming_response_is_echoed_chunk_by_chunk(epp: grpc.aio.Channel) -> None:
    stream = await routed(epp, completion(stream=True))
    await stream.send(response_headers([(":status", "200"), ("content-type", "text/event-stream")]))
    assert (await stream.read()).WhichOneof("response") == "response_headers"

    events = [
        b'data: {"model":"llama","choices":[{"text":"a"}]}\n\n',
        b'data: {"model":"llama","choices":[{"te',
        b'xt":"b"}]}\n\n',
        b"data: [DONE]\n\n",
    ]
    for index, event in enumerate(events):
        last = index == len(events) - 1
        await stream.send(response_body(event, end_of_stream=last))
        assert streamed(await stream.read(), "response_body") == (event, last)
    await stream.finish()


SSE_EVENTS = [b'data: {"choices":[{"text":"%d"}]}\n\n' % i for i in range(3)]


async def test_streamed_chunks_whose_processing_waits_come_back_in_order(
    connect: Connect,
) -> None:
    # The native transport answers a streamed chunk as it arrives, without waking the
    # stream's task; work that has to wait is handed to the task and finished there.
    fake = FakeProcessor(block_response_body=True)
    stream = EnvoyStream(await connect(fake))
    await stream.route(completion(stream=True))
    await stream.send(response_headers([(":status", "200"), ("content-type", "text/event-stream")]))
    assert (await stream.read()).WhichOneof("response") == "response_headers"
    await stream.send(*(response_body(event, end_of_stream=False) for event in SSE_EVENTS))
    await fake.wait_until(lambda: len(fake.last.response_body_calls) == 1)
    pending = asyncio.ensure_future(stream.call.read())
    done, _ = await asyncio.wait({pending}, timeout=0.2)
    assert not done, "a chunk was answered before its processing ended"

    fake.release_response_body()
    replies = [await asyncio.wait_for(pending, DEADLINE)]
    replies += [await stream.read() for _ in SSE_EVENTS[1:]]
    assert [streamed(r, "response_body") for r in replies] == [(e, False) for e in SSE_EVENTS]
    assert fake.last.response_body_calls == [(e, False) for e in SSE_EVENTS]
    await stream.send(response_body(b"data: [DONE]\n\n", end_of_stream=True))
    assert streamed(await stream.read(), "response_body") == (b"data: [DONE]\n\n", True)
    await stream.expect_end()


async def test_streamed_chunks_are_processed_with_the_request_id_set(connect: Connect) -> None:
    # Log records written while a chunk is processed carry the request id, also where
    # the chunk is answered without the stream's task.
    fake = FakeProcessor()
    stream = EnvoyStream(await connect(fake))
    await stream.route(completion(stream=True), envoy_headers(("x-request-id", "req-chunks")))
    await stream.send(response_headers([(":status", "200"), ("content-type", "text/event-stream")]))
    await stream.read()
    for index, event in enumerate(SSE_EVENTS):
        await stream.send(response_body(event, end_of_stream=index == len(SSE_EVENTS) - 1))
        await stream.read()
    await stream.expect_end()
    assert fake.last.response_body_request_ids == ["req-chunks"] * len(SSE_EVENTS)


async def test_non_streaming_response_is_buffered_and_rechunked(epp: grpc.aio.Channel) -> None:
    stream = await routed(epp)
    await stream.send(response_headers([(":status", "200"), ("content-type", "application/json")]))
    assert (await stream.read()).WhichOneof("response") == "response_headers"

    upstream = json.dumps(
        {"object": "text_completion", "model": "llama", "choices": [{"text": "z" * 150_000}]}
    ).encode()
    parts = [upstream[i : i + ENVOY_CHUNK] for i in range(0, len(upstream), ENVOY_CHUNK)]
    await stream.send(
        *(response_body(p, end_of_stream=i == len(parts) - 1) for i, p in enumerate(parts))
    )
    chunks = [streamed(await stream.read(), "response_body")]
    while not chunks[-1][1]:
        chunks.append(streamed(await stream.read(), "response_body"))

    # one reply per 62,000 bytes, not one per upstream chunk: nothing went out before EoS
    assert [len(c) for c, _ in chunks] == [MAX_CHUNK, MAX_CHUNK, len(upstream) - 2 * MAX_CHUNK]
    assert [eos for _, eos in chunks] == [False, False, True]
    assert b"".join(c for c, _ in chunks) == upstream
    await stream.finish()


async def test_response_trailers_flush_buffered_body_then_reply_empty_trailers(
    epp: grpc.aio.Channel,
) -> None:
    stream = await routed(epp)
    await stream.send(response_headers([(":status", "200"), ("content-type", "application/grpc")]))
    assert (await stream.read()).WhichOneof("response") == "response_headers"

    upstream = b"\x00\x00\x00\x00\x05hello" * 10_000
    await stream.send(
        response_body(upstream[:70_000], end_of_stream=False),
        response_body(upstream[70_000:], end_of_stream=False),
        response_trailers([("grpc-status", "0")]),
    )
    chunks = [streamed(await stream.read(), "response_body") for _ in range(2)]
    assert [len(c) for c, _ in chunks] == [MAX_CHUNK, len(upstream) - MAX_CHUNK]
    assert [eos for _, eos in chunks] == [False, False]
    assert b"".join(c for c, _ in chunks) == upstream

    trailers = await stream.read()
    assert trailers.WhichOneof("response") == "response_trailers"
    assert trailers.response_trailers == pb.TrailersResponse()
    await stream.finish()


async def test_response_body_metadata_goes_on_the_last_reply(connect: Connect) -> None:
    fake = FakeProcessor(response_metadata={"epp.usage": {"tokens": 3}})
    stream = EnvoyStream(await connect(fake))
    await stream.route(completion())
    await stream.send(response_headers([(":status", "200"), ("content-type", "application/json")]))
    await stream.read()
    upstream = b"a" * 100_000
    await stream.send(response_body(upstream, end_of_stream=True))
    first, last = await stream.read(), await stream.read()
    assert streamed(first, "response_body")[1] is False
    assert dynamic_metadata(first) == {}
    assert streamed(last, "response_body")[1] is True
    assert dynamic_metadata(last) == {"epp.usage": {"tokens": 3}}
    assert fake.last.response_body_calls == [(upstream, True)]
    await stream.finish()


async def test_response_headers_reach_the_exchange_with_served_endpoint_metadata(
    connect: Connect,
) -> None:
    fake = FakeProcessor(response_headers=(("x-epp-extra", "1"),))
    stream = EnvoyStream(await connect(fake))
    await stream.route(completion())
    served = {"envoy.lb": {"x-gateway-destination-endpoint-served": "10.0.0.1:8000"}}
    message = response_headers([(":status", "200"), ("content-type", "application/json")])
    message.metadata_context.CopyFrom(metadata_context(served))
    await stream.send(message)
    reply = await stream.read()

    pairs = set_headers(reply.response_headers.response)
    assert pairs == [("x-went-into-resp-headers", "true"), ("x-epp-extra", "1")]
    (call,) = fake.last.response_headers_calls
    assert call.headers[":status"] == "200"
    assert call.metadata["envoy.lb"] == served["envoy.lb"]
    await stream.finish()


async def test_inbound_request_metadata_does_not_change_after_open(connect: Connect) -> None:
    fake = FakeProcessor()
    stream = EnvoyStream(await connect(fake))
    hint = {SUBSET_NAMESPACE: {SUBSET_KEY: ["10.0.0.1:8000"]}}
    await stream.route(completion(), metadata=hint)
    assert fake.last.request.metadata == hint
    message = response_headers([(":status", "200")])
    message.metadata_context.CopyFrom(
        metadata_context({"envoy.lb": {"x-gateway-destination-endpoint-served": "10.0.0.1:8000"}})
    )
    await stream.send(message)
    await stream.read()
    assert fake.last.request.metadata == hint
    await stream.finish()


# --- errors ------------------------------------------------------------------------------------


async def test_invalid_json_body_gets_400(epp: grpc.aio.Channel) -> None:
    stream = EnvoyStream(epp)
    await stream.send(
        request_headers(envoy_headers()), request_body(b"{not json", end_of_stream=True)
    )
    status, body = await stream.read_immediate()
    assert status == 400
    assert body.startswith(b"inference error: BadRequest - ")
    await stream.expect_end()


async def test_missing_model_gets_400(epp: grpc.aio.Channel) -> None:
    stream = EnvoyStream(epp)
    await stream.send(
        request_headers(envoy_headers()), request_body(b'{"prompt":"hi"}', end_of_stream=True)
    )
    assert await stream.read_immediate() == (
        400,
        b"inference error: BadRequest - model not found in request body",
    )
    await stream.expect_end()


@pytest.mark.parametrize(
    ("code", "status"),
    [
        (ErrorCode.BAD_REQUEST, 400),
        (ErrorCode.UNAUTHORIZED, 401),
        (ErrorCode.FORBIDDEN, 403),
        (ErrorCode.NOT_FOUND, 404),
        (ErrorCode.RESOURCE_EXHAUSTED, 429),
        (ErrorCode.INTERNAL, 500),
        (ErrorCode.SERVICE_UNAVAILABLE, 503),
    ],
)
async def test_mapped_error_codes_become_immediate_responses(
    connect: Connect, code: ErrorCode, status: int
) -> None:
    fake = FakeProcessor(RoutingDecision(error=RequestError(code=code, message="nope")))
    stream = EnvoyStream(await connect(fake))
    await stream.send(request_headers(envoy_headers()), *request_body_chunks(completion()))
    assert await stream.read_immediate() == (
        status,
        f"inference error: {code.value} - nope".encode(),
    )
    await stream.expect_end()
    await fake.wait_until(lambda: fake.open_exchanges == 0)


@pytest.mark.parametrize("code", [ErrorCode.UNKNOWN, ErrorCode.MODEL_SERVER_ERROR])
async def test_error_code_without_http_status_aborts_the_stream(
    connect: Connect, code: ErrorCode
) -> None:
    fake = FakeProcessor(RoutingDecision(error=RequestError(code=code, message="boom")))
    stream = EnvoyStream(await connect(fake))
    await stream.send(request_headers(envoy_headers()), *request_body_chunks(completion()))
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await asyncio.wait_for(stream.call.read(), DEADLINE)
    assert failure.value.code() == grpc.StatusCode.UNKNOWN
    assert "boom" in (failure.value.details() or "")
    await fake.wait_until(lambda: fake.open_exchanges == 0)
    assert fake.last.close_calls == 1


# --- the gateway drops the stream --------------------------------------------------------------


async def test_drop_while_route_is_blocked_closes_the_exchange(connect: Connect) -> None:
    fake = FakeProcessor(block_route=True)
    stream = EnvoyStream(await connect(fake))
    await stream.send(request_headers(envoy_headers()), *request_body_chunks(completion()))
    await fake.wait_until(lambda: bool(fake.exchanges) and fake.last.route_calls == 1)
    assert fake.open_exchanges == 1

    stream.call.cancel()
    await fake.wait_until(lambda: fake.last.closed and fake.open_exchanges == 0)
    assert fake.last.route_cancelled
    assert fake.last.close_calls == 1


async def test_drop_after_partial_body_leaves_nothing_open(connect: Connect) -> None:
    fake = FakeProcessor()
    channel = await connect(fake)
    body = completion(prompt="q" * 40_000)
    dropped = EnvoyStream(channel)
    await dropped.send(
        request_headers(envoy_headers()), request_body(body[:ENVOY_CHUNK], end_of_stream=False)
    )
    dropped.call.cancel()

    # the server is unaffected: the next stream is routed and cleaned up normally
    stream = EnvoyStream(channel)
    _, forwarded = await stream.route(body)
    assert forwarded == body
    await stream.finish()
    await fake.wait_until(lambda: fake.open_exchanges == 0)
    assert len(fake.exchanges) == 1  # the dropped request never reached the processor
    assert fake.last.close_calls == 1


async def test_drop_during_response_closes_the_exchange(connect: Connect) -> None:
    fake = FakeProcessor()
    stream = EnvoyStream(await connect(fake))
    await stream.route(completion())
    await stream.send(response_headers([(":status", "200"), ("content-type", "text/event-stream")]))
    await stream.read()
    await stream.send(response_body(b"data: {}\n\n", end_of_stream=False))
    await stream.read()
    assert not fake.last.closed

    stream.call.cancel()
    await fake.wait_until(lambda: fake.last.closed and fake.open_exchanges == 0)
    assert fake.last.close_calls == 1


#: The ways a response ends, each the messages Envoy sends after the request was routed and
#: the number of replies the EPP sends to them.
RESPONSE_ENDS: dict[str, tuple[list[Any], int]] = {
    "buffered body": (
        [
            response_headers([(":status", "200"), ("content-type", "application/json")]),
            response_body(b"{}", end_of_stream=True),
        ],
        2,
    ),
    "streamed body": (
        [
            response_headers([(":status", "200"), ("content-type", "text/event-stream")]),
            response_body(b"data: {}\n\n", end_of_stream=False),
            response_body(b"data: [DONE]\n\n", end_of_stream=True),
        ],
        3,
    ),
    "trailers": (
        [
            response_headers([(":status", "200"), ("content-type", "application/grpc")]),
            response_body(b"\x00\x00\x00\x00\x00", end_of_stream=False),
            response_trailers([("grpc-status", "0")]),
        ],
        3,
    ),
    "headers only": ([response_headers([(":status", "204")], end_of_stream=True)], 1),
}


@pytest.mark.parametrize("end", list(RESPONSE_ENDS))
async def test_stream_ends_ok_as_soon_as_the_response_ends(connect: Connect, end: str) -> None:
    # Envoy resets a stream still open when its HTTP request ends; ending it with OK first
    # spares a status sent on a reset call (grpc.aio leaks that batch's memory).
    fake = FakeProcessor()
    stream = EnvoyStream(await connect(fake))
    await stream.route(completion())
    messages, replies = RESPONSE_ENDS[end]
    await stream.send(*messages)
    for _ in range(replies):
        await stream.read()
    await stream.expect_end()  # without Envoy's half-close
    await fake.wait_until(lambda: fake.open_exchanges == 0)
    assert fake.last.close_calls == 1
    assert fake.last.response_body_calls[-1][1] is True  # the exchange saw the response end


async def test_stream_stays_open_until_the_response_ends(connect: Connect) -> None:
    fake = FakeProcessor()
    stream = EnvoyStream(await connect(fake))
    await stream.route(completion())
    await stream.send(response_headers([(":status", "200"), ("content-type", "text/event-stream")]))
    await stream.read()
    await stream.send(response_body(b"data: {}\n\n", end_of_stream=False))
    await stream.read()
    assert not fake.last.closed
    await stream.send(response_body(b"data: [DONE]\n\n", end_of_stream=True))
    assert streamed(await stream.read(), "response_body") == (b"data: [DONE]\n\n", True)
    await stream.expect_end()


# --- TLS ---------------------------------------------------------------------------------------


async def test_tls_client_completes_a_request(
    start_servers: StartServers, director: Director
) -> None:
    certificate = self_signed_certificate()
    servers = await start_servers(director, certificate=certificate)
    credentials = grpc.ssl_channel_credentials(root_certificates=certificate.certificate_pem)
    async with grpc.aio.secure_channel(
        f"127.0.0.1:{servers.bound_grpc_port}",
        credentials,
        options=[("grpc.ssl_target_name_override", "localhost")],
    ) as channel:
        stream = EnvoyStream(channel)
        body = completion()
        header_reply, forwarded = await stream.route(body)
        assert set_headers(header_reply.request_headers.response)[0][1] in ENDPOINTS
        assert forwarded == body
        await stream.finish()


async def test_plaintext_client_is_refused_by_tls_server(
    start_servers: StartServers, director: Director
) -> None:
    servers = await start_servers(director, certificate=self_signed_certificate())
    async with grpc.aio.insecure_channel(f"127.0.0.1:{servers.bound_grpc_port}") as channel:
        call = pb_grpc.ExternalProcessorStub(channel).Process(timeout=DEADLINE)
        with contextlib.suppress(grpc.aio.AioRpcError):  # the write may already fail
            await call.write(request_headers(envoy_headers(), end_of_stream=True))
        assert await call.code() == grpc.StatusCode.UNAVAILABLE
