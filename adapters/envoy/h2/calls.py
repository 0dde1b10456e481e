"""The gRPC call layer over one HTTP/2 stream: a request's headers checked and turned into
a call (or an answer that opens none), messages cut from DATA by their 5-byte prefix,
the handler run on a context with ``read()``, ``write()`` and ``abort()`` (the subset of
``grpc.aio.ServicerContext`` the EPP's handlers use), and its status sent in trailers.

A call reaches its stream through ``CallTransport``, which the connection implements; the
server's calls are counted in a ``CallRegistry``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import quote

import grpc

from adapters.envoy.h2.flow import (
    STREAM_WINDOW,
    UNRESERVED_MESSAGE,
    ConnectionWindows,
    HeldBytes,
    StreamWindows,
)
from adapters.envoy.h2.frames import DATA
from adapters.envoy.h2.headers import Headers, never_indexed
from adapters.envoy.h2.limits import H2Limits

__all__ = [
    "RESPONSE_HEADERS",
    "CallAbortedError",
    "CallRegistry",
    "CallTransport",
    "MethodHandler",
    "Refusal",
    "RpcContext",
    "open_call",
    "parse_timeout",
    "run_call",
]

logger = logging.getLogger(__name__)

_MAX_ECHOED_PATH = 128
RESPONSE_HEADERS = never_indexed([(":status", "200"), ("content-type", "application/grpc")])
_TRAILERS_OK = never_indexed([("grpc-status", "0")])
# a message larger than this (prefix included) is received into a buffer of its size
LARGE_MESSAGE = 64 * 1024
_TIMEOUT_UNITS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}


@functools.lru_cache(maxsize=256)  # statuses repeat: a refused stream's is a fixed text
def status_block(code: grpc.StatusCode, details: str, *, trailers_only: bool) -> bytes:
    headers = [(":status", "200"), ("content-type", "application/grpc")] if trailers_only else []
    headers.append(("grpc-status", str(code.value[0])))
    if details:
        # gRPC's percent-encoding: printable ASCII but '%' as is, the rest as %XX of UTF-8
        headers.append(("grpc-message", quote(details, safe=" !\"#$&'()*+,-./:;<=>?@[\\]^_`{|}~")))
    return never_indexed(headers)


@functools.lru_cache(maxsize=32)
def _http_status_block(status: int) -> bytes:
    return never_indexed([(":status", str(status))])


def _method_not_found(path: bytes) -> str:
    # The path is named only when short and printable: echoed in full, a peer's request of
    # a few bytes (its :path indexed in HPACK) would be answered with kilobytes.
    if len(path) <= _MAX_ECHOED_PATH and path.isascii() and path.decode("ascii").isprintable():
        return f"Method not found: {path.decode('ascii')}"
    return "Method not found"


def parse_timeout(value: bytes) -> float | None:
    """``grpc-timeout`` in seconds (None if malformed)."""
    text = value.decode("latin-1")
    if 2 <= len(text) <= 9 and text[:-1].isdigit() and text[-1] in _TIMEOUT_UNITS:
        return int(text[:-1]) * _TIMEOUT_UNITS[text[-1]]
    return None


class CallAbortedError(Exception):
    """Ends a call with a status (``RpcContext.abort``, or a message the call refuses)."""

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


class CallTransport(Protocol):
    """What a call needs of its connection."""

    loop: asyncio.AbstractEventLoop
    limits: H2Limits
    windows: ConnectionWindows
    held: HeldBytes  # the connection's reservations for large messages being received

    @property
    def writable(self) -> bool:
        """Open, and its peer reads what we send (no transport back-pressure)."""

    @property
    def closing(self) -> bool:
        """Closed, or closing."""

    @property
    def paused(self) -> bool:
        """The peer does not read what we send (transport back-pressure)."""

    async def wait_drained(self) -> None: ...

    def send_frame(self, data: bytes) -> None: ...

    def send_headers(self, stream_id: int, block: bytes, end_stream: bool) -> None: ...

    async def send_data(self, call: RpcContext, data: bytes) -> None: ...

    def credit_stream(self, call: RpcContext, size: int) -> None: ...

    def penalize(self, longest: float) -> None: ...

    def adopt(self, call: RpcContext) -> None:
        """The call is its stream's from now on."""

    def owns(self, call: RpcContext) -> bool:
        """The call is still its stream's (not reset, not ended)."""

    def end_call(self, call: RpcContext, code: grpc.StatusCode, details: str) -> None:
        """Sends the call's status (after its data waiting for window) and closes it."""


