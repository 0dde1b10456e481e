"""A gRPC server over HTTP/2 on asyncio, for the ext_proc port (``--extproc-transport=native``).

grpc.aio costs 65 to 90 µs of CPU per message pair on this project's machine
(``tests.bench.grpc_floor``), and an ext_proc stream is one message pair per body chunk:
that floor, not our handling, decided the EPP's cost per request and per SSE chunk
(docs/decisions/0013). No kept Python library serves gRPC cheaper (``h2``, the pure-Python
HTTP/2 state machine, costs about 40 µs a pair), so this module frames HTTP/2 itself and
leaves header compression to ``hpack``. ``tests.bench.grpc_floor`` prints all three side by
side (docs/decisions/0020).

What it serves is gRPC as Envoy's client speaks it: one method table, stream-stream and
unary-unary handlers on a context with ``read()``, ``write()`` and ``abort()`` (the subset
of ``grpc.aio.ServicerContext`` the EPP's handlers use), statuses in trailers,
``grpc-timeout``, identity encoding only. What it guards, because the port may be reached by
more than Envoy:

- flow control both ways: a stream's unread messages are bounded by its window (credit is
  returned as the handler reads), a message by ``max_receive_message_length``
  (``RESOURCE_EXHAUSTED``), and a peer that stops reading stops our reading of it too
  (transport back-pressure), so nothing it sends grows memory without bound;
- frame sizes, header blocks (compressed and decoded size), stream ids, CONTINUATION
  sequences, SETTINGS values: a violation is a connection error (GOAWAY) or a stream error
  (RST_STREAM), as RFC 9113 says;
- floods: control frames (PING, SETTINGS, RST_STREAM, PRIORITY, WINDOW_UPDATE, empty
  DATA) past a budget that only requests refill, and streams the peer resets faster than
  they complete ("rapid reset"), end the connection with ENHANCE_YOUR_CALM;
- a connection that sends no preface within ``handshake_timeout`` is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import socket
import ssl
import struct
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import quote

import grpc
import hpack

from adapters.envoy.loglimit import LogLimiter

__all__ = ["H2GrpcServer", "MethodHandler", "RpcContext"]

logger = logging.getLogger(__name__)
# hpack logs every header it decodes at DEBUG: at -v 3 that would be several lines per stream
logging.getLogger("hpack").setLevel(logging.INFO)

_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# frame types (RFC 9113 section 6)
_DATA, _HEADERS, _PRIORITY, _RST_STREAM, _SETTINGS = 0x0, 0x1, 0x2, 0x3, 0x4
_PUSH_PROMISE, _PING, _GOAWAY, _WINDOW_UPDATE, _CONTINUATION = 0x5, 0x6, 0x7, 0x8, 0x9
# flags
_END_STREAM, _ACK, _END_HEADERS, _PADDED, _PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
# error codes
_NO_ERROR, _PROTOCOL_ERROR, _INTERNAL_ERROR, _FLOW_CONTROL_ERROR = 0x0, 0x1, 0x2, 0x3
_STREAM_CLOSED, _FRAME_SIZE_ERROR, _REFUSED_STREAM, _CANCEL = 0x5, 0x6, 0x7, 0x8
_COMPRESSION_ERROR, _ENHANCE_YOUR_CALM = 0x9, 0xB
# settings
_HEADER_TABLE_SIZE, _ENABLE_PUSH, _MAX_CONCURRENT_STREAMS = 0x1, 0x2, 0x3
_INITIAL_WINDOW_SIZE, _MAX_FRAME_SIZE, _MAX_HEADER_LIST_SIZE = 0x4, 0x5, 0x6

_DEFAULT_WINDOW = 65_535
_MAX_WINDOW = 2**31 - 1
_FRAME_SIZE = 16_384  # what we accept, and what we send until the peer allows more
# Our receive windows: a stream may have this many bytes in flight to us; the connection
# (all streams) the second. Credit returns as messages are read.
STREAM_WINDOW = 1 << 20
CONNECTION_WINDOW = 16 << 20
MAX_HEADER_LIST_SIZE = 16_384
_CREDIT_BATCH = STREAM_WINDOW // 4  # window returned in steps of at least this
_MAX_HEADER_BLOCK = 4 * MAX_HEADER_LIST_SIZE  # compressed, over HEADERS and CONTINUATIONs
# Control frames a connection may send beyond the requests it makes; each request
# (HEADERS, or DATA with a payload) refills this many.
_CONTROL_BUDGET = 1_000
_CONTROL_REFILL = 10
# seconds an error status may wait for the peer to finish sending (see _park)
_PARK_DELAY = 0.5
_GOAWAY_PING = b"goaway\x00\x00"
_GOAWAY_PING_TIMEOUT = 2.0  # seconds the final GOAWAY waits for the PING's answer
_DECODED_BLOCKS = 16  # header blocks kept decoded per connection
_DECODED_BLOCK_MAX = 1024  # bytes: larger blocks are decoded each time
_CLOSE_LINGER = 1.0  # seconds a finished connection waits for the peer to close it
_RAPID_RESETS = 200  # resets beyond which a peer resetting more than it completes is cut
# A connection whose peer broke the protocol of a call (``RpcContext.penalize_peer``) is not
# read for a while: _PENALTY_FIRST seconds, doubling with each strike of its host up to the
# handler's bound; a host's strikes are forgotten after _PENALTY_FORGET seconds without one.
_PENALTY_FIRST = 0.01
_PENALTY_FORGET = 30.0
_PENALTY_HOSTS = 4096  # hosts whose strikes are kept (the oldest forgotten first)

# a frame header: length (24 bits) and type as one word, flags, stream id (RFC 9113 4.1)
_FRAME_HEADER = struct.Struct(">IBI")

_TIMEOUT_UNITS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}


def _frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return (
        len(payload).to_bytes(3, "big")
        + bytes((kind, flags))
        + stream_id.to_bytes(4, "big")
        + payload
    )


def _never_indexed(headers: list[tuple[str, str]]) -> bytes:
    # Literals never indexed: the block leaves the peer's decoder table untouched, so any
    # block can be sent in any order and cached.
    return hpack.Encoder().encode(
        [hpack.NeverIndexedHeaderTuple(name, value) for name, value in headers], huffman=False
    )


_MAX_ECHOED_PATH = 128
_RESPONSE_HEADERS = _never_indexed([(":status", "200"), ("content-type", "application/grpc")])
_TRAILERS_OK = _never_indexed([("grpc-status", "0")])


@functools.lru_cache(maxsize=256)  # statuses repeat: a refused stream's is a fixed text
def _status_block(code: grpc.StatusCode, details: str, *, trailers_only: bool) -> bytes:
    headers = [(":status", "200"), ("content-type", "application/grpc")] if trailers_only else []
    headers.append(("grpc-status", str(code.value[0])))
    if details:
        # gRPC's percent-encoding: printable ASCII but '%' as is, the rest as %XX of UTF-8
        headers.append(("grpc-message", quote(details, safe=" !\"#$&'()*+,-./:;<=>?@[\\]^_`{|}~")))
    return _never_indexed(headers)


def _method_not_found(path: bytes) -> str:
    # The path is named only when short and printable: echoed in full, a peer's request of
    # a few bytes (its :path indexed in HPACK) would be answered with kilobytes.
    if len(path) <= _MAX_ECHOED_PATH and path.isascii() and path.decode("ascii").isprintable():
        return f"Method not found: {path.decode('ascii')}"
    return "Method not found"


@functools.lru_cache(maxsize=32)
def _http_status_block(status: int) -> bytes:
    return _never_indexed([(":status", str(status))])


class _ConnectionError(Exception):
    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code


class _AbortError(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


@dataclass(frozen=True, slots=True)
class MethodHandler:
    """One method: ``function(request_or_None, context)``. ``streaming``: the handler reads
    its requests with ``context.read()`` (stream-stream); otherwise it gets the one request
    and returns the one response (unary-unary)."""

    function: Callable[[Any, Any], Awaitable[Any]]
    deserializer: Callable[[Any], Any]  # given a memoryview of the message
    serializer: Callable[[Any], bytes]
    streaming: bool


class _Replies:
    """Replies an ``inline`` answer could not send at once: ``read()`` does not return
    them, it writes them (waiting for the window) and reads on."""

    __slots__ = ("replies",)

    def __init__(self, replies: list[Any]) -> None:
        self.replies = replies


class RpcContext:
    """One call, as its handler sees it: ``read()`` the next request (``grpc.aio.EOF`` after
    the peer's half-close), ``write()`` a response (a message, or bytes the serializer passes
    through), ``abort()`` with a status.

    ``inline``, when the handler sets it, answers messages inside the transport's read,
    without waking the handler's task (a task wake costs more than a small message's
    work). It is called with each message that arrives while the handler waits in
    ``read()`` with nothing queued and the stream can send at once. It returns either a
    list of replies, written at once, or what ``read()`` is to return in the message's
    place (the message itself when it is not answered inline). It runs in the transport's
    context, not the task's (the handler sets the context variables it needs), and must
    not raise."""

    __slots__ = (
        "_connection",
        "_data_head",
        "_deadline",
        "_ended",
        "_error",
        "_headers_sent",
        "_message",
        "_need",
        "_parts",
        "_pending",
        "_pending_status",
        "_queue",
        "_queued_bytes",
        "_reader",
        "_send_window",
        "_uncredited",
        "_window",
        "half_closed",
        "handler",
        "inline",
        "stream_id",
        "task",
    )

    def __init__(self, connection: _Connection, stream_id: int, handler: MethodHandler) -> None:
        self._connection = connection
        self.stream_id = stream_id
        # a DATA frame's type, flags and stream, and the message's "not compressed" byte
        self._data_head = bytes((_DATA, 0)) + stream_id.to_bytes(4, "big") + b"\x00"
        self.handler = handler
        self.task: asyncio.Task[None] | None = None
        self.half_closed = False
        self._ended = False
        self._error = False
        self._headers_sent = False
        self._queue: deque[Any] = deque()
        self._queued_bytes = 0
        self._reader: asyncio.Future[Any] | None = None
        self._parts: list[bytes] = []
        self._need = -1  # bytes of the message being reassembled (prefix included); -1: none
        self._message = 0
        self._uncredited = 0  # bytes received and not yet credited back to the peer
        self._send_window = connection.peer_initial_window
        self._pending = b""  # data waiting for the peer's window
        self._pending_status: bytes | None = None  # and the status after it
        self._window: asyncio.Future[None] | None = None  # the writer waiting for it
        self._deadline: asyncio.TimerHandle | None = None
        self.inline: Callable[[Any], Any] | None = None

    # -- what the handler calls --

    async def read(self) -> Any:
        queue = self._queue
        while True:
            if not queue:
                if self.half_closed:
                    return grpc.aio.EOF
                self._reader = self._connection.loop.create_future()
                try:
                    await self._reader
                finally:
                    self._reader = None
                if not queue:
                    return grpc.aio.EOF
            size, message = queue.popleft()
            self._queued_bytes -= size
            self._return_credit()
            if type(message) is not _Replies:
                return message
            for reply in message.replies:
                await self.write(reply)

    def _return_credit(self) -> None:
        # Everything received is credited back but the messages no one has read: a handler
        # that does not read stops the peer within one window.
        creditable = self._uncredited - self._queued_bytes
        if creditable >= _CREDIT_BATCH:
            self._uncredited -= creditable
            self._connection.credit_stream(self, creditable)

    async def write(self, response: Any) -> None:
        if self._ended:
            raise _AbortError(grpc.StatusCode.CANCELLED, "the call is over")
        data = self.handler.serializer(response)
        connection = self._connection
        if len(data) > connection.max_send_message_length:
            raise _AbortError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"response of {len(data)} bytes exceeds the limit "
                f"({connection.max_send_message_length})",
            )
        if self._send_now((data,)):
            # the common case: one DATA frame, sent as it is built
            if connection._paused:
                await connection._wait_drained()
            return
        if not self._headers_sent:
            self._headers_sent = True
            connection.send_headers(self.stream_id, _RESPONSE_HEADERS, end_stream=False)
        await connection.send_data(self, b"\x00" + len(data).to_bytes(4, "big") + data)

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise _AbortError(code, details)

    def penalize_peer(self, longest: float) -> None:
        """The peer broke the call's protocol (no gateway does): its connection is not read
        for a while (10 ms, doubling with each such call from its host in a row, at most
        ``longest`` seconds), so a peer that breaks it in a loop gets little of the event
        loop. Its calls already read go on."""
        self._connection.penalize(longest)

    # -- what the connection calls --

    def receive(self, payload: bytes, end_stream: bool) -> None:
        """A DATA payload: complete messages go to the queue, the rest waits for more."""
        if payload:
            if not self._parts:
                # the common case: whole messages in this frame, parsed where they lie
                size = len(payload)
                start = 0
                while size - start >= 5:
                    end = start + 5 + int.from_bytes(payload[start + 1 : start + 5], "big")
                    if end > size:
                        break
                    self._deliver(payload, start, end)
                    start = end
                if start < size:
                    rest = payload[start:] if start else payload
                    self._parts.append(rest)
                    self._message = len(rest)
                    self._need = self._size_of(rest)
            else:
                self._parts.append(payload)
                self._message += len(payload)
                while True:
                    if self._need < 0:
                        self._need = self._size_of(b"".join(self._parts))
                    if self._need < 0 or self._message < self._need:
                        break
                    joined = b"".join(self._parts)
                    self._deliver(joined, 0, self._need)
                    rest = joined[self._need :]
                    self._parts = [rest] if rest else []
                    self._message = len(rest)
                    self._need = self._size_of(rest) if rest else -1
            if self._need > 5 + self._connection.max_receive_message_length:
                raise _AbortError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"received message of {self._need - 5} bytes exceeds the limit "
                    f"({self._connection.max_receive_message_length})",
                )
            self._return_credit()
        if end_stream:
            self.half_closed = True
            if self._parts:
                raise _AbortError(grpc.StatusCode.INTERNAL, "the stream ended inside a message")
        reader = self._reader
        if reader is not None and not reader.done() and (self._queue or end_stream):
            reader.set_result(None)

    def _size_of(self, head: bytes) -> int:
        return 5 + int.from_bytes(head[1:5], "big") if len(head) >= 5 else -1

    def _deliver(self, buffer: bytes, start: int, end: int) -> None:
        """Queues the message at ``buffer[start:end]`` (its 5-byte prefix included)."""
        if buffer[start] != 0:
            raise _AbortError(
                grpc.StatusCode.UNIMPLEMENTED if buffer[start] == 1 else grpc.StatusCode.INTERNAL,
                "compressed messages are not accepted (grpc-encoding: identity)",
            )
        size = end - start
        if size - 5 > self._connection.max_receive_message_length:
            raise _AbortError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"received message of {size - 5} bytes exceeds the limit "
                f"({self._connection.max_receive_message_length})",
            )
        try:
            request = self.handler.deserializer(memoryview(buffer)[start + 5 : end])
        except Exception as exc:
            raise _AbortError(
                grpc.StatusCode.INTERNAL, f"cannot parse the request: {exc}"
            ) from None
        inline = self.inline
        if (
            inline is not None
            and self._reader is not None
            and not self._queue
            and not self._pending
            and not self._ended
        ):
            connection = self._connection
            if not connection._paused and not connection._closing:
                result = inline(request)
                if type(result) is not list:
                    request = result
                elif self._write_now(result):
                    return
                else:
                    # out of window: the task writes them (and waits), reading no more
                    request = _Replies(result)
        self._queue.append((size, request))
        self._queued_bytes += size

    def _write_now(self, replies: list[Any]) -> bool:
        """Writes ``replies`` if they fit the windows now (False, nothing written, if not;
        ``write()`` then says why)."""
        serialize = self.handler.serializer
        data = [serialize(reply) for reply in replies]
        limit = self._connection.max_send_message_length
        return all(len(d) <= limit for d in data) and self._send_now(data)

    def _send_now(self, messages: Sequence[bytes]) -> bool:
        """Sends each message as one DATA frame (the response headers first, once) if they
        all fit the stream's and the connection's windows and the peer's frame size now,
        with nothing of this stream waiting before them; else sends nothing (False)."""
        connection = self._connection
        if self._pending or connection._closing:
            return False
        size = 0
        for data in messages:
            framed = len(data) + 5
            if framed > connection._peer_frame_size:
                return False
            size += framed
        if size > self._send_window or size > connection._send_window:
            return False
        if not self._headers_sent:
            self._headers_sent = True
            connection.send_headers(self.stream_id, _RESPONSE_HEADERS, end_stream=False)
        self._send_window -= size
        connection._send_window -= size
        head = self._data_head
        for data in messages:
            framed = len(data) + 5
            connection._send(framed.to_bytes(3, "big") + head + len(data).to_bytes(4, "big") + data)
        return True

    def fail(self) -> None:
        """The stream is gone (reset, or the connection closed): wake and cancel the handler."""
        self._ended = True
        self.half_closed = True
        for waiter in (self._reader, self._window):
            if waiter is not None and not waiter.done():
                waiter.cancel()
        if self.task is not None and not self.task.done():
            self.task.cancel()


class _Connection(asyncio.Protocol):
    """One HTTP/2 connection: frames in, calls started, frames out."""

    def __init__(self, server: H2GrpcServer) -> None:
        self.server = server
        self.loop = asyncio.get_running_loop()
        self.max_receive_message_length = server.max_receive_message_length
        self.max_send_message_length = server.max_send_message_length
        self.peer_initial_window = _DEFAULT_WINDOW
        self._peer_frame_size = _FRAME_SIZE
        self._send_window = _DEFAULT_WINDOW
        self._received = 0  # bytes received since the connection's window was last given back
        self._transport: asyncio.Transport | None = None
        self._buffer = b""
        self._preface = False
        self._calls: dict[int, RpcContext] = {}
        self._last_stream = 0
        self._goaway_announced = False  # the first GOAWAY (see go_away)
        self._goaway_sent = False  # the final one: new streams are refused
        self._lingering = False  # nothing left to serve: waiting for the peer to close
        self._closing = False
        self._decoder = hpack.Decoder(max_header_list_size=MAX_HEADER_LIST_SIZE)
        self._decoder.max_allowed_table_size = 4096
        # header blocks decoded without changing the dynamic table (a gateway repeats the
        # same block for every stream): decoding one again gives the same headers as long
        # as the table has not changed since, so they are kept until it does
        self._decoded: dict[bytes, list[tuple[bytes, bytes]]] = {}
        self._header_stream = 0  # a header block in progress (HEADERS without END_HEADERS)
        self._header_flags = 0
        self._header_parts: list[bytes] = []
        self._header_size = 0
        self._control = _CONTROL_BUDGET
        self._resets = 0
        self._completed = 0
        self._out: list[bytes] = []
        self._flush_scheduled = False
        self._paused = False
        self._drained: asyncio.Future[None] | None = None
        self._blocked: deque[RpcContext] = deque()  # calls with data waiting for window
        self._timers: list[asyncio.TimerHandle] = []
        self._first_block = True
        # error statuses waiting for the peer's half-close, and their timers
        self._parked: dict[int, tuple[bytes, asyncio.TimerHandle]] = {}
        self._host = ""
        self._penalty: asyncio.TimerHandle | None = None  # reading paused till it fires

    # -- asyncio.Protocol --

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have its methods
        self._transport = transport = cast(asyncio.Transport, transport)
        peer = transport.get_extra_info("peername")
        self._host = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        self.server.connections.add(self)
        self.server.no_connections.clear()
        settings = [(_ENABLE_PUSH, 0), (_INITIAL_WINDOW_SIZE, STREAM_WINDOW)]
        settings.append((_MAX_HEADER_LIST_SIZE, MAX_HEADER_LIST_SIZE))
        if self.server.max_streams_per_connection:
            settings.append((_MAX_CONCURRENT_STREAMS, self.server.max_streams_per_connection))
        payload = b"".join(k.to_bytes(2, "big") + v.to_bytes(4, "big") for k, v in settings)
        increment = CONNECTION_WINDOW - _DEFAULT_WINDOW
        transport.write(
            _frame(_SETTINGS, 0, 0, payload)
            + _frame(_WINDOW_UPDATE, 0, 0, increment.to_bytes(4, "big"))
        )
        self._timers.append(
            self.loop.call_later(self.server.handshake_timeout, self._handshake_expired)
        )
        age = self.server.max_connection_age
        if age:
            self._timers.append(self.loop.call_later(age * random.uniform(0.9, 1.1), self.go_away))
        if self.server.draining:
            self.go_away()

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing = True
        self.server.connections.discard(self)
        if not self.server.connections:
            self.server.no_connections.set()
        for timer in self._timers:
            timer.cancel()
        if self._penalty is not None:
            self._penalty.cancel()
        for _, timer in self._parked.values():
            timer.cancel()
        self._parked.clear()
        for call in list(self._calls.values()):
            call.fail()
        self._calls.clear()
        self._blocked.clear()
        if self._drained is not None and not self._drained.done():
            self._drained.cancel()

    @property
    def going_away(self) -> bool:
        """Asked to open no new stream (GOAWAY sent), or closed."""
        return self._goaway_announced or self._closing

    def pause_writing(self) -> None:
        # The peer does not read: neither do we, so nothing it asks for piles up here.
        self._paused = True
        if self._transport is not None and not self._closing:
            self._transport.pause_reading()

    def resume_writing(self) -> None:
        self._paused = False
        if self._transport is not None and not self._closing and self._penalty is None:
            self._transport.resume_reading()
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    def data_received(self, data: bytes) -> None:
        if self._penalty is not None:
            # A pause starts in a call's task, between reads; a transport that still hands
            # over bytes it had read is kept to the pause's end.
            self._buffer += data
            return
        if self._buffer:
            data = self._buffer + data
            self._buffer = b""
        try:
            position = 0
            if not self._preface:
                if len(data) < len(_PREFACE):
                    if not _PREFACE.startswith(data):
                        raise _ConnectionError(_PROTOCOL_ERROR, "not an HTTP/2 preface")
                    self._buffer = data
                    return
                if not data.startswith(_PREFACE):
                    raise _ConnectionError(_PROTOCOL_ERROR, "not an HTTP/2 preface")
                self._preface = True
                self._timers[0].cancel()
                position = len(_PREFACE)
            end = len(data)
            unpack = _FRAME_HEADER.unpack_from
            while end - position >= 9:
                word, flags, stream_id = unpack(data, position)
                length = word >> 8
                if length > _FRAME_SIZE:
                    raise _ConnectionError(_FRAME_SIZE_ERROR, f"frame of {length} bytes")
                if end - position - 9 < length:
                    break
                kind = word & 0xFF
                stream_id &= _MAX_WINDOW
                payload = data[position + 9 : position + 9 + length]
                position += 9 + length
                self._on_frame(kind, flags, stream_id, payload)
                if self._closing:
                    return
            if position < end:
                self._buffer = data[position:]
        except _ConnectionError as exc:
            self._fail_connection(exc.code, str(exc))

    def eof_received(self) -> bool | None:
        return False

    # -- a peer that breaks the protocol --

    def penalize(self, longest: float) -> None:
        if self._closing or self._transport is None or longest <= 0:
            return
        strikes = self.server.strike(self._host, self.loop.time())
        delay = min(_PENALTY_FIRST * 2.0 ** min(strikes - 1, 30), longest)
        if self._penalty is not None:
            if self._penalty.when() >= self.loop.time() + delay:
                return
            self._penalty.cancel()
        else:
            self._transport.pause_reading()
        self._penalty = self.loop.call_later(delay, self._end_penalty)
        self.server.log.info(
            "ext_proc connection from %s not read for %g ms: a call broke the protocol "
            "(%d strikes of that host)",
            self._host or "?",
            round(delay * 1000, 1),
            strikes,
        )

    def _end_penalty(self) -> None:
        self._penalty = None
        if self._closing or self._transport is None:
            return
        if not self._paused:
            self._transport.resume_reading()
        if self._buffer:
            self.data_received(b"")  # what was kept meanwhile

    # -- frames in --

    def _on_frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if self._header_stream and (kind != _CONTINUATION or stream_id != self._header_stream):
            raise _ConnectionError(_PROTOCOL_ERROR, "a header block was interrupted")
        if kind == _DATA:
            self._on_data(flags, stream_id, payload)
        elif kind == _HEADERS:
            self._on_headers(flags, stream_id, payload)
        elif kind == _CONTINUATION:
            if not self._header_stream:
                raise _ConnectionError(_PROTOCOL_ERROR, "CONTINUATION without HEADERS")
            self._header_part(flags, payload)
        else:
            self._spend_control()
            if kind == _SETTINGS:
                self._on_settings(flags, stream_id, payload)
            elif kind == _WINDOW_UPDATE:
                self._on_window_update(stream_id, payload)
            elif kind == _PING:
                if len(payload) != 8 or stream_id:
                    raise _ConnectionError(_FRAME_SIZE_ERROR, "bad PING")
                if not flags & _ACK:
                    self._send(_frame(_PING, _ACK, 0, payload))
                elif payload == _GOAWAY_PING and self._goaway_announced:
                    self._final_goaway()
            elif kind == _RST_STREAM:
                if len(payload) != 4 or not stream_id:
                    raise _ConnectionError(_PROTOCOL_ERROR, "bad RST_STREAM")
                if stream_id > self._last_stream:
                    raise _ConnectionError(_PROTOCOL_ERROR, "RST_STREAM on an idle stream")
                call = self._calls.pop(stream_id, None)
                if call is not None:
                    call.fail()
                    self._count_reset()
            elif kind == _GOAWAY:
                self._closing_by_peer()
            elif kind == _PRIORITY:
                if len(payload) != 5 or not stream_id:
                    raise _ConnectionError(_PROTOCOL_ERROR, "bad PRIORITY")
            elif kind == _PUSH_PROMISE:
                raise _ConnectionError(_PROTOCOL_ERROR, "a client may not push")
            # unknown frame types are ignored (RFC 9113 section 4.1)

    def _spend_control(self) -> None:
        self._control -= 1
        if self._control < 0:
            raise _ConnectionError(_ENHANCE_YOUR_CALM, "too many control frames")

    def _count_reset(self) -> None:
        self._resets += 1
        if self._resets > _RAPID_RESETS and self._resets > self._completed:
            raise _ConnectionError(_ENHANCE_YOUR_CALM, "too many streams reset")

    def _on_data(self, flags: int, stream_id: int, payload: bytes) -> None:
        if not stream_id:
            raise _ConnectionError(_PROTOCOL_ERROR, "DATA on stream 0")
        size = len(payload)
        if flags & _PADDED:
            if not payload or payload[0] >= size:
                raise _ConnectionError(_PROTOCOL_ERROR, "bad padding")
            payload = payload[1 : size - payload[0]]
        # The connection's window is given back as bytes arrive: each stream's own window
        # bounds what waits unread.
        self._received += size
        if self._received > CONNECTION_WINDOW:
            raise _ConnectionError(_FLOW_CONTROL_ERROR, "the connection window was exceeded")
        if self._received >= CONNECTION_WINDOW // 4:
            self._send(_frame(_WINDOW_UPDATE, 0, 0, self._received.to_bytes(4, "big")))
            self._received = 0
        if payload:
            self._control = min(self._control + _CONTROL_REFILL, _CONTROL_BUDGET)
        else:
            self._spend_control()
        call = self._calls.get(stream_id)
        if call is None:
            if stream_id > self._last_stream:
                raise _ConnectionError(_PROTOCOL_ERROR, "DATA on an idle stream")
            if self._parked and flags & _END_STREAM:
                self._send_parked(stream_id)
            return  # a stream already closed, or refused
        if call.half_closed:
            self._reset(call, _STREAM_CLOSED)
            return
        if call._uncredited + size > STREAM_WINDOW:
            self._reset(call, _FLOW_CONTROL_ERROR)
            return
        call._uncredited += size  # padding included: it is credited with the rest
        try:
            call.receive(payload, bool(flags & _END_STREAM))
        except _AbortError as exc:
            self._end_call(call, exc.code, exc.details)
            call.fail()

    def _on_headers(self, flags: int, stream_id: int, payload: bytes) -> None:
        if not stream_id or not stream_id & 1:
            raise _ConnectionError(_PROTOCOL_ERROR, "HEADERS on a stream a client may not open")
        if flags & _PADDED:
            if not payload or payload[0] >= len(payload):
                raise _ConnectionError(_PROTOCOL_ERROR, "bad padding")
            payload = payload[1 : len(payload) - payload[0]]
        if flags & _PRIORITY_FLAG:
            if len(payload) < 5:
                raise _ConnectionError(_PROTOCOL_ERROR, "bad priority")
            payload = payload[5:]
        self._header_stream = stream_id
        self._header_flags = flags
        self._header_parts = []
        self._header_size = 0
        self._header_part(flags, payload)

    def _header_part(self, flags: int, payload: bytes) -> None:
        # a frame counts its header too: empty CONTINUATIONs are not free
        self._header_size += 9 + len(payload)
        if self._header_size > _MAX_HEADER_BLOCK:
            raise _ConnectionError(_ENHANCE_YOUR_CALM, "header block too large")
        self._header_parts.append(payload)
        if not flags & _END_HEADERS:
            return
        stream_id = self._header_stream
        self._header_stream = 0
        block = b"".join(self._header_parts)
        self._header_parts = []
        headers = self._decoded.get(block)
        if headers is None:
            headers = self._decode(block)
        end_stream = bool(self._header_flags & _END_STREAM)
        self._control = min(self._control + _CONTROL_REFILL, _CONTROL_BUDGET)
        if self._parked and stream_id in self._parked:
            self._send_parked(stream_id)  # the peer's trailers: it is done sending
            return
        call = self._calls.get(stream_id)
        if call is not None:
            # trailers from the client
            if not end_stream:
                raise _ConnectionError(_PROTOCOL_ERROR, "a second header block without END_STREAM")
            call.receive(b"", True)
            return
        if stream_id <= self._last_stream:
            raise _ConnectionError(_STREAM_CLOSED, "HEADERS on a closed stream")
        self._last_stream = stream_id
        self._start_call(stream_id, headers, end_stream)

    def _decode(self, block: bytes) -> list[tuple[bytes, bytes]]:
        table = self._decoder.header_table
        entries = table.dynamic_entries
        newest, count, size = entries[0] if entries else None, len(entries), table.maxsize
        try:
            headers = cast(list[tuple[bytes, bytes]], self._decoder.decode(block, raw=True))
        except hpack.OversizedHeaderListError:
            raise _ConnectionError(_ENHANCE_YOUR_CALM, "header list too large") from None
        except hpack.HPACKError as exc:
            raise _ConnectionError(_COMPRESSION_ERROR, f"header block: {exc}") from None
        entries = table.dynamic_entries
        # an entry added is a new tuple at the front; a size update changes maxsize
        newest_now = entries[0] if entries else None
        if newest_now is newest and len(entries) == count and table.maxsize == size:
            if len(block) <= _DECODED_BLOCK_MAX and len(self._decoded) < _DECODED_BLOCKS:
                self._decoded[block] = headers
        elif self._decoded:
            self._decoded.clear()
        return headers

    def _start_call(
        self, stream_id: int, headers: list[tuple[bytes, bytes]], end_stream: bool
    ) -> None:
        server = self.server
        limit = server.max_streams_per_connection
        if self._goaway_sent or (limit and len(self._calls) >= limit):
            self._send(_frame(_RST_STREAM, 0, stream_id, _REFUSED_STREAM.to_bytes(4, "big")))
            return
        method = path = content_type = b""
        timeout: float | None = None
        encoding = b"identity"
        for name, value in headers:
            if name == b":path":
                path = value
            elif name == b":method":
                method = value
            elif name == b"content-type":
                content_type = value
            elif name == b"grpc-timeout":
                timeout = _parse_timeout(value)
            elif name == b"grpc-encoding":
                encoding = value
        if method != b"POST":
            self._refuse(stream_id, 405, end_stream)
            return
        if not content_type.startswith(b"application/grpc"):
            self._refuse(stream_id, 415, end_stream)
            return
        handler = server.handlers.get(path.decode("latin-1"))
        if handler is None:
            self._reply_status(
                stream_id,
                grpc.StatusCode.UNIMPLEMENTED,
                _method_not_found(path),
                end_stream,
            )
            return
        if server.max_concurrent_rpcs and server.active_calls >= server.max_concurrent_rpcs:
            self._reply_status(
                stream_id,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "Concurrent RPC limit exceeded!",
                end_stream,
            )
            return
        call = RpcContext(self, stream_id, handler)
        if encoding != b"identity":
            call.half_closed = end_stream
            self._calls[stream_id] = call
            self._end_call(call, grpc.StatusCode.UNIMPLEMENTED, "only identity encoding")
            return
        self._calls[stream_id] = call
        if end_stream:
            call.half_closed = True
        server.active_calls += 1
        server.calls_started += 1
        server.no_calls.clear()
        call.task = self.loop.create_task(self._run(call))
        # counted off when the task is done, even if it is cancelled before it starts
        # (a reset or an error in the same read as the HEADERS): not in _run's finally
        call.task.add_done_callback(functools.partial(self._call_done, call))
        if timeout is not None:
            call._deadline = self.loop.call_later(timeout, self._expire, call)

    def _expire(self, call: RpcContext) -> None:
        if self._calls.get(call.stream_id) is call:
            self._end_call(call, grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
            call.fail()

    async def _run(self, call: RpcContext) -> None:
        handler = call.handler
        code, details = grpc.StatusCode.OK, ""
        try:
            if handler.streaming:
                await handler.function(None, call)
            else:
                request = await call.read()
                if request is grpc.aio.EOF:
                    raise _AbortError(grpc.StatusCode.INTERNAL, "no request message")
                response = await handler.function(request, call)
                await call.write(response)
        except _AbortError as exc:
            code, details = exc.code, exc.details
        except asyncio.CancelledError:
            code, details = grpc.StatusCode.CANCELLED, "cancelled"
        except Exception as exc:
            logger.exception("gRPC handler failed")
            code, details = grpc.StatusCode.UNKNOWN, f"Unexpected {type(exc).__name__}: {exc}"
        if self._calls.get(call.stream_id) is call:
            self._end_call(call, code, details)

    def _call_done(self, call: RpcContext, _task: object) -> None:
        server = self.server
        server.active_calls -= 1
        if not server.active_calls:
            server.no_calls.set()
        if call._deadline is not None:
            call._deadline.cancel()

    def _end_call(self, call: RpcContext, code: grpc.StatusCode, details: str) -> None:
        """Sends the call's status (after any data still waiting for window) and closes it."""
        if call._ended:
            return
        call._ended = True
        if code is grpc.StatusCode.OK and call._headers_sent:
            block = _TRAILERS_OK
        else:
            block = _status_block(code, details, trailers_only=not call._headers_sent)
        call._headers_sent = True
        call._error = code is not grpc.StatusCode.OK
        if call._pending:
            call._pending_status = block  # goes out after the data, when the peer allows
            return
        self._close_call(call, block)

    def _close_call(self, call: RpcContext, block: bytes) -> None:
        if self._closing:
            return
        if not call._error or call.half_closed:
            self.send_headers(call.stream_id, block, end_stream=True)
        else:
            self._park(call.stream_id, block)
        if self._calls.pop(call.stream_id, None) is call:
            self._completed += 1
        self._maybe_close()

    def _refuse(self, stream_id: int, status: int, end_stream: bool) -> None:
        self._answer(stream_id, _http_status_block(status), end_stream)

    def _reply_status(
        self, stream_id: int, code: grpc.StatusCode, details: str, end_stream: bool
    ) -> None:
        self._answer(stream_id, _status_block(code, details, trailers_only=True), end_stream)

    def _answer(self, stream_id: int, block: bytes, end_stream: bool) -> None:
        """Answers a stream that opens no call (see ``_park``)."""
        if end_stream:
            self.send_headers(stream_id, block, end_stream=True)
        else:
            self._park(stream_id, block)

    def _park(self, stream_id: int, block: bytes) -> None:
        """Holds an error status until the peer has finished sending (END_STREAM), at most
        ``_PARK_DELAY``. A grpc-core client whose send is still under way when the status
        arrives fails the call as INTERNAL and loses the status; grpc.aio's own server
        answers late enough never to meet that. What the peer sends meanwhile is dropped
        (credited to the connection)."""
        timer = self.loop.call_later(_PARK_DELAY, self._send_parked, stream_id)
        self._parked[stream_id] = (block, timer)

    def _send_parked(self, stream_id: int) -> None:
        parked = self._parked.pop(stream_id, None)
        if parked is not None and not self._closing:
            block, timer = parked
            timer.cancel()
            self.send_headers(stream_id, block, end_stream=True)
            self._maybe_close()

    def _reset(self, call: RpcContext, code: int) -> None:
        self._calls.pop(call.stream_id, None)
        call.fail()
        self._send(_frame(_RST_STREAM, 0, call.stream_id, code.to_bytes(4, "big")))
        self._maybe_close()

    def _on_settings(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id:
            raise _ConnectionError(_PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & _ACK:
            if payload:
                raise _ConnectionError(_FRAME_SIZE_ERROR, "SETTINGS ack with a payload")
            return
        if len(payload) % 6:
            raise _ConnectionError(_FRAME_SIZE_ERROR, "SETTINGS of a bad length")
        for offset in range(0, len(payload), 6):
            key = int.from_bytes(payload[offset : offset + 2], "big")
            value = int.from_bytes(payload[offset + 2 : offset + 6], "big")
            if key == _INITIAL_WINDOW_SIZE:
                if value > _MAX_WINDOW:
                    raise _ConnectionError(_FLOW_CONTROL_ERROR, "initial window too large")
                delta = value - self.peer_initial_window
                self.peer_initial_window = value
                for call in self._calls.values():
                    call._send_window += delta
                    if call._send_window > _MAX_WINDOW:
                        raise _ConnectionError(_FLOW_CONTROL_ERROR, "window too large")
            elif key == _MAX_FRAME_SIZE:
                if not _FRAME_SIZE <= value <= (1 << 24) - 1:
                    raise _ConnectionError(_PROTOCOL_ERROR, "bad SETTINGS_MAX_FRAME_SIZE")
                self._peer_frame_size = value
            elif key == _ENABLE_PUSH and value > 1:
                raise _ConnectionError(_PROTOCOL_ERROR, "bad SETTINGS_ENABLE_PUSH")
            # header table size: we never index (see _never_indexed); the rest is advice
        self._send(_frame(_SETTINGS, _ACK, 0))
        self._flush_blocked()

    def _on_window_update(self, stream_id: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise _ConnectionError(_FRAME_SIZE_ERROR, "bad WINDOW_UPDATE")
        increment = int.from_bytes(payload, "big") & _MAX_WINDOW
        if not stream_id:
            if not increment:
                raise _ConnectionError(_PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
            self._send_window += increment
            if self._send_window > _MAX_WINDOW:
                raise _ConnectionError(_FLOW_CONTROL_ERROR, "connection window too large")
        else:
            call = self._calls.get(stream_id)
            if call is None:
                if stream_id > self._last_stream:
                    raise _ConnectionError(_PROTOCOL_ERROR, "WINDOW_UPDATE on an idle stream")
                return
            if not increment:
                self._reset(call, _PROTOCOL_ERROR)
                return
            call._send_window += increment
            if call._send_window > _MAX_WINDOW:
                self._reset(call, _FLOW_CONTROL_ERROR)
                return
        self._flush_blocked()

    def _closing_by_peer(self) -> None:
        # The peer opens no new streams; the ones it has finish. Nothing else to do.
        return

    def _handshake_expired(self) -> None:
        if not self._preface and self._transport is not None:
            self._transport.abort()

    # -- frames out --

    def _send(self, data: bytes) -> None:
        self._out.append(data)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self._out and self._transport is not None and not self._closing:
            out = self._out
            self._out = []
            self._transport.write(b"".join(out) if len(out) > 1 else out[0])

    def send_headers(self, stream_id: int, block: bytes, end_stream: bool) -> None:
        if self._first_block:
            # we use no dynamic table: say so once, whatever size the peer allows
            self._first_block = False
            block = b"\x20" + block
        flags = _END_HEADERS | (_END_STREAM if end_stream else 0)
        if len(block) <= self._peer_frame_size:
            self._send(_frame(_HEADERS, flags, stream_id, block))
            return
        size = self._peer_frame_size
        parts = [block[i : i + size] for i in range(0, len(block), size)]
        first = _END_STREAM if end_stream else 0
        self._send(_frame(_HEADERS, first, stream_id, parts[0]))
        for index, part in enumerate(parts[1:], start=2):
            self._send(
                _frame(_CONTINUATION, _END_HEADERS if index == len(parts) else 0, stream_id, part)
            )

    async def send_data(self, call: RpcContext, data: bytes) -> None:
        if self._closing:
            raise _AbortError(grpc.StatusCode.UNAVAILABLE, "the connection is closed")
        if call._pending:
            call._pending += data
        elif self._send_data_now(call, data):
            # out of window: the rest goes when the peer opens it, and the writer waits
            self._blocked.append(call)
        if call._pending:
            call._window = self.loop.create_future()
            try:
                await call._window
            finally:
                call._window = None
        if self._paused:
            await self._wait_drained()

    def _send_data_now(self, call: RpcContext, data: bytes) -> bool:
        """Sends what the windows allow; keeps the rest in ``call._pending`` (returns True
        if there is a rest)."""
        while data:
            allowed = min(call._send_window, self._send_window, self._peer_frame_size)
            if allowed <= 0:
                call._pending = data
                return True
            chunk = data[:allowed] if allowed < len(data) else data
            data = data[len(chunk) :]
            call._send_window -= len(chunk)
            self._send_window -= len(chunk)
            self._send(_frame(_DATA, 0, call.stream_id, chunk))
        call._pending = b""
        return False

    def _flush_blocked(self) -> None:
        blocked = self._blocked
        for _ in range(len(blocked)):
            call = blocked.popleft()
            if self._calls.get(call.stream_id) is not call:
                continue
            if self._send_data_now(call, call._pending):
                blocked.append(call)
                continue
            if call._window is not None and not call._window.done():
                call._window.set_result(None)
            if call._pending_status is not None:
                status, call._pending_status = call._pending_status, None
                self._close_call(call, status)

    async def _wait_drained(self) -> None:
        if self._drained is None or self._drained.done():
            self._drained = self.loop.create_future()
        await self._drained

    def credit_stream(self, call: RpcContext, size: int) -> None:
        """Gives the peer back ``size`` bytes of the stream's window."""
        if self._calls.get(call.stream_id) is call and not call.half_closed:
            self._send(_frame(_WINDOW_UPDATE, 0, call.stream_id, size.to_bytes(4, "big")))

    def go_away(self) -> None:
        """Asks the peer to open no new streams here; the connection closes when its streams
        are done (max connection age, drain). In two steps, as gRPC does: a GOAWAY naming no
        last stream and a PING; once the PING comes back, every stream the peer opened before
        it saw the GOAWAY has arrived, and the final GOAWAY names the last. A stream the peer
        sent meanwhile is served, not refused (Envoy would answer its request 503)."""
        if self._goaway_announced or self._closing:
            return
        self._goaway_announced = True
        self._send(
            _frame(_GOAWAY, 0, 0, _MAX_WINDOW.to_bytes(4, "big") + _NO_ERROR.to_bytes(4, "big"))
            + _frame(_PING, 0, 0, _GOAWAY_PING)
        )
        self._timers.append(self.loop.call_later(_GOAWAY_PING_TIMEOUT, self._final_goaway))

    def _final_goaway(self) -> None:
        if self._goaway_sent or self._closing:
            return
        self._goaway_sent = True
        self._send(
            _frame(
                _GOAWAY, 0, 0, self._last_stream.to_bytes(4, "big") + _NO_ERROR.to_bytes(4, "big")
            )
        )
        self._maybe_close()

    def _maybe_close(self) -> None:
        """After the final GOAWAY, once nothing is owed: the peer closes (it has no stream
        left here), or we do after ``_CLOSE_LINGER``. Closing at once would lose the last
        status if the peer is still sending: its data would meet a closed socket, whose
        reset can discard what the peer had received and not yet read."""
        if (
            self._goaway_sent
            and not self._calls
            and not self._parked
            and self._transport is not None
            and not self._lingering
        ):
            self._lingering = True
            self._flush()
            self._timers.append(self.loop.call_later(_CLOSE_LINGER, self._close_now))

    def _close_now(self) -> None:
        if self._transport is not None and not self._closing:
            self._flush()
            self._closing = True
            self._transport.close()

    def cancel_calls(self) -> None:
        """Ends every call still open with UNAVAILABLE (a drain past its grace)."""
        for call in list(self._calls.values()):
            self._end_call(call, grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
            call.fail()
        self._flush()

    def shutdown(self) -> None:
        """Sends what is still owed (held statuses, the final GOAWAY) and closes."""
        if self._transport is None or self._closing:
            return
        for stream_id in list(self._parked):
            self._send_parked(stream_id)
        self._final_goaway()
        self._maybe_close()

    def _fail_connection(self, code: int, reason: str) -> None:
        self.server.log.info("HTTP/2 connection closed: %s", reason)
        if self._transport is None or self._closing:
            return
        self._out.append(
            _frame(
                _GOAWAY,
                0,
                0,
                self._last_stream.to_bytes(4, "big")
                + code.to_bytes(4, "big")
                + reason.encode()[:256],
            )
        )
        self._flush()
        self._closing = True
        for call in list(self._calls.values()):
            call.fail()
        self._calls.clear()
        self._transport.close()

    @property
    def calls(self) -> int:
        return len(self._calls)


def _parse_timeout(value: bytes) -> float | None:
    text = value.decode("latin-1")
    if 2 <= len(text) <= 9 and text[:-1].isdigit() and text[-1] in _TIMEOUT_UNITS:
        return int(text[:-1]) * _TIMEOUT_UNITS[text[-1]]
    return None


class H2GrpcServer:
    """Serves ``handlers`` (``/package.Service/Method`` → ``MethodHandler``) on one port.

    ``ssl`` (with ALPN ``h2``) serves TLS; ``ssl_for_handshake``, if given, is asked for
    the context at every handshake (certificate reload). ``max_concurrent_rpcs`` bounds the
    calls of the whole server (past it: ``RESOURCE_EXHAUSTED``), ``max_streams_per_connection``
    one connection's (SETTINGS_MAX_CONCURRENT_STREAMS; past it: REFUSED_STREAM).
    ``max_connection_age`` asks each connection to reconnect after about that many seconds
    (GOAWAY; its streams finish). ``reuse_port`` binds with SO_REUSEPORT;
    ``start_handed`` serves the connections another process accepted and hands over
    (a pod's worker)."""

    def __init__(
        self,
        handlers: dict[str, MethodHandler],
        *,
        ssl_context: ssl.SSLContext | None = None,
        max_concurrent_rpcs: int = 0,
        max_streams_per_connection: int = 0,
        max_receive_message_length: int = 4 * 1024 * 1024,
        max_send_message_length: int = 4 * 1024 * 1024,
        max_connection_age: float = 0.0,
        reuse_port: bool = False,
        handshake_timeout: float = 20.0,
    ) -> None:
        self.handlers = handlers
        self._ssl = ssl_context
        self.max_concurrent_rpcs = max_concurrent_rpcs
        self.max_streams_per_connection = max_streams_per_connection
        self.max_receive_message_length = max_receive_message_length
        self.max_send_message_length = max_send_message_length
        self.max_connection_age = max_connection_age
        self.handshake_timeout = handshake_timeout
        self._reuse_port = reuse_port
        self.connections: set[_Connection] = set()
        self.active_calls = 0
        self.no_calls = asyncio.Event()  # set while active_calls is 0
        self.no_calls.set()
        self.no_connections = asyncio.Event()
        self.no_connections.set()
        self.draining = False
        self.log = LogLimiter(logger)  # a line per connection a peer breaks: a bounded rate
        # strikes per peer host (see _Connection.penalize): count, time of the last
        self._strikes: dict[str, tuple[int, float]] = {}
        self._server: asyncio.Server | None = None
        self._handoff: socket.socket | None = None
        self._adopting: set[asyncio.Task[None]] = set()
        #: connections taken off the handoff socket, and calls started, since the start
        self.handed_received = 0
        self.calls_started = 0

    def accepting_connections(self) -> int:
        """The connections open that have not been asked to go away: those a peer may still
        open streams on."""
        return sum(1 for c in self.connections if not c.going_away)

    def strike(self, host: str, now: float) -> int:
        """Counts a protocol break by a peer on ``host``; returns its strikes in a row (those
        not forgotten after ``_PENALTY_FORGET`` seconds without one)."""
        count, last = self._strikes.pop(host, (0, now))
        count = count + 1 if now - last < _PENALTY_FORGET else 1
        self._strikes[host] = (count, now)  # re-inserted: the dict stays oldest first
        if len(self._strikes) > _PENALTY_HOSTS:
            del self._strikes[next(iter(self._strikes))]
        return count

    async def start(self, host: str, port: int) -> int:
        """Binds and listens; returns the port bound. Raises ``OSError`` if it cannot."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Connection(self),
            host or None,
            port,
            ssl=self._ssl,
            reuse_port=self._reuse_port or None,
            backlog=1024,
        )
        return int(self._server.sockets[0].getsockname()[1])

    def start_handed(self, handoff: socket.socket) -> None:
        """Serves the connections that arrive on ``handoff`` (a unix socket carrying one
        accepted TCP socket per message, ``socket.send_fds``) instead of listening. A
        connection handed over while draining is served a GOAWAY at once; the end of
        ``handoff`` (its sender gone) stops the adoption, not the connections served."""
        handoff.setblocking(False)
        self._handoff = handoff
        asyncio.get_running_loop().add_reader(handoff.fileno(), self._take_handed)

    def _take_handed(self) -> None:
        handoff = self._handoff
        assert handoff is not None
        loop = asyncio.get_running_loop()
        while True:
            try:
                message, fds, _, _ = socket.recv_fds(handoff, 16, 4)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                logger.warning("connection handoff failed: %s; no more connections", exc)
                self._close_handoff()
                return
            if not message and not fds:
                self._close_handoff()
                return
            for fd in fds:
                self.handed_received += 1
                task = loop.create_task(self._adopt(socket.socket(fileno=fd)))
                self._adopting.add(task)
                task.add_done_callback(self._adopting.discard)

    async def _adopt(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        try:
            await loop.connect_accepted_socket(lambda: _Connection(self), sock, ssl=self._ssl)
        except (OSError, ssl.SSLError) as exc:  # a failed handshake: that connection only
            logger.debug("connection handed over but not served: %s", exc)
            sock.close()

    def _close_handoff(self) -> None:
        if self._handoff is not None:
            asyncio.get_running_loop().remove_reader(self._handoff.fileno())
            self._handoff.close()
            self._handoff = None

    async def stop(self, grace: float) -> None:
        """Stops accepting, asks every connection to open no new stream, waits up to
        ``grace`` seconds for the calls open, then ends them with UNAVAILABLE."""
        self.draining = True
        if self._server is not None:
            self._server.close()
        for connection in list(self.connections):
            connection.go_away()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.no_calls.wait(), grace)
        for connection in list(self.connections):
            connection.cancel_calls()
        await self.no_calls.wait()
        for connection in list(self.connections):
            connection.shutdown()
        # the peers close their side once they read the last statuses (or we do, lingering)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.no_connections.wait(), _CLOSE_LINGER + 0.5)
        self._server = None
        self._close_handoff()
