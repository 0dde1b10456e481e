"""Finding: nothing bounded what one ext_proc stream, or all of them, may hold.

- a 100 MB request body was buffered and routed: now a body beyond
  ``--max-request-body-bytes`` is answered 413 as the limit is crossed, without buffering more;
- a non-streamed response was buffered whole (+275 MB for 100 MB): now past
  ``--max-response-buffer-bytes`` it goes on chunk by chunk, unchanged and never failed;
- 20,000 idle streams held 636 MB for ever: now a stream with no message from Envoy for
  ``--stream-idle-timeout`` is closed, and past ``--max-concurrent-streams`` a new stream is
  refused;
- streams held open without a request crowded out Envoy's: now past
  ``--max-unrouted-streams`` the oldest stream still waiting for its request is closed (the
  test through Envoy is ``test_envoy_idle_streams.py``).
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from adapters.envoy.extproc import StreamLimits
from app.cli import parse_settings
from tests.adversarial.extproc_support import (
    CountingProcessor,
    director_over,
    extproc_channel,
    open_stream,
    read_all,
)
from tests.adversarial.support import peak_memory
from tests.support.extproc import (
    envoy_headers,
    request_body,
    request_headers,
    response_body,
    response_headers,
    streamed,
)

pytestmark = pytest.mark.usefixtures("each_transport")

MIB = 1 << 20
ENVOY_CONFIG = "deploy/envoy/envoy.yaml"
STATIC = ["--static-endpoints", "127.0.0.2:8000"]


def _processor() -> CountingProcessor:
    director, _ = director_over(None)
    return CountingProcessor(director)


async def test_a_body_beyond_the_limit_is_a_413_without_buffering_it() -> None:
    processor = _processor()
    limits = StreamLimits(max_request_body_bytes=1 * MIB)
    chunk = b"x" * 65_536
    async with extproc_channel(processor, limits=limits) as channel:
        call = open_stream(channel)
        await call.write(request_headers(envoy_headers()))
        sent = 0
        reader = asyncio.create_task(call.read())
        with peak_memory() as peak:
            # A 100 MB body as Envoy streams it; the answer comes once 1 MiB is crossed and
            # the stream ends, so the writes stop being accepted soon after.
            while sent < 100 * MIB and not reader.done():
                try:
                    await call.write(request_body(chunk, end_of_stream=False))
                except (asyncio.InvalidStateError, grpc.aio.AioRpcError):
                    break
                sent += len(chunk)
            reply = await reader
    assert reply.WhichOneof("response") == "immediate_response", reply
    assert reply.immediate_response.status.code == 413
    assert b"PayloadTooLarge" in reply.immediate_response.body
    # before: the whole body buffered (and routed); after: never more than the limit held
    assert peak.bytes < 4 * MIB, peak.bytes
    assert not processor.exchanges  # never routed
    assert sent < 100 * MIB


async def test_a_declared_content_length_beyond_the_limit_is_a_413_at_once() -> None:
    processor = _processor()
    limits = StreamLimits(max_request_body_bytes=1 * MIB)
    async with extproc_channel(processor, limits=limits) as channel:
        call = open_stream(channel)
        await call.write(request_headers(envoy_headers(("content-length", str(100 * MIB)))))
        reply = await call.read()
        call.cancel()
    assert reply.immediate_response.status.code == 413


async def test_a_body_within_the_limit_is_routed() -> None:
    processor = _processor()
    limits = StreamLimits(max_request_body_bytes=1 * MIB)
    body = json.dumps({"model": "llama", "prompt": "x" * (MIB - 100)}).encode()
    async with extproc_channel(processor, limits=limits) as channel:
        call = open_stream(channel)
        await call.write(request_headers(envoy_headers()))
        await call.write(request_body(body, end_of_stream=True))
        await call.done_writing()
        replies, code, _ = await read_all(call)
    assert code == grpc.StatusCode.OK
    assert replies[0].WhichOneof("response") == "request_headers"


async def _routed(channel: grpc.aio.Channel) -> Any:
    call = open_stream(channel)
    await call.write(request_headers(envoy_headers()))
    await call.write(request_body(b'{"model": "llama", "prompt": "hi"}', end_of_stream=True))
    first = await call.read()
    assert first.WhichOneof("response") == "request_headers", first
    _, done = streamed(await call.read(), "request_body")
    assert done
    return call


async def test_a_response_beyond_the_buffer_cap_passes_through_unchanged() -> None:
    processor = _processor()
    limits = StreamLimits(max_response_buffer_bytes=256 * 1024)
    chunks = [bytes([65 + i]) * 100_000 for i in range(6)]  # 600 kB, not JSON-parseable
    async with extproc_channel(processor, limits=limits) as channel:
        call = await _routed(channel)
        await call.write(response_headers([(":status", "200"), ("content-type", "text/plain")]))
        assert (await call.read()).WhichOneof("response") == "response_headers"
        got = b""
        for chunk in chunks[:3]:  # 300 kB: past the cap, before the end of the response
            await call.write(response_body(chunk, end_of_stream=False))
        while len(got) < 300_000:  # before: nothing came back until the end of stream
            body, done = streamed(await asyncio.wait_for(call.read(), 5), "response_body")
            assert not done
            got += body
        for i, chunk in enumerate(chunks[3:]):
            await call.write(response_body(chunk, end_of_stream=i == 2))
        await call.done_writing()
        replies, code, _ = await read_all(call)
    assert code == grpc.StatusCode.OK
    ends = []
    for reply in replies:
        body, done = streamed(reply, "response_body")
        got += body
        ends.append(done)
    assert got == b"".join(chunks)
    assert ends[-1]
    assert not any(ends[:-1])
    await processor.wait_all_closed()


async def test_an_idle_stream_is_closed() -> None:
    processor = _processor()
    limits = StreamLimits(idle_timeout=0.3)
    async with extproc_channel(processor, limits=limits) as channel:
        call = open_stream(channel)
        started = time.monotonic()
        await call.write(request_headers(envoy_headers()))
        # then nothing: before, the stream stayed open until the client's 30 s deadline
        replies, code, details = await read_all(call)
        elapsed = time.monotonic() - started
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED, (code, details)
    assert "--stream-idle-timeout" in details
    assert replies == []
    assert 0.3 <= elapsed < 5, elapsed


async def test_a_routed_stream_waiting_for_a_long_response_stays_open_until_idle() -> None:
    processor = _processor()
    limits = StreamLimits(idle_timeout=0.5)
    async with extproc_channel(processor, limits=limits) as channel:
        call = await _routed(channel)
        await call.write(response_headers([(":status", "200")]))  # activity resets the timer
        assert (await call.read()).WhichOneof("response") == "response_headers"
        _, code, _ = await read_all(call)
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    await processor.wait_all_closed()


async def test_a_stream_whose_response_chunks_keep_coming_is_not_idle() -> None:
    processor = _processor()
    limits = StreamLimits(idle_timeout=0.4)
    async with extproc_channel(processor, limits=limits) as channel:
        call = await _routed(channel)
        await call.write(
            response_headers([(":status", "200"), ("content-type", "text/event-stream")])
        )
        assert (await call.read()).WhichOneof("response") == "response_headers"
        started = time.monotonic()
        chunks = 0
        # Envoy's pace for a slow stream: a chunk every 0.1 s, for three idle timeouts
        while time.monotonic() - started < 1.2:
            await asyncio.sleep(0.1)
            await call.write(response_body(b'data: {"choices":[]}\n\n', end_of_stream=False))
            reply = await asyncio.wait_for(call.read(), 5)
            assert reply is not grpc.aio.EOF, await call.details()
            assert streamed(reply, "response_body") == (b'data: {"choices":[]}\n\n', False)
            chunks += 1
        await call.write(response_body(b"data: [DONE]\n\n", end_of_stream=True))
        replies, code, details = await read_all(call)
    assert code == grpc.StatusCode.OK, (code, details)
    assert streamed(replies[-1], "response_body") == (b"data: [DONE]\n\n", True)
    assert chunks >= 10


async def test_streams_beyond_the_limit_are_refused() -> None:
    processor = _processor()
    async with extproc_channel(processor, max_concurrent_streams=2) as channel:
        held = [await _routed(channel) for _ in range(2)]  # routed: surely being served
        extra = open_stream(channel)
        try:
            await extra.write(request_headers(envoy_headers()))
        except grpc.aio.AioRpcError as refused:  # grpcio may report it on the write
            code = refused.code()
        else:
            _, code, _ = await read_all(extra)
        for call in held:
            call.cancel()
    # before: any number of streams held their memory; after: the third is refused
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_past_the_unrouted_limit_the_oldest_unrouted_stream_is_closed() -> None:
    processor = _processor()
    limits = StreamLimits(max_unrouted_streams=3)
    async with extproc_channel(processor, limits=limits) as channel:
        routed = await _routed(channel)  # routed: it is never closed for the limit
        idle = []
        for _ in range(3):
            call = open_stream(channel)
            await call.write(request_headers(envoy_headers()))  # then nothing
            idle.append(call)
        newest = open_stream(channel)
        await newest.write(request_headers(envoy_headers()))
        # before: every idle stream stayed until the idle timeout (10 minutes)
        _, code, details = await read_all(idle[0])
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-unrouted-streams" in details
        assert not any(call.done() for call in idle[1:])
        # the newest gets its request routed as usual
        await newest.write(request_body(b'{"model": "llama", "prompt": "hi"}', end_of_stream=True))
        first = await newest.read()
        assert first.WhichOneof("response") == "request_headers", first
        assert not routed.done()
        for call in (*idle[1:], newest, routed):
            call.cancel()
    await processor.wait_all_closed()


def test_the_shipped_envoy_opens_fewer_streams_per_connection_than_the_epp_takes() -> None:
    # Envoy would put more streams on a new connection before the EPP's SETTINGS arrive,
    # and streams Envoy saw end may still count on the EPP's side for a moment: the EPP
    # would refuse the excess. Envoy's limit stays a fifth below the EPP's.
    envoy = yaml.safe_load((Path(__file__).resolve().parents[2] / ENVOY_CONFIG).read_text())
    (epp,) = [c for c in envoy["static_resources"]["clusters"] if c["name"] == "epp"]
    options = epp["typed_extension_protocol_options"][
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
    ]
    http2 = options["explicit_http_config"]["http2_protocol_options"]
    epp_limit = parse_settings(
        [*STATIC, "--metrics-endpoint-auth=false"]
    ).max_streams_per_connection
    assert 0 < http2["max_concurrent_streams"] <= 0.8 * epp_limit