class CallRegistry:
    """The server's methods and its calls: how many are open (``no_calls`` is set while
    none is), started since the start, and the bound on open calls."""

    def __init__(self, handlers: dict[str, MethodHandler], max_concurrent_rpcs: int) -> None:
        self.handlers = handlers
        self.max_concurrent_rpcs = max_concurrent_rpcs
        self.active = 0
        self.started = 0
        self.no_calls = asyncio.Event()
        self.no_calls.set()

    def full(self) -> bool:
        return bool(self.max_concurrent_rpcs) and self.active >= self.max_concurrent_rpcs

    def add(self) -> None:
        self.active += 1
        self.started += 1
        self.no_calls.clear()

    def remove(self) -> None:
        self.active -= 1
        if not self.active:
            self.no_calls.set()


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
        "_data_head",
        "_deadline",
        "_ended",
        "_error",
        "_headers_sent",
        "_large",
        "_message",
        "_need",
        "_parts",
        "_queue",
        "_queued_bytes",
        "_reader",
        "_reserved",
        "_transport",
        "half_closed",
        "handler",
        "inline",
        "stream_id",
        "task",
        "windows",
    )

    def __init__(self, transport: CallTransport, stream_id: int, handler: MethodHandler) -> None:
        self._transport = transport
        self.stream_id = stream_id
        self.windows = StreamWindows(stream_id, transport.windows.initial_window)
        # a DATA frame's type, flags and stream, and the message's "not compressed" byte
        self._data_head = bytes((DATA, 0)) + stream_id.to_bytes(4, "big") + b"\x00"
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
        # the message being reassembled's reservation (flow.HeldBytes): its size once
        # reserved, -1 while it waits for one, 0 when there is none
        self._reserved = 0
        self._large: bytearray | None = None  # a large message's buffer (_hold_large)
        self._deadline: asyncio.TimerHandle | None = None
        self.inline: Callable[[Any], Any] | None = None

    # -- what the handler calls --

    async def read(self) -> Any:
        queue = self._queue
        while True:
            if not queue:
                if self.half_closed:
                    return grpc.aio.EOF
                self._reader = self._transport.loop.create_future()
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
        # Everything received is credited back but the messages no one has read, and the
        # message not yet whole unless it is reserved: a handler that does not read, or a
        # peer that does not finish its message, is stopped within one window.
        held = self._queued_bytes
        if self._reserved <= 0 and (self._parts or self._large is not None):
            held += self._message
        credit = self.windows.credit(held)
        if credit:
            self._transport.credit_stream(self, credit)

    async def write(self, response: Any) -> None:
        if self._ended:
            raise CallAbortedError(grpc.StatusCode.CANCELLED, "the call is over")
        data = self.handler.serializer(response)
        transport = self._transport
        limit = transport.limits.max_send_message_length
        if len(data) > limit:
            raise CallAbortedError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"response of {len(data)} bytes exceeds the limit ({limit})",
            )
        if self._send_now((data,)):
            # the common case: one DATA frame, sent as it is built
            if transport.paused:
                await transport.wait_drained()
            return
        if not self._headers_sent:
            self._headers_sent = True
            transport.send_headers(self.stream_id, RESPONSE_HEADERS, end_stream=False)
        await transport.send_data(self, b"\x00" + len(data).to_bytes(4, "big") + data)

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise CallAbortedError(code, details)

    def penalize_peer(self, longest: float) -> None:
        """The peer broke the call's protocol (no gateway does): its connection is not read
        for a while (10 ms, doubling with each such call from its host in a row, at most
        ``longest`` seconds), so a peer that breaks it in a loop gets little of the event
        loop. Its calls already read go on."""
        self._transport.penalize(longest)

    # -- what the connection calls --

    def receive(self, payload: bytes, end_stream: bool) -> None:
        """A DATA payload: complete messages go to the queue, the rest waits for more."""
        if self._ended:
            payload = b""  # the call is over: its status waits for the window, say
        received = bool(payload)
        if received and self._large is not None:
            payload = self._fill(self._large, payload)
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
                    self._release()  # one that waited for its reservation, and came whole
                    self._deliver(joined, 0, self._need)
                    rest = joined[self._need :]
                    self._parts = [rest] if rest else []
                    self._message = len(rest)
                    self._need = self._size_of(rest) if rest else -1
            limit = self._transport.limits.max_receive_message_length
            if self._need > 5 + limit:
                raise CallAbortedError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"received message of {self._need - 5} bytes exceeds the limit ({limit})",
                )
        if self._need > LARGE_MESSAGE and self._parts:
            self._hold_large()
        if received:
            self._return_credit()
        if end_stream:
            self.half_closed = True
            if self._parts or self._large is not None:
                raise CallAbortedError(
                    grpc.StatusCode.INTERNAL, "the stream ended inside a message"
                )
        reader = self._reader
        if reader is not None and not reader.done() and (self._queue or end_stream):
            reader.set_result(None)

    def _hold_large(self) -> None:
        """A message larger than ``LARGE_MESSAGE`` is received into a buffer of its size,
        with no copy to join its parts; the allocator maps a large one apart and gives it
        back to the system when it goes (16 KiB parts left in its heap may stay there). One
        larger than ``UNRESERVED_MESSAGE`` is reserved first; until it is, its buffer is a
        stream window (what the peer may send without credit). (An anonymous mapping of
        its own for each cost 1.5 times the CPU: page faults and zeroing for every one.)"""
        need = self._need
        if need > UNRESERVED_MESSAGE and not self._transport.held.reserve(
            self, need, self._granted
        ):
            self._reserved = -1
            self._map(min(need, STREAM_WINDOW))
            return
        if need > UNRESERVED_MESSAGE:
            self._reserved = need
        self._map(need)

    def _granted(self) -> None:
        self._reserved = self._need
        self._map(self._need)
        self._return_credit()

    def _map(self, size: int) -> None:
        large = bytearray(size)
        if self._large is not None:
            large[: self._message] = self._large[: self._message]
        start = 0
        for part in self._parts:
            large[start : start + len(part)] = part
            start += len(part)
        self._parts = []
        self._large = large

    def _fill(self, large: bytearray, payload: bytes) -> bytes:
        """Copies ``payload`` into the large message; delivers it once whole. Returns what
        follows it in ``payload``."""
        have, need = self._message, self._need
        take = min(len(payload), need - have)
        large[have : have + take] = payload[:take] if take < len(payload) else payload
        self._message = have + take
        if self._message < need:
            return b""
        self._large = None
        self._message = 0
        self._need = -1
        self._release()
        self._deliver(large, 0, need)
        return payload[take:]

    def _release(self) -> None:
        if self._reserved:
            self._transport.held.release(self, max(self._reserved, 0))
            self._reserved = 0

    def _size_of(self, head: bytes) -> int:
        return 5 + int.from_bytes(head[1:5], "big") if len(head) >= 5 else -1

    def _deliver(self, buffer: bytes | bytearray, start: int, end: int) -> None:
        """Queues the message at ``buffer[start:end]`` (its 5-byte prefix included)."""
        if buffer[start] != 0:
            raise CallAbortedError(
                grpc.StatusCode.UNIMPLEMENTED if buffer[start] == 1 else grpc.StatusCode.INTERNAL,
                "compressed messages are not accepted (grpc-encoding: identity)",
            )
        size = end - start
        limit = self._transport.limits.max_receive_message_length
        if size - 5 > limit:
            raise CallAbortedError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"received message of {size - 5} bytes exceeds the limit ({limit})",
            )
        try:
            request = self.handler.deserializer(memoryview(buffer)[start + 5 : end])
        except Exception as exc:
            raise CallAbortedError(
                grpc.StatusCode.INTERNAL, f"cannot parse the request: {exc}"
            ) from None
        inline = self.inline
        if (
            inline is not None
            and self._reader is not None
            and not self._queue
            and not self.windows.pending
            and not self._ended
            and self._transport.writable
        ):
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
        limit = self._transport.limits.max_send_message_length
        return all(len(d) <= limit for d in data) and self._send_now(data)

    def _send_now(self, messages: Sequence[bytes]) -> bool:
        """Sends each message as one DATA frame (the response headers first, once) if they
        all fit the stream's and the connection's windows and the peer's frame size now,
        with nothing of this stream waiting before them; else sends nothing (False)."""
        transport = self._transport
        windows = self.windows
        if windows.pending or transport.closing:
            return False
        size = largest = 0
        for data in messages:
            framed = len(data) + 5
            largest = max(largest, framed)
            size += framed
        if not transport.windows.take(windows, size, largest):
            return False
        if not self._headers_sent:
            self._headers_sent = True
            transport.send_headers(self.stream_id, RESPONSE_HEADERS, end_stream=False)
        head = self._data_head
        send = transport.send_frame
        for data in messages:
            framed = len(data) + 5
            send(framed.to_bytes(3, "big") + head + len(data).to_bytes(4, "big") + data)
        return True

    def start(self, registry: CallRegistry, timeout: float | None) -> None:
        """Runs the handler in a task of its own, counted in ``registry`` until the task is
        done (even if it is cancelled before it starts: a reset or an error in the same read
        as the HEADERS), within ``timeout`` seconds if given (``grpc-timeout``)."""
        registry.add()
        loop = self._transport.loop
        self.task = loop.create_task(run_call(self))
        self.task.add_done_callback(functools.partial(self._done, registry))
        if timeout is not None:
            self._deadline = loop.call_later(timeout, self._expire)

    def _done(self, registry: CallRegistry, _task: object) -> None:
        registry.remove()
        if self._deadline is not None:
            self._deadline.cancel()

    def _expire(self) -> None:
        if self._transport.owns(self):
            self._transport.end_call(self, grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
            self.fail()

    def finish(self, code: grpc.StatusCode, details: str) -> None:
        """Sends the call's status, unless its stream is already gone."""
        if self._transport.owns(self):
            self._transport.end_call(self, code, details)

    def status(self, code: grpc.StatusCode, details: str) -> bytes | None:
        """Ends the call with a status; returns its header block (None if it had ended)."""
        if self._ended:
            return None
        self._ended = True
        self._drop_partial()
        if code is grpc.StatusCode.OK and self._headers_sent:
            block = _TRAILERS_OK
        else:
            block = status_block(code, details, trailers_only=not self._headers_sent)
        self._headers_sent = True
        self._error = code is not grpc.StatusCode.OK
        return block

    def _drop_partial(self) -> None:
        """The call is over: the message not yet whole goes, and its reservation."""
        self._release()
        self._parts = []
        self._large = None
        self._message = 0
        self._need = -1

    @property
    def failed(self) -> bool:
        """Ended with an error status."""
        return self._error

    @property
    def answered(self) -> bool:
        """Response headers (with a message, or a status) were sent."""
        return self._headers_sent

    def fail(self) -> None:
        """The stream is gone (reset, or the connection closed): wake and cancel the handler."""
        self._ended = True
        self.half_closed = True
        self._drop_partial()
        reader = self._reader
        if reader is not None and not reader.done():
            reader.cancel()
        self.windows.cancel()
        if self.task is not None and not self.task.done():
            self.task.cancel()


@dataclass(frozen=True, slots=True)
class Refusal:
    """A stream answered without a call: its header block."""

    block: bytes


def open_call(
    transport: CallTransport,
    registry: CallRegistry,
    stream_id: int,
    headers: Headers,
    end_stream: bool,
) -> RpcContext | Refusal:
    """Opens the call a request's headers ask for, or returns the answer to a request that
    opens none: 405 for a method but POST, 415 for a content type but gRPC's, UNIMPLEMENTED
    for a path not served, RESOURCE_EXHAUSTED past ``max_concurrent_rpcs``. The call
    returned is the stream's from then on (``transport.adopt``): started, or ended at once
    with UNIMPLEMENTED if its encoding is not ``identity``."""
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
            timeout = parse_timeout(value)
        elif name == b"grpc-encoding":
            encoding = value
    if method != b"POST":
        return Refusal(_http_status_block(405))
    if not content_type.startswith(b"application/grpc"):
        return Refusal(_http_status_block(415))
    handler = registry.handlers.get(path.decode("latin-1"))
    if handler is None:
        code, details = grpc.StatusCode.UNIMPLEMENTED, _method_not_found(path)
        return Refusal(status_block(code, details, trailers_only=True))
    if registry.full():
        code, details = grpc.StatusCode.RESOURCE_EXHAUSTED, "Concurrent RPC limit exceeded!"
        return Refusal(status_block(code, details, trailers_only=True))
    call = RpcContext(transport, stream_id, handler)
    if end_stream:
        call.half_closed = True
    transport.adopt(call)
    if encoding != b"identity":
        transport.end_call(call, grpc.StatusCode.UNIMPLEMENTED, "only identity encoding")
    else:
        call.start(registry, timeout)
    return call


async def run_call(call: RpcContext) -> None:
    """Runs the call's handler; its status (an abort's, CANCELLED, UNKNOWN for a handler
    that raised) is sent unless the stream is already gone."""
    handler = call.handler
    code, details = grpc.StatusCode.OK, ""
    try:
        if handler.streaming:
            await handler.function(None, call)
        else:
            request = await call.read()
            if request is grpc.aio.EOF:
                raise CallAbortedError(grpc.StatusCode.INTERNAL, "no request message")
            response = await handler.function(request, call)
            await call.write(response)
    except CallAbortedError as exc:
        code, details = exc.code, exc.details
    except asyncio.CancelledError:
        code, details = grpc.StatusCode.CANCELLED, "cancelled"
    except Exception as exc:
        logger.exception("gRPC handler failed")
        code, details = grpc.StatusCode.UNKNOWN, f"Unexpected {type(exc).__name__}: {exc}"
    call.finish(code, details)
