"""The native ext_proc transport (``adapters.envoy.h2``) as an attacker on the network
reaches it: a raw TCP client that frames HTTP/2 by hand, against the server in-process.

Probed: the connection preface and the handshake timeout, frame sizes, header blocks split
over CONTINUATION frames or interrupted, control-frame floods (PING, SETTINGS, WINDOW_UPDATE,
PRIORITY, empty DATA), rapid reset, the stream window of a handler that does not read,
gRPC message limits and compression flags, malformed requests (method, content-type, path),
a peer that never reads what it asked for, ``grpc-timeout``, and the stream and call limits.
Each case asserts what the peer sees (a GOAWAY or RST_STREAM code, a status in the
trailers) and that the server still serves a well-behaved grpc.aio client afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import socket
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import hpack
import pytest

from adapters.envoy.h2 import H2GrpcServer, H2Limits, MethodHandler
from adapters.envoy.h2 import connection as h2connection
from adapters.envoy.h2 import flow as h2flow
from tests.support.h2frames import (
    ACK,
    CANCEL,
    COMPRESSION_ERROR,
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    FLOW_CONTROL_ERROR,
    FRAME_SIZE_ERROR,
    GOAWAY,
    HEADERS,
    INITIAL_WINDOW_SIZE,
    PING,
    PREFACE,
    PRIORITY,
    PROTOCOL_ERROR,
    REFUSED_STREAM,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
    frame,
    message,
    settings,
)

SERVICE = "/test.Echo"
PROCESS = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
MIB = 1 << 20
DEADLINE = 5.0  # seconds any awaited condition may take
STOP_DEADLINE = 3.0  # seconds the server may take to stop, its peers gone


# -- the server --


async def _unary_echo(request: bytes, _: Any) -> bytes:
    return request


async def _stream_echo(_: Any, context: Any) -> None:
    while (message := await context.read()) is not grpc.aio.EOF:
        await context.write(message)


async def _drain(_: Any, context: Any) -> None:
    while await context.read() is not grpc.aio.EOF:
        pass


async def _never_reads(_: Any, context: Any) -> None:
    await asyncio.Event().wait()


async def _inline_echo(_: Any, context: Any) -> None:
    # messages answered in the transport's read, but those that came while the handler
    # was not waiting in read() (before it first did, say)
    inline: list[Any] = []

    def answer(request: Any) -> list[Any]:
        inline.append(request)
        return [request]

    context.inline = answer
    while (request := await context.read()) is not grpc.aio.EOF:
        await context.write(request)
    assert inline, "nothing was answered inline"


async def _breaks_protocol(_: Any, context: Any) -> None:
    # what the ext_proc servicer does with a stream out of its protocol; the message says
    # the longest pause
    longest = float(await context.read())
    context.penalize_peer(longest)
    await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "out of protocol")


def _handler(function: Callable[[Any, Any], Any], *, streaming: bool) -> MethodHandler:
    return MethodHandler(function, bytes, bytes, streaming=streaming)


HANDLERS = {
    f"{SERVICE}/Unary": _handler(_unary_echo, streaming=False),
    f"{SERVICE}/Stream": _handler(_stream_echo, streaming=True),
    f"{SERVICE}/Drain": _handler(_drain, streaming=True),
    f"{SERVICE}/Never": _handler(_never_reads, streaming=True),
    f"{SERVICE}/Inline": _handler(_inline_echo, streaming=True),
    f"{SERVICE}/Break": _handler(_breaks_protocol, streaming=True),
    PROCESS: _handler(_stream_echo, streaming=True),
}


# -- the attacker's client --


class Peer(asyncio.Protocol):
    """A raw HTTP/2 client: records every frame the server sends, decodes header blocks."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.frames: list[tuple[int, int, int, bytes]] = []
        self.blocks: dict[int, list[dict[str, str]]] = {}  # decoded header blocks per stream
        self.ended: set[int] = set()  # streams the server ended (END_STREAM or RST_STREAM)
        self.closed = False
        self.writable = True
        self._buffer = b""
        self._changed = asyncio.Event()
        self._encoder = hpack.Encoder()
        self._decoder = hpack.Decoder()
        self._header_parts: list[bytes] = []

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        while len(self._buffer) >= 9:
            length = int.from_bytes(self._buffer[:3], "big")
            if len(self._buffer) < 9 + length:
                break
            kind, flags = self._buffer[3], self._buffer[4]
            stream_id = int.from_bytes(self._buffer[5:9], "big") & 0x7FFF_FFFF
            payload = self._buffer[9 : 9 + length]
            self._buffer = self._buffer[9 + length :]
            self.frames.append((kind, flags, stream_id, payload))
            if kind in (HEADERS, CONTINUATION):
                self._header_parts.append(payload)
                if flags & END_HEADERS:
                    block = b"".join(self._header_parts)
                    self._header_parts = []
                    decoded = self._decoder.decode(block)
                    headers = {str(name): str(value) for name, value in decoded}
                    self.blocks.setdefault(stream_id, []).append(headers)
            if (kind in (HEADERS, DATA) and flags & END_STREAM) or kind == RST_STREAM:
                self.ended.add(stream_id)
        self._changed.set()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._changed.set()

    def pause_writing(self) -> None:
        self.writable = False
        self._changed.set()

    def resume_writing(self) -> None:
        self.writable = True
        self._changed.set()

    # sending

    def send(self, data: bytes) -> None:
        assert self.transport is not None
        if not self.transport.is_closing():
            self.transport.write(data)

    def request(
        self,
        stream_id: int,
        path: str | bytes = f"{SERVICE}/Stream",
        *,
        method: str = "POST",
        content_type: str | None = "application/grpc",
        extra: tuple[tuple[str, str], ...] = (),
        end_stream: bool = False,
    ) -> bytes:
        """A HEADERS frame opening a gRPC call (returned, not sent)."""
        headers: list[tuple[str | bytes, str | bytes]] = [(":method", method), (":scheme", "http")]
        headers += [(":path", path), (":authority", "x")]
        if content_type is not None:
            headers.append(("content-type", content_type))
        headers += [("te", "trailers"), *extra]
        flags = END_HEADERS | (END_STREAM if end_stream else 0)
        return frame(HEADERS, flags, stream_id, self._encoder.encode(headers))

    def close(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    # what the server sent

    async def until(self, predicate: Callable[[], Any], within: float = DEADLINE) -> Any:
        """Waits for ``predicate()`` to be truthy (re-checked as frames arrive); returns it."""
        async with asyncio.timeout(within):
            while not (result := predicate()):
                self._changed.clear()
                await self._changed.wait()
        return result

    def of(self, kind: int, stream_id: int | None = None) -> list[tuple[int, int, int, bytes]]:
        return [f for f in self.frames if f[0] == kind and stream_id in (None, f[2])]

    def goaway(self) -> int | None:
        """The error code of the server's GOAWAY, None before one."""
        frames = self.of(GOAWAY)
        return int.from_bytes(frames[-1][3][4:8], "big") if frames else None

    def reset(self, stream_id: int) -> int | None:
        """The error code of the server's RST_STREAM on the stream, None before one."""
        frames = self.of(RST_STREAM, stream_id)
        return int.from_bytes(frames[-1][3], "big") if frames else None

    def trailers(self, stream_id: int) -> dict[str, str] | None:
        """The stream's last header block once the server has ended it."""
        if stream_id in self.ended and self.blocks.get(stream_id):
            return self.blocks[stream_id][-1]
        return None

    async def status(self, stream_id: int) -> str:
        trailers = await self.until(lambda: self.trailers(stream_id))
        return str(trailers.get("grpc-status", f"http {trailers.get(':status')}"))

    async def goaway_code(self) -> int:
        await self.until(lambda: self.goaway() is not None)
        code = self.goaway()
        assert code is not None
        return code

    async def ping(self, data: bytes = b"probe\x00\x00\x00") -> None:
        """A PING, answered once the server has handled everything sent before it (or the
        connection closed)."""
        self.send(frame(PING, 0, 0, data))
        await self.until(
            lambda: self.closed or any(f[1] & ACK and f[3] == data for f in self.of(PING))
        )


class Harness:
    def __init__(self, server: H2GrpcServer, port: int) -> None:
        self.server = server
        self.port = port
        self.peers: list[Peer] = []

    async def connect(self, *, preface: bool = True, receive_buffer: int = 0) -> Peer:
        loop = asyncio.get_running_loop()
        sock = socket.socket()
        sock.setblocking(False)
        # no Nagle: a frame written after a small one leaves at once, as a gateway's does
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if receive_buffer:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        await loop.sock_connect(sock, ("127.0.0.1", self.port))
        _, peer = await loop.create_connection(Peer, sock=sock)
        self.peers.append(peer)
        if preface:
            peer.send(PREFACE + settings())
        return peer

    async def assert_serves(self) -> None:
        """A well-behaved grpc.aio client, on a new connection, gets its echo."""
        async with grpc.aio.insecure_channel(f"127.0.0.1:{self.port}") as channel:
            call: Any = channel.unary_unary(f"{SERVICE}/Unary")
            assert await call(b"still serving", timeout=DEADLINE) == b"still serving"

    async def no_calls(self, within: float = DEADLINE) -> None:
        """Waits for the server's call count to return to 0."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(within):
                await self.server.no_calls.wait()
        assert not self.server.active_calls, f"{self.server.active_calls} calls still counted"


async def _until(condition: Callable[[], bool], within: float = DEADLINE) -> None:
    """Waits for a condition no frame signals (the server's own state)."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > within:
            raise AssertionError(f"not within {within}s")
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def serving(**options: Any) -> AsyncIterator[Harness]:
    server = H2GrpcServer(HANDLERS, limits=H2Limits(**options))
    harness = Harness(server, await server.start("127.0.0.1", 0))
    try:
        yield harness
    except BaseException:
        # the test failed: stop what can be stopped, quickly, and report the failure
        for peer in harness.peers:
            peer.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(server.stop(0), 0.2)
        raise
    for peer in harness.peers:
        peer.close()
    await asyncio.wait_for(server.stop(0), STOP_DEADLINE)


async def _expect_goaway(peer: Peer, code: int) -> None:
    assert await peer.goaway_code() == code, peer.frames[-3:]
    await peer.until(lambda: peer.closed)


# -- the connection preface and the handshake --


@pytest.mark.parametrize(
    "opening",
    [
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",  # HTTP/1.1
        b"PRI * HTTP/2.0\r\n\r\nXX\r\n\r\n",  # the preface's length, wrong at the end
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",  # a TLS ClientHello on the plain port
    ],
    ids=["http1", "almost-preface", "tls"],
)
async def test_a_wrong_preface_is_a_goaway_protocol_error(opening: bytes) -> None:
    async with serving() as harness:
        peer = await harness.connect(preface=False)
        peer.send(opening)
        # before: nothing; after: GOAWAY PROTOCOL_ERROR and the connection closed
        await _expect_goaway(peer, PROTOCOL_ERROR)
        await harness.assert_serves()


@pytest.mark.parametrize("opening", [b"", PREFACE[:10]], ids=["nothing", "half-preface"])
async def test_a_connection_without_a_preface_is_closed_after_the_handshake_timeout(
    opening: bytes,
) -> None:
    async with serving(handshake_timeout=0.3) as harness:
        polite = await harness.connect()
        silent = await harness.connect(preface=False)
        silent.send(opening)
        started = time.monotonic()
        # the connection that says nothing (or half the preface) is closed by the server...
        await silent.until(lambda: silent.closed)
        assert time.monotonic() - started < 3.0
        await _until(lambda: len(harness.server.connections) == 1)
        # ... and the one that sent its preface, as old, is still served
        assert not polite.closed
        await polite.ping()
        await harness.assert_serves()


# -- frames and header blocks --


@pytest.mark.parametrize(
    "oversized",
    [
        frame(DATA, 0, 1, b"x" * 16_385),
        (1 << 24 - 1).to_bytes(3, "big") + bytes((DATA, 0)) + (1).to_bytes(4, "big"),
    ],
    ids=["16385-bytes", "16-MiB-header-only"],
)
async def test_a_frame_beyond_16384_bytes_is_a_goaway_frame_size_error(oversized: bytes) -> None:
    async with serving() as harness:
        peer = await harness.connect()
        peer.send(oversized)
        # the 16 MiB header alone is enough: the server does not wait for (or buffer) the payload
        await _expect_goaway(peer, FRAME_SIZE_ERROR)
        await harness.assert_serves()


@pytest.mark.parametrize(
    "flood",
    [
        frame(PING, 0, 0, b"12345678"),
        frame(SETTINGS, 0, 0),
        frame(WINDOW_UPDATE, 0, 0, (1).to_bytes(4, "big")),
        frame(PRIORITY, 0, 3, (0).to_bytes(4, "big") + b"\x10"),
        frame(DATA, 0, 1),  # empty DATA on an open stream
    ],
    ids=["ping", "settings", "window-update", "priority", "empty-data"],
)
async def test_a_control_frame_flood_is_a_goaway_enhance_your_calm(flood: bytes) -> None:
    async with serving() as harness:
        peer = await harness.connect()
        peer.send(peer.request(1, f"{SERVICE}/Never"))
        await peer.ping()  # the call has started
        peer.send(flood * 5_000)
        # before: 5,000 frames each answered or handled; after: the budget (1,000) ends it
        await _expect_goaway(peer, ENHANCE_YOUR_CALM)
        assert len(peer.of(PING)) <= 1_000
        await harness.no_calls()
        await harness.assert_serves()


def _rst(stream_id: int, code: int = CANCEL) -> bytes:
    return frame(RST_STREAM, 0, stream_id, code.to_bytes(4, "big"))


async def test_rapid_reset_is_a_goaway_enhance_your_calm() -> None:
    async with serving() as harness:
        peer = await harness.connect()
        # 1,000 streams opened and reset at once, each call started before its reset
        for stream_id in range(1, 2_000, 2):
            peer.send(peer.request(stream_id, f"{SERVICE}/Never"))
            await peer.ping(stream_id.to_bytes(8, "big"))
            peer.send(_rst(stream_id))
            if peer.closed:
                break
        # before: every stream a handler started and cancelled; after: asked to go away past
        # 200 resets of streams not yet answered, and refused from the final GOAWAY on
        await _expect_goaway(peer, ENHANCE_YOUR_CALM)
        # the final GOAWAY (the first names no last stream) says which streams were served
        last = int.from_bytes(peer.of(GOAWAY)[1][3][:4], "big")
        assert harness.server.calls_started == (last + 1) // 2 < 1_000
        await harness.no_calls()
        await harness.assert_serves()


def _closed_or_echoed(peer: Peer, streams: range) -> bool:
    return peer.closed or all(_echoed(peer, s) for s in streams)


async def test_streams_reset_after_they_were_answered_do_not_end_the_connection() -> None:
    # What Envoy does without ext_proc_graceful_grpc_close when its clients hang up: the
    # stream of every abandoned request is reset, after the EPP has answered it
    async with serving() as harness:
        peer = await harness.connect()
        for batch in range(8):  # 400 streams, 50 at a time: each answered, then reset
            streams = range(1 + 100 * batch, 101 + 100 * batch, 2)
            peer.send(
                b"".join(peer.request(s) + frame(DATA, 0, s, message(b"chunk")) for s in streams)
            )
            await peer.until(functools.partial(_closed_or_echoed, peer, streams))
            assert not peer.closed, f"cut after {50 * batch} resets: GOAWAY {peer.goaway()}"
            peer.send(b"".join(_rst(s) for s in streams))
        await peer.ping()
        # before: past 200 resets outnumbering completions, GOAWAY ENHANCE_YOUR_CALM and every
        # call on the connection failed; after: nothing to cut, the connection serves on
        assert peer.goaway() is None
        assert not peer.closed
        peer.send(
            peer.request(801, f"{SERVICE}/Unary") + frame(DATA, END_STREAM, 801, message(b"ok"))
        )
        assert await peer.status(801) == "0"
        await harness.no_calls()


async def test_rapid_reset_lets_the_calls_open_finish() -> None:
    async with serving() as harness:
        peer = await harness.connect()
        # a call in progress: answered once, more to come
        peer.send(peer.request(1) + frame(DATA, 0, 1, message(b"first")))
        await peer.until(lambda: _echoed(peer, 1))
        # then streams opened and reset before they are answered, 400 in one write
        peer.send(b"".join(peer.request(s, f"{SERVICE}/Never") + _rst(s) for s in range(3, 803, 2)))
        assert await peer.goaway_code() == ENHANCE_YOUR_CALM
        # the GOAWAY's PING answered: the final GOAWAY names the last stream the peer opened
        (ping,) = [f for f in peer.of(PING) if not f[1] & ACK]
        peer.send(frame(PING, ACK, 0, ping[3]))
        await peer.until(lambda: len(peer.of(GOAWAY)) == 2)
        assert int.from_bytes(peer.of(GOAWAY)[-1][3][:4], "big") == 801
        # before: the connection closed at once, the call in progress failed with it;
        # after: it finishes, then the connection closes
        peer.send(frame(DATA, 0, 1, message(b"second")))
        await peer.until(lambda: _echoed(peer, 1) == message(b"first") + message(b"second"))
        peer.send(frame(DATA, END_STREAM, 1))
        assert await peer.status(1) == "0"
        # a stream opened after the final GOAWAY is refused, not served
        peer.send(peer.request(803, f"{SERVICE}/Unary"))
        await peer.until(lambda: peer.reset(803) is not None or peer.closed)
        assert peer.reset(803) in (None, REFUSED_STREAM)
        assert harness.server.calls_started == 401
        await peer.until(lambda: peer.closed)
        await harness.no_calls()
        await harness.assert_serves()


async def test_a_call_ended_in_the_read_that_opened_it_is_not_counted_for_ever() -> None:
    endings = [
        _rst(1),
        frame(DATA, 0, 1, b"\x00\xff\xff\xff\xff"),  # past max_receive_message_length
        frame(DATA, END_STREAM, 1, message(b"z", 1)),  # compressed
        frame(DATA, 0, 1, b"x" * 16_385),  # a connection error
        frame(PING, 0, 0),  # another
    ]
    async with serving(max_concurrent_rpcs=len(endings)) as harness:
        for ending in endings:
            peer = await harness.connect()
            # the HEADERS and what ends the call in one write (Envoy sends a request's
            # HEADERS and DATA together): the call is over before its task has run
            peer.send(peer.request(1, f"{SERVICE}/Never") + ending)
            await peer.ping()  # answered after the reset or the status; or closed
        # before: each still counted, so past max_concurrent_rpcs every call is refused
        # RESOURCE_EXHAUSTED, and stop() waits for them for ever; after: back to 0
        await harness.no_calls(within=0.5)
        await harness.assert_serves()


async def test_rapid_reset_in_one_write_leaves_no_call_behind() -> None:
    async with serving() as harness:
        peer = await harness.connect()
        peer.send(
            b"".join(
                peer.request(stream_id, f"{SERVICE}/Never") + _rst(stream_id)
                for stream_id in range(1, 2_000, 2)
            )
        )
        await _expect_goaway(peer, ENHANCE_YOUR_CALM)
        await harness.no_calls(within=0.5)
        await harness.assert_serves()


@pytest.mark.parametrize(
    ("part", "count"), [(b"\x00" * 16_384, 10), (b"\x00", 70_000)], ids=["16-KiB", "1-byte"]
)
async def test_endless_continuation_frames_are_a_connection_error(part: bytes, count: int) -> None:
    async with serving() as harness:
        peer = await harness.connect()
        block = peer.request(1)[9:]
        # a HEADERS without END_HEADERS, then CONTINUATIONs that never end the block
        peer.send(frame(HEADERS, 0, 1, block) + frame(CONTINUATION, 0, 1, part) * count)
        # before: the block held until the peer stops; after: cut at 64 KiB (compressed)
        await _expect_goaway(peer, ENHANCE_YOUR_CALM)
        await harness.assert_serves()


async def test_endless_empty_continuation_frames_are_a_connection_error() -> None:
    async with serving() as harness:
        peer = await harness.connect()
        block = peer.request(1)[9:]
        # 200,000 empty CONTINUATIONs (1.8 MB); a CONTINUATION flood, as CVE-2024-27316
        peer.send(frame(HEADERS, 0, 1, block) + frame(CONTINUATION, 0, 1) * 200_000)
        # a connection error, some time within the flood: the block's budget is spent
        await peer.until(lambda: peer.goaway() is not None or peer.closed, within=1.5)


@pytest.mark.parametrize(
    "interruption",
    [
        frame(PING, 0, 0, b"12345678"),
        frame(DATA, 0, 1, message(b"x")),
        frame(HEADERS, END_HEADERS, 3, b""),
        frame(CONTINUATION, END_HEADERS, 3, b""),  # a CONTINUATION of another stream
    ],
    ids=["ping", "data", "headers", "continuation-of-another-stream"],
)
async def test_a_header_block_interrupted_is_a_goaway_protocol_error(interruption: bytes) -> None:
    async with serving() as harness:
        peer = await harness.connect()
        block = peer.request(1)[9:]
        peer.send(frame(HEADERS, 0, 1, block[:5]) + interruption)
        # before: the block's two halves joined across the frame; after: PROTOCOL_ERROR
        await _expect_goaway(peer, PROTOCOL_ERROR)
        await harness.assert_serves()


async def test_a_continuation_without_headers_is_a_goaway_protocol_error() -> None:
    async with serving() as harness:
        peer = await harness.connect()
        peer.send(frame(CONTINUATION, END_HEADERS, 1, peer.request(1)[9:]))
        await _expect_goaway(peer, PROTOCOL_ERROR)
        await harness.assert_serves()


# -- flow control: a handler that does not read bounds what the peer may send --


def _window_updates(peer: Peer, stream_id: int) -> int:
    return sum(int.from_bytes(f[3], "big") for f in peer.of(WINDOW_UPDATE, stream_id))


async def test_a_handler_that_does_not_read_gets_no_more_than_its_window() -> None:
    assert h2flow.STREAM_WINDOW % 16_384 == 0
    async with serving() as harness:
        peer = await harness.connect()
        # the stream's whole window in 16 KiB DATA frames, one message each, to a handler
        # that never reads them
        peer.send(peer.request(1, f"{SERVICE}/Never"))
        full = frame(DATA, 0, 1, message(b"m" * (16_384 - 5)))
        peer.send(full * (h2flow.STREAM_WINDOW // 16_384))
        await peer.ping()
        # nothing read, nothing credited back: the peer may send no more on this stream
        assert _window_updates(peer, 1) == 0
        assert peer.reset(1) is None
        # one byte past the window: before, buffered; after, RST_STREAM FLOW_CONTROL_ERROR
        peer.send(frame(DATA, 0, 1, b"x"))
        await peer.until(lambda: peer.reset(1) is not None)
        assert peer.reset(1) == FLOW_CONTROL_ERROR
        await harness.no_calls()
        # the connection is still good: a call on a new stream of it is served
        peer.send(peer.request(3, f"{SERVICE}/Unary") + frame(DATA, END_STREAM, 3, message(b"hi")))
        assert await peer.status(3) == "0"
        assert peer.of(DATA, 3)[0][3] == message(b"hi")
        await harness.assert_serves()


async def test_a_handler_that_reads_returns_the_window() -> None:
    # the control: the same data to a handler that reads is credited back as it is read
    async with serving() as harness:
        peer = await harness.connect()
        peer.send(peer.request(1, f"{SERVICE}/Drain"))
        full = frame(DATA, 0, 1, message(b"m" * (16_384 - 5)))
        for _ in range(3):
            peer.send(full * (h2flow.STREAM_WINDOW // 16_384))
            await peer.until(lambda: _window_updates(peer, 1) >= h2flow.STREAM_WINDOW // 2)
        assert peer.reset(1) is None
        peer.send(frame(DATA, END_STREAM, 1))
        assert await peer.status(1) == "0"


# -- messages answered inline (RpcContext.inline) --


def _echoed(peer: Peer, stream_id: int) -> bytes:
    return b"".join(f[3] for f in peer.of(DATA, stream_id))


async def test_messages_answered_inline_come_back_in_order() -> None:
    async with serving() as harness:
        peer = await harness.connect()
        sent = [message(b"m%d" % n) for n in range(200)]
        peer.send(peer.request(1, f"{SERVICE}/Inline"))
        await peer.ping()  # the handler waits in read()
        peer.send(b"".join(frame(DATA, 0, 1, m) for m in sent[:100]))
        peer.send(frame(DATA, 0, 1, b"".join(sent[100:])))  # many messages in one frame
        peer.send(frame(DATA, END_STREAM, 1))
        assert await peer.status(1) == "0"
        assert _echoed(peer, 1) == b"".join(sent)


async def test_inline_answers_a_peer_does_not_take_stop_its_stream() -> None:
    # The peer opens no window for the answers: the first ones fill it, the next waits in
    # the handler, and the messages after it are neither answered nor credited back, so
    # the peer can send no more than one stream window beyond what was answered.
    async with serving() as harness:
        peer = await harness.connect()
        size = 16_384 - 5
        sent = [message(bytes([65 + n % 26]) * size) for n in range(h2flow.STREAM_WINDOW // 16_384)]
        peer.send(peer.request(1, f"{SERVICE}/Inline"))
        await peer.ping()  # the handler waits in read()
        peer.send(b"".join(frame(DATA, 0, 1, m) for m in sent))
        await peer.ping(b"all sent")
        answered = len(_echoed(peer, 1))
        assert answered <= 65_535  # the peer's window for the answers
        # before the back-pressure: every message credited back as answered (or buffered)
        assert _window_updates(peer, 1) <= answered + 16_384
        assert peer.reset(1) is None
        # the peer opens its windows: the rest is answered, in order
        grant = (64 * MIB).to_bytes(4, "big")
        peer.send(frame(WINDOW_UPDATE, 0, 0, grant) + frame(WINDOW_UPDATE, 0, 1, grant))
        peer.send(frame(DATA, END_STREAM, 1))
        assert await peer.status(1) == "0"
        assert _echoed(peer, 1) == b"".join(sent)
        await harness.assert_serves()


# -- gRPC messages --


@pytest.mark.parametrize(
    "data",
    [
        frame(DATA, 0, 1, message(b"x" * 1_025)),
        frame(DATA, 0, 1, message(b"x" * 500)[:505] + b"\x00" + (1025).to_bytes(4, "big")),
        frame(DATA, 0, 1, b"\x00\xff\xff\xff\xff"),  # 4 GiB declared, 5 bytes sent
    ],
    ids=["1025-bytes", "second-message-1025", "declared-4-GiB"],
)
async def test_a_message_beyond_max_receive_message_length_is_resource_exhausted(
    data: bytes,
) -> None:
    async with serving(max_receive_message_length=1_024) as harness:
        peer = await harness.connect()
        peer.send(peer.request(1))
        await peer.ping()  # the call has started
        peer.send(data)
        # before: buffered until whole; after: grpc-status 8 in the trailers, once declared
        assert await peer.status(1) == "8"
        assert not [f for f in peer.of(DATA, 1) if len(f[3]) > 1_029]
        await harness.no_calls()
        # a message of the limit exactly is served
        peer.send(peer.request(3) + frame(DATA, END_STREAM, 3, message(b"y" * 1_024)))
        assert await peer.status(3) == "0"
        await harness.assert_serves()


@pytest.mark.parametrize(
    ("flag", "extra", "status"),
    [
        (1, (), "12"),  # compressed, though grpc-encoding says identity
        (1, (("grpc-encoding", "identity"),), "12"),
        (0x80, (), "13"),  # a flag byte gRPC does not define
        (0, (("grpc-encoding", "gzip"),), "12"),
    ],
    ids=["compressed", "compressed-identity", "bad-flag", "gzip-encoding"],
)
async def test_a_compressed_message_is_an_error_status(
    flag: int, extra: tuple[tuple[str, str], ...], status: str
) -> None:
    async with serving() as harness:
        peer = await harness.connect()
        peer.send(peer.request(1, extra=extra))
        await peer.ping()
        peer.send(frame(DATA, END_STREAM, 1, message(b"\x1f\x8b", flag)))
        # before: a handler fed bytes it cannot read (or a crash); after: an error status
        assert await peer.status(1) == status
        assert not peer.of(DATA, 1)
        await harness.no_calls()
        await harness.assert_serves()


# -- requests that are not gRPC calls --


@pytest.mark.parametrize("end_stream", [True, False], ids=["half-closed", "open"])
@pytest.mark.parametrize(
    ("request_options", "status"),
    [
        ({"path": f"{SERVICE}/Missing"}, "12"),
        ({"method": "GET"}, "http 405"),
        ({"method": "PUT"}, "http 405"),
        ({"content_type": None}, "http 415"),
        ({"content_type": "application/json"}, "http 415"),
    ],
    # (an empty :path is a malformed request: test_h2_conformance.py)
    ids=["unknown-method", "get", "put", "no-content-type", "json"],
)
async def test_a_request_that_is_not_a_served_call_is_refused(
    request_options: dict[str, Any], status: str, end_stream: bool
) -> None:
    async with serving() as harness:
        peer = await harness.connect()
        peer.send(peer.request(1, **request_options, end_stream=end_stream))
        # open: the answer waits for the peer's END_STREAM, or at most _PARK_DELAY
        assert await peer.status(1) == status
        assert not harness.server.active_calls
        await harness.assert_serves()


# -- a peer that never reads what it asks for --


async def _push_unread_requests(harness: Harness, path: str | bytes) -> tuple[int, int]:
    """Sends requests answered at once (trailers only, with END_STREAM), up to 50 MB, on a
    connection whose answers are never read; returns the bytes sent and the largest write
    buffer seen on the server's side. Stops early once the server has stopped reading (or
    its buffer has passed ``4 * BOUND``)."""
    # a small receive buffer: the server meets the peer that does not read sooner
    peer = await harness.connect(receive_buffer=4_096)
    await peer.ping()
    assert peer.transport is not None
    peer.transport.pause_reading()  # never read again
    (connection,) = harness.server.connections
    peer.send(peer.request(1, path, end_stream=True))
    block = peer.request(3, path, end_stream=True)[9:]  # the same headers, now all indexed
    stream_id, sent, peak = 3, 0, 0
    async with asyncio.timeout(DEADLINE):
        while sent < 50 * MIB and peak < 4 * BOUND:
            peak = max(peak, connection.write_buffer_size())
            if not peer.writable:
                if not connection.reading():
                    break  # the server stopped reading: the peer can push no more
                await asyncio.sleep(0.005)
                continue
            batch = b"".join(
                frame(HEADERS, END_HEADERS | END_STREAM, stream_id + 2 * n, block)
                for n in range(2_000)
            )
            stream_id += 4_000
            peer.send(batch)
            sent += len(batch)
            await asyncio.sleep(0)
    return sent, peak


BOUND = 4 * MIB  # what the server may hold for a peer that does not read


async def test_a_peer_that_never_reads_stops_being_read() -> None:
    async with serving() as harness:
        sent, peak = await _push_unread_requests(harness, f"{SERVICE}/Missing")
        # before: every request answered into the transport's buffer, 50 MB of requests
        # into hundreds of MB held; after: the server stops reading once its buffer is full
        assert sent < 50 * MIB
        assert peak < BOUND, f"{peak / MIB:.1f} MiB held for a peer that does not read"
        await harness.assert_serves()


async def test_a_peer_that_never_reads_cannot_amplify_what_is_held() -> None:
    async with serving() as harness:
        # a :path of 3,800 bytes 0xFF, indexed: 15 bytes a request, 23 KB an answer
        sent, peak = await _push_unread_requests(harness, b"/" + b"\xff" * 3_800)
        assert peak < BOUND, f"{peak / MIB:.1f} MiB held for {sent / MIB:.1f} MiB sent"


# -- deadlines and limits --


@pytest.mark.parametrize("end_stream", [True, False], ids=["half-closed", "open"])
async def test_grpc_timeout_ends_a_call_whose_handler_waits_for_ever(end_stream: bool) -> None:
    async with serving() as harness:
        peer = await harness.connect()
        started = time.monotonic()
        timeout = (("grpc-timeout", "100m"),)
        peer.send(peer.request(1, f"{SERVICE}/Never", extra=timeout, end_stream=end_stream))
        # before: the call held as long as the peer keeps the stream; after: DEADLINE_EXCEEDED
        assert await peer.status(1) == "4"
        assert time.monotonic() - started >= 0.1
        await harness.no_calls()
        await harness.assert_serves()


def _advertised(peer: Peer, setting: int) -> int | None:
    for kind, flags, _, payload in peer.frames:
        if kind == SETTINGS and not flags & ACK:
            for offset in range(0, len(payload), 6):
                if int.from_bytes(payload[offset : offset + 2], "big") == setting:
                    return int.from_bytes(payload[offset + 2 : offset + 6], "big")
    return None


async def test_a_stream_beyond_max_streams_per_connection_is_refused() -> None:
    async with serving(max_streams_per_connection=2) as harness:
        peer = await harness.connect()
        peer.send(peer.request(1, f"{SERVICE}/Never") + peer.request(3, f"{SERVICE}/Never"))
        await peer.ping()
        assert _advertised(peer, 0x3) == 2  # SETTINGS_MAX_CONCURRENT_STREAMS
        # a third stream, past the limit the server advertised: REFUSED_STREAM
        peer.send(peer.request(5, f"{SERVICE}/Never"))
        await peer.until(lambda: peer.reset(5) is not None)
        assert peer.reset(5) == REFUSED_STREAM
        assert harness.server.active_calls == 2
        # one of the two reset by the peer: a new stream is served again
        peer.send(_rst(1))
        await peer.ping()
        peer.send(peer.request(7, f"{SERVICE}/Unary") + frame(DATA, END_STREAM, 7, message(b"ok")))
        assert await peer.status(7) == "0"
        assert peer.reset(7) is None
        await harness.assert_serves()


async def test_a_call_beyond_max_concurrent_rpcs_is_resource_exhausted() -> None:
    async with serving(max_concurrent_rpcs=1) as harness:
        peer = await harness.connect()
        peer.send(peer.request(1, f"{SERVICE}/Never"))
        await peer.ping()
        # a second call, on the same connection or through grpc.aio: RESOURCE_EXHAUSTED
        peer.send(peer.request(3, f"{SERVICE}/Never", end_stream=True))
        assert await peer.status(3) == "8"
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await harness.assert_serves()
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # the first call over: served again
        peer.send(_rst(1))
        await harness.no_calls()
        await harness.assert_serves()


# -- header blocks a gateway repeats --


async def test_a_repeated_header_block_is_decoded_against_the_table_as_it_is_now() -> None:
    # A gateway sends the same bytes for every stream's HEADERS, all indexed in HPACK's
    # dynamic table, and the server keeps what they decoded to. Once a block changes the
    # table, the same bytes name other entries: what was kept must not be used.
    mirror = hpack.Decoder()  # decodes what the server is sent, as a fresh peer would

    def path_of(headers_frame: bytes) -> bytes:
        return dict(mirror.decode(headers_frame[9:], raw=True))[b":path"]

    async with serving() as harness:
        peer = await harness.connect()
        unary = f"{SERVICE}/Unary"
        for stream_id in (1, 3, 5):  # the first adds the entries, the next two only index
            opening = peer.request(stream_id, unary)
            assert path_of(opening) == unary.encode()
            peer.send(opening + frame(DATA, END_STREAM, stream_id, message(b"hi")))
            assert await peer.status(stream_id) == "0"
        repeated = opening[9:]
        # a block that adds an entry: every dynamic index moves by one
        moved = peer.request(7, f"{SERVICE}/Missing")
        assert path_of(moved) == f"{SERVICE}/Missing".encode()
        peer.send(moved + frame(DATA, END_STREAM, 7, message(b"hi")))
        assert await peer.status(7) == str(grpc.StatusCode.UNIMPLEMENTED.value[0])
        # the same bytes as streams 3 and 5 now decode to another :path
        again = frame(HEADERS, END_HEADERS, 9, repeated)
        now = path_of(again)
        assert now != unary.encode()
        peer.send(again + frame(DATA, END_STREAM, 9, message(b"hi")))
        # before: a stale copy would have served it as Unary ("0"); the headers it now
        # decodes to are not a well-formed request (a reset) or name no method served
        await peer.until(lambda: peer.reset(9) is not None or peer.trailers(9))
        if peer.reset(9) is None:
            assert await peer.status(9) == str(grpc.StatusCode.UNIMPLEMENTED.value[0])
        assert not peer.of(DATA, 9)
        await harness.assert_serves()


# -- a peer that breaks the protocol of its calls (RpcContext.penalize_peer) --

FAILED_PRECONDITION = str(grpc.StatusCode.FAILED_PRECONDITION.value[0])


def _break(peer: Peer, stream_id: int, longest: float) -> None:
    peer.send(
        peer.request(stream_id, f"{SERVICE}/Break")
        + frame(DATA, END_STREAM, stream_id, message(str(longest).encode()))
    )


async def test_a_connection_that_broke_a_call_is_not_read_while_others_are_served(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(h2connection, "PENALTY_FIRST", 3600.0)  # the pause outlasts the test
    async with serving() as harness:
        peer = await harness.connect()
        _break(peer, 1, 3600.0)
        assert await peer.status(1) == FAILED_PRECONDITION
        peer.send(frame(PING, 0, 0, b"paused?\x00"))
        peer.send(peer.request(3, f"{SERVICE}/Stream") + frame(DATA, END_STREAM, 3, message(b"x")))
        await harness.assert_serves()  # another connection, served meanwhile
        await harness.assert_serves()
        assert not any(f[1] & ACK and f[3] == b"paused?\x00" for f in peer.of(PING))
        assert peer.trailers(3) is None
        assert not peer.closed


async def test_a_paused_connection_is_read_again_when_the_pause_ends() -> None:
    async with serving() as harness:
        peer = await harness.connect()
        _break(peer, 1, 0.05)
        assert await peer.status(1) == FAILED_PRECONDITION
        # sent while the connection is paused: served after it
        peer.send(peer.request(3, f"{SERVICE}/Stream") + frame(DATA, 0, 3, message(b"later")))
        peer.send(frame(DATA, END_STREAM, 3))
        assert await peer.status(3) == "0"
        assert _echoed(peer, 3) == message(b"later")
        assert harness.server.active_calls == 0


async def test_no_pause_when_the_longest_is_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(h2connection, "PENALTY_FIRST", 3600.0)
    async with serving() as harness:
        peer = await harness.connect()
        _break(peer, 1, 0.0)
        assert await peer.status(1) == FAILED_PRECONDITION
        await peer.ping()  # answered: the connection is read
        peer.send(peer.request(3, f"{SERVICE}/Stream") + frame(DATA, END_STREAM, 3, message(b"x")))
        assert await peer.status(3) == "0"


def test_a_hosts_strikes_count_in_a_row_and_are_forgotten() -> None:
    server = H2GrpcServer(HANDLERS)
    assert [server.strike("10.0.0.1", t) for t in (0.0, 1.0, 2.0)] == [1, 2, 3]
    assert server.strike("10.0.0.2", 2.0) == 1  # another host: its own count
    # a strike within the forget window of the last one continues the count
    assert server.strike("10.0.0.1", 2.0 + h2connection.PENALTY_FORGET - 1) == 4
    # none for that long: forgotten
    assert server.strike("10.0.0.1", 3.0 + 2 * h2connection.PENALTY_FORGET) == 1
    # the hosts kept are bounded: the one struck longest ago is forgotten first
    for n in range(h2connection.PENALTY_HOSTS):
        server.strike(f"h{n}", 100.0)
    assert server.strike("10.0.0.2", 101.0) == 1
    assert server.strike(f"h{h2connection.PENALTY_HOSTS - 1}", 101.0) == 2


# -- work a connection can make us do: floods from one connection, normal traffic beside --

NORMAL_P99 = 0.050  # seconds


async def _normal_p99_during(harness: Harness, attack: Callable[[], Any], *, rounds: int) -> float:
    """Runs ``attack`` ``rounds`` times (each a connection of its own, flooded until the
    server cuts it or the round's floods are sent) while a well-behaved grpc.aio client calls
    back to back on another connection; returns the p99 latency of the calls made meanwhile
    (at least 10: the last calls wait for them)."""
    latencies: list[float] = []
    # Collections over the test session's own heap (every test collected so far) are not
    # the flood's work: what is allocated from here on is still collected.
    gc.collect()
    gc.freeze()

    async def attacker() -> None:
        for _ in range(rounds):
            await attack()

    async with grpc.aio.insecure_channel(f"127.0.0.1:{harness.port}") as channel:
        call: Any = channel.unary_unary(f"{SERVICE}/Unary")
        assert await call(b"warm", timeout=DEADLINE) == b"warm"
        flooding = asyncio.create_task(attacker())
        try:
            async with asyncio.timeout(60):
                while not flooding.done() or len(latencies) < 10:
                    started = time.monotonic()
                    assert await call(b"normal", timeout=DEADLINE) == b"normal"
                    latencies.append(time.monotonic() - started)
        finally:
            flooding.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await flooding
            gc.unfreeze()
    latencies.sort()
    return latencies[int(len(latencies) * 0.99)]


async def _flood(harness: Harness, opening: bytes, floods: list[bytes]) -> Peer:
    """A connection that sends ``opening``, then each of ``floods`` once the server has
    handled the last (a PING answered), until the server closes it."""
    peer = await harness.connect()
    peer.send(opening)
    for n, flood in enumerate(floods):
        if peer.closed:
            break
        peer.send(flood)
        await peer.ping(n.to_bytes(8, "big"))
    peer.close()
    return peer


def _in_frames(kind: int, flags: int, stream_id: int, block: bytes) -> bytes:
    """A header block as a HEADERS frame and CONTINUATIONs of 16 KiB."""
    parts = [block[i : i + 16_384] for i in range(0, len(block), 16_384)]
    frames = [frame(kind, 0 if len(parts) > 1 else flags, stream_id, parts[0])]
    for index, part in enumerate(parts[1:], start=2):
        last = index == len(parts)
        frames.append(frame(CONTINUATION, flags if last else 0, stream_id, part))
    return b"".join(frames)


@pytest.mark.timed
async def test_a_flood_of_table_size_updates_leaves_normal_traffic_on_time() -> None:
    # RFC 7541 4.2: at most two size updates at the start of a block. A block of 65,400
    # one-byte updates fits the 64 KiB block cap and took 60-170 ms to decode.
    async with serving() as harness:
        flood = _in_frames(HEADERS, END_HEADERS | END_STREAM, 1, b"\x20" * 65_400)

        async def attack() -> None:
            peer = await _flood(harness, b"", [flood])
            # before: decoded and answered (405); after: GOAWAY COMPRESSION_ERROR
            assert peer.goaway() in (None, COMPRESSION_ERROR)

        p99 = await _normal_p99_during(harness, attack, rounds=20)
        assert p99 < NORMAL_P99, f"p99 {p99 * 1000:.0f} ms during 20 connections' floods"
        # two updates at the start are allowed
        peer = await harness.connect()
        peer.send(frame(HEADERS, END_HEADERS, 1, b"\x20\x3f\xe1\x1f" + peer.request(1)[9:]))
        peer.send(frame(DATA, END_STREAM, 1, message(b"x")))
        assert await peer.status(1) == "0"
        peer = await harness.connect()
        peer.send(frame(HEADERS, END_HEADERS, 1, b"\x20\x20\x20" + peer.request(1)[9:]))
        assert await peer.goaway_code() == COMPRESSION_ERROR


@pytest.mark.timed
async def test_a_flood_of_window_settings_leaves_normal_traffic_on_time() -> None:
    # SETTINGS of 2,730 INITIAL_WINDOW_SIZE entries (16 KiB) over 100 open streams: 273,000
    # window changes a frame. Now at most 32 entries a frame, the window applied once.
    async with serving() as harness:
        streams = b"".join(
            frame(HEADERS, END_HEADERS, s, Peer().request(s, f"{SERVICE}/Never")[9:])
            for s in range(1, 201, 2)
        )
        entries = [(INITIAL_WINDOW_SIZE, 65_535 + n % 2) for n in range(2_730)]

        async def attack() -> None:
            peer = await _flood(harness, streams, [settings(*entries)] * 50)
            # before: each frame applied, entry by entry; after: GOAWAY ENHANCE_YOUR_CALM
            assert peer.goaway() in (None, ENHANCE_YOUR_CALM)

        p99 = await _normal_p99_during(harness, attack, rounds=3)
        assert p99 < NORMAL_P99, f"p99 {p99 * 1000:.0f} ms during 3 connections' floods"
        await harness.no_calls()
        # 32 entries are a frame like any other
        peer = await harness.connect()
        peer.send(settings(*entries[:32]) + peer.request(1, f"{SERVICE}/Unary"))
        peer.send(frame(DATA, END_STREAM, 1, message(b"x")))
        assert await peer.status(1) == "0"


def _costly_block(path: str) -> bytes:
    """A legal request header block that is slow to decode: 150 Huffman-coded literals of
    new names, 9 KiB compressed and just under the 16 KiB decoded limit."""
    headers = [(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "x")]
    headers += [("content-type", "application/grpc")]
    headers += [(f"x-h{n:04d}", "v" * 60) for n in range(150)]
    return hpack.Encoder().encode(headers, huffman=True)


@pytest.mark.timed
async def test_a_flood_of_costly_header_blocks_leaves_normal_traffic_on_time() -> None:
    # 25 such blocks (each a request) in one write: one read of ~230 KiB, about 5 ms of
    # decoding a block. Their decoding is charged to the connection's budget, and the loop
    # is yielded between the frames of one read.
    async with serving() as harness:
        block = _costly_block(f"{SERVICE}/Missing")
        floods = [
            b"".join(
                frame(HEADERS, END_HEADERS | END_STREAM, s, block) for s in range(n, n + 50, 2)
            )
            for n in range(1, 500, 50)
        ]

        async def attack() -> None:
            peer = await _flood(harness, b"", floods)
            # before: answered (UNIMPLEMENTED) for ever; after: GOAWAY ENHANCE_YOUR_CALM
            assert peer.goaway() in (None, ENHANCE_YOUR_CALM)

        p99 = await _normal_p99_during(harness, attack, rounds=3)
        assert p99 < NORMAL_P99, f"p99 {p99 * 1000:.0f} ms during 3 connections' floods"
