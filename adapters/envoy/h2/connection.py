"""One HTTP/2 connection's state machine (RFC 9113 5 and 6): its streams, from HEADERS to
their end; the budgets a peer spends (control frames, resets); GOAWAY, in two steps for a
drain or a maximum age, at once for a connection error; and the close once nothing is owed.

Frames come from ``FrameReader`` (``frames``), header blocks are decoded by
``HeaderDecoder`` (``headers``), windows are kept by ``ConnectionWindows`` (``flow``), and a
stream that is a gRPC call is handed to the call layer (``calls.open_call``), which reaches
the connection back through the ``CallTransport`` methods below.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import deque
from typing import cast

import grpc

from adapters.envoy.h2.calls import CallAbortedError, CallRegistry, Refusal, RpcContext, open_call
from adapters.envoy.h2.flow import (
    CONNECTION_WINDOW,
    STREAM_WINDOW,
    ConnectionWindows,
    HeldBytes,
    StreamWindows,
)
from adapters.envoy.h2.frames import (
    ACK,
    CONTINUATION,
    DATA,
    DEFAULT_WINDOW,
    ENABLE_PUSH,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    FLOW_CONTROL_ERROR,
    GOAWAY,
    HEADERS,
    INITIAL_WINDOW_SIZE,
    MAX_CONCURRENT_STREAMS,
    MAX_FRAME_SIZE,
    MAX_HEADER_LIST_SIZE,
    MAX_WINDOW,
    NO_ERROR,
    PADDED,
    PING,
    PRIORITY,
    PROTOCOL_ERROR,
    PUSH_PROMISE,
    REFUSED_STREAM,
    RST_STREAM,
    SETTINGS,
    STREAM_CLOSED,
    WINDOW_UPDATE,
    FrameReader,
    H2ConnectionError,
    check_goaway,
    check_ping,
    check_rst_stream,
    frame,
    goaway,
    headers_payload,
    priority_error,
    rst_stream,
    settings_entries,
    unpad,
    window_increment,
    window_update,
)
from adapters.envoy.h2.headers import (
    MAX_HEADER_LIST_SIZE as HEADER_LIST_LIMIT,
)
from adapters.envoy.h2.headers import (
    HeaderAssembly,
    HeaderDecoder,
    malformed_request,
)
from adapters.envoy.h2.limits import H2Limits
from adapters.envoy.loglimit import LogLimiter

__all__ = ["Connection", "ConnectionSet"]

# Control frames a connection may send beyond the requests it makes; each request
# (HEADERS, or DATA with a payload) refills this many.
CONTROL_BUDGET = 1_000
CONTROL_REFILL = 10
# "Rapid reset" (CVE-2023-44487): streams opened and reset before we answered them, each a
# call started for nothing. A connection may reset RAPID_RESETS such streams at once and
# RAPID_RESET_RATE a second after that; past it, it is asked to go away (GOAWAY
# ENHANCE_YOUR_CALM) and its open calls finish. A stream reset after it was answered (a
# gateway's client that hung up) costs only itself and is not counted. (libnghttp2 allows
# 1,000 resets at once and 33 a second, counting every reset.)
RAPID_RESETS = 200
RAPID_RESET_RATE = 33.0
# seconds an error status may wait for the peer to finish sending (see _park)
PARK_DELAY = 0.5
_GOAWAY_PING = b"goaway\x00\x00"
_GOAWAY_PING_AGAIN = b"goaway\x00\x01"
GOAWAY_PING_TIMEOUT = 2.0  # seconds the final GOAWAY waits for a PING's answer
CLOSE_LINGER = 1.0  # seconds a finished connection waits for the peer to close it
# The most recent runs of stream identifiers a client skipped that are remembered: HEADERS
# on one of them opens a new stream below one already opened (RFC 9113 5.1.1:
# PROTOCOL_ERROR); on any other identifier at or below the last opened, it is on a closed
# stream (STREAM_CLOSED). Envoy and gRPC clients skip none.
SKIPPED_RUNS = 64
# A connection whose peer broke the protocol of a call (``RpcContext.penalize_peer``) is not
# read for a while: PENALTY_FIRST seconds, doubling with each strike of its host up to the
# handler's bound; a host's strikes are forgotten after PENALTY_FORGET seconds without one.
PENALTY_FIRST = 0.01
PENALTY_FORGET = 30.0
PENALTY_HOSTS = 4096  # hosts whose strikes are kept (the oldest forgotten first)
READ_SLICE = 0.002  # seconds of frames handled before the event loop is yielded


class ConnectionSet:
    """The server's open connections (``no_connections`` is set while there is none),
    whether it drains, the strikes of the peer hosts that broke a call's protocol, and the
    process's reservations for large messages being received (``held``)."""

    def __init__(self, logger: logging.Logger, held: HeldBytes) -> None:
        self.held = held
        self.connections: set[Connection] = set()
        self.no_connections = asyncio.Event()
        self.no_connections.set()
        self.draining = False
        self.log = LogLimiter(logger)  # a line per connection a peer breaks: a bounded rate
        self._strikes: dict[str, tuple[int, float]] = {}  # host: count, time of the last

    def add(self, connection: Connection) -> None:
        self.connections.add(connection)
        self.no_connections.clear()

    def discard(self, connection: Connection) -> None:
        self.connections.discard(connection)
        if not self.connections:
            self.no_connections.set()

    def strike(self, host: str, now: float) -> int:
        """Counts a protocol break by a peer on ``host``; returns its strikes in a row (those
        not forgotten after ``PENALTY_FORGET`` seconds without one)."""
        count, last = self._strikes.pop(host, (0, now))
        count = count + 1 if now - last < PENALTY_FORGET else 1
        self._strikes[host] = (count, now)  # re-inserted: the dict stays oldest first
        if len(self._strikes) > PENALTY_HOSTS:
            del self._strikes[next(iter(self._strikes))]
        return count


class Connection(asyncio.Protocol):
    """One HTTP/2 connection: frames in, calls started, frames out."""

    def __init__(self, peers: ConnectionSet, registry: CallRegistry, limits: H2Limits) -> None:
        self._peers = peers
        self._registry = registry
        self.limits = limits
        self.loop = asyncio.get_running_loop()
        self.windows = ConnectionWindows(self._send)
        self.held = HeldBytes(limits.held_per_connection, peers.held)
        self._transport: asyncio.Transport | None = None
        self._reader = FrameReader()
        self._calls: dict[int, RpcContext] = {}
        self._last_stream = 0
        self._skipped: deque[tuple[int, int]] = deque(maxlen=SKIPPED_RUNS)  # [first, end)
        self._goaway_announced = False  # the first GOAWAY (see go_away)
        self._goaway_sent = False  # the final one: new streams are refused
        self._lingering = False  # nothing left to serve: waiting for the peer to close
        self._closing = False
        self._decoder = HeaderDecoder()
        self._block = HeaderAssembly()  # a header block in progress
        self._control = CONTROL_BUDGET
        self._reset_budget = float(RAPID_RESETS)
        self._reset_time = self.loop.time()
        self._goaway_code = NO_ERROR
        self._goaway_timer: asyncio.TimerHandle | None = None  # the final GOAWAY's deadline
        self._out: list[bytes] = []
        self._flush_scheduled = False
        self._paused = False
        self._drained: asyncio.Future[None] | None = None
        self._timers: list[asyncio.TimerHandle] = []
        self._first_block = True
        # error statuses waiting for the peer's half-close, and their timers
        self._parked: dict[int, tuple[bytes, asyncio.TimerHandle]] = {}
        self._host = ""
        self._penalty: asyncio.TimerHandle | None = None  # reading paused till it fires
        self._yielding = False  # a read cut short: it goes on in the next pass
        self._slice_end = 0.0
        self._self_dependent = False  # the header block in progress: HEADERS depending on itself
        self._streams_opened = 0  # since the start (see _idle_check)
        self._idle_seen = -1  # streams opened at the last idle check, -1 if it was not idle

    # -- asyncio.Protocol --

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have its methods
        self._transport = transport = cast(asyncio.Transport, transport)
        peer = transport.get_extra_info("peername")
        self._host = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        self._peers.add(self)
        limits = self.limits
        settings = [(ENABLE_PUSH, 0), (INITIAL_WINDOW_SIZE, STREAM_WINDOW)]
        settings.append((MAX_HEADER_LIST_SIZE, HEADER_LIST_LIMIT))
        if limits.max_streams_per_connection:
            settings.append((MAX_CONCURRENT_STREAMS, limits.max_streams_per_connection))
        payload = b"".join(k.to_bytes(2, "big") + v.to_bytes(4, "big") for k, v in settings)
        transport.write(
            frame(SETTINGS, 0, 0, payload) + window_update(0, CONNECTION_WINDOW - DEFAULT_WINDOW)
        )
        self._timers.append(self.loop.call_later(limits.handshake_timeout, self._handshake_expired))
        if limits.idle_timeout:
            self._timers.append(self.loop.call_later(limits.idle_timeout, self._idle_check))
        age = limits.max_connection_age
        if age:
            self._timers.append(self.loop.call_later(age * random.uniform(0.9, 1.1), self.go_away))
        if self._peers.draining:
            self.go_away()

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing = True
        self._peers.discard(self)
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
        self.windows.clear()
        if self._drained is not None and not self._drained.done():
            self._drained.cancel()

    def pause_writing(self) -> None:
        # The peer does not read: neither do we, so nothing it asks for piles up here.
        self._paused = True
        self._update_reading()

    def resume_writing(self) -> None:
        self._paused = False
        self._update_reading()
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    def data_received(self, data: bytes) -> None:
        if self._penalty is not None or self._yielding:
            # A pause starts between reads; a transport that still hands over bytes it had
            # read is kept to the pause's end.
            self._reader.keep(data)
            return
        self._read(data)

    def eof_received(self) -> bool | None:
        return False

    def _update_reading(self) -> None:
        """Reads the transport unless the peer does not read ours, its connection is paused
        for a protocol break, or a read was cut short and goes on in the next pass."""
        transport = self._transport
        if transport is None or self._closing:
            return
        if self._paused or self._penalty is not None or self._yielding:
            transport.pause_reading()
        else:
            transport.resume_reading()

    def _read(self, data: bytes) -> None:
        """Handles the frames received, for at most ``READ_SLICE`` seconds (a frame once
        started is finished): what is left goes on in the next pass of the event loop, so
        one connection's large read does not hold up the others."""
        self._slice_end = self.loop.time() + READ_SLICE
        try:
            if self._reader.read(data, self._on_frame, self._stop_reading):
                self._timers[0].cancel()  # the preface came: no handshake timeout
        except H2ConnectionError as exc:
            self._fail_connection(exc.code, str(exc))
            return
        if self._yielding and not self._closing:
            self._update_reading()
            self.loop.call_soon(self._read_on)

    def _stop_reading(self) -> bool:
        if self._closing:
            return True
        if self.loop.time() > self._slice_end:
            self._yielding = True
            return True
        return False

    def _read_on(self) -> None:
        self._yielding = False
        if self._closing or self._transport is None:
            return
        if self._penalty is None:
            self._read(b"")
        if not self._yielding:
            self._update_reading()

    # -- what the server and its calls see --

    @property
    def going_away(self) -> bool:
        """Asked to open no new stream (GOAWAY sent), or closed."""
        return self._goaway_announced or self._closing

    @property
    def calls(self) -> int:
        return len(self._calls)

    @property
    def writable(self) -> bool:
        return not self._paused and not self._closing

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def closing(self) -> bool:
        return self._closing

    def write_buffer_size(self) -> int:
        """Bytes written and not yet taken by the peer."""
        return self._transport.get_write_buffer_size() if self._transport is not None else 0

    def reading(self) -> bool:
        """The transport is read (not paused)."""
        return self._transport is not None and self._transport.is_reading()

    # -- a peer that breaks the protocol --

    def penalize(self, longest: float) -> None:
        if self._closing or self._transport is None or longest <= 0:
            return
        strikes = self._peers.strike(self._host, self.loop.time())
        delay = min(PENALTY_FIRST * 2.0 ** min(strikes - 1, 30), longest)
        if self._penalty is not None:
            if self._penalty.when() >= self.loop.time() + delay:
                return
            self._penalty.cancel()
        self._penalty = self.loop.call_later(delay, self._end_penalty)
        self._update_reading()
        self._peers.log.info(
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
        self._update_reading()
        if self._reader.pending and not self._yielding:
            self._read(b"")  # what was kept meanwhile

    # -- frames in --

    def _on_frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        block = self._block
        if block.stream_id and (kind != CONTINUATION or stream_id != block.stream_id):
            raise H2ConnectionError(PROTOCOL_ERROR, "a header block was interrupted")
        if kind == DATA:
            self._on_data(flags, stream_id, payload)
        elif kind == HEADERS:
            self._on_headers(flags, stream_id, payload)
        elif kind == CONTINUATION:
            if not block.stream_id:
                raise H2ConnectionError(PROTOCOL_ERROR, "CONTINUATION without HEADERS")
            self._header_part(flags, payload)
        else:
            self._spend_control()
            if kind == SETTINGS:
                self._on_settings(flags, stream_id, payload)
            elif kind == WINDOW_UPDATE:
                self._on_window_update(stream_id, payload)
            elif kind == PING:
                check_ping(stream_id, payload)
                if not flags & ACK:
                    self._send(frame(PING, ACK, 0, payload))
                elif payload == _GOAWAY_PING and self._goaway_announced:
                    self._goaway_pinged()
                elif payload == _GOAWAY_PING_AGAIN and self._goaway_announced:
                    self._final_goaway()
            elif kind == RST_STREAM:
                check_rst_stream(stream_id, payload)
                if stream_id > self._last_stream:
                    raise H2ConnectionError(PROTOCOL_ERROR, "RST_STREAM on an idle stream")
                call = self._calls.pop(stream_id, None)
                if call is not None:
                    call.fail()
                    if not call.answered:
                        self._count_rapid_reset()
            elif kind == GOAWAY:
                check_goaway(stream_id, payload)
                self._closing_by_peer()
            elif kind == PRIORITY:
                code = priority_error(stream_id, payload)
                if code:
                    self._stream_error(stream_id, code)
            elif kind == PUSH_PROMISE:
                raise H2ConnectionError(PROTOCOL_ERROR, "a client may not push")
            # unknown frame types are ignored (RFC 9113 section 4.1)

    def _spend_control(self, units: int = 1) -> None:
        self._control -= units
        if self._control < 0:
            raise H2ConnectionError(ENHANCE_YOUR_CALM, "too many control frames")

    def _refill_control(self) -> None:
        self._control = min(self._control + CONTROL_REFILL, CONTROL_BUDGET)

    def _count_rapid_reset(self) -> None:
        now = self.loop.time()
        refill = (now - self._reset_time) * RAPID_RESET_RATE
        self._reset_budget = min(self._reset_budget + refill, RAPID_RESETS) - 1
        self._reset_time = now
        if self._reset_budget >= 0:
            return
        if not self._goaway_announced:
            self._peers.log.info(
                "HTTP/2 connection from %s asked to go away: streams reset before they were "
                "answered, more than %d at once or %g a second",
                self._host or "?",
                RAPID_RESETS,
                RAPID_RESET_RATE,
            )
            self.go_away(ENHANCE_YOUR_CALM)
        elif self._reset_budget < -RAPID_RESETS:
            self._final_goaway()  # it goes on while the GOAWAY's PING is under way

    def _on_data(self, flags: int, stream_id: int, payload: bytes) -> None:
        if not stream_id:
            raise H2ConnectionError(PROTOCOL_ERROR, "DATA on stream 0")
        size = len(payload)
        if flags & PADDED:
            payload = unpad(payload)
        # The connection's window is given back as bytes arrive: each stream's own window
        # bounds what waits unread.
        self.windows.received(size)
        if payload:
            self._refill_control()
        else:
            self._spend_control()
        call = self._calls.get(stream_id)
        if call is None:
            if stream_id > self._last_stream:
                raise H2ConnectionError(PROTOCOL_ERROR, "DATA on an idle stream")
            if self._parked and flags & END_STREAM:
                self._send_parked(stream_id)
            return  # a stream already closed, or refused
        if call.half_closed:
            self._reset(call, STREAM_CLOSED)
            return
        # padding included: it is credited with the rest
        if not call.windows.receive(size):
            self._reset(call, FLOW_CONTROL_ERROR)
            return
        try:
            call.receive(payload, bool(flags & END_STREAM))
        except CallAbortedError as exc:
            self.end_call(call, exc.code, exc.details)
            call.fail()

    def _on_headers(self, flags: int, stream_id: int, payload: bytes) -> None:
        if not stream_id or not stream_id & 1:
            raise H2ConnectionError(PROTOCOL_ERROR, "HEADERS on a stream a client may not open")
        fragment, depends_on_itself = headers_payload(flags, stream_id, payload)
        self._block.begin(stream_id, flags)
        self._self_dependent = depends_on_itself
        self._header_part(flags, fragment)

    def _header_part(self, flags: int, fragment: bytes) -> None:
        assembly = self._block
        stream_id, first_flags = assembly.stream_id, assembly.flags
        block = assembly.add(flags, fragment)
        if block is None:
            return
        headers, cost = self._decoder.decode(block)
        if cost:
            self._spend_control(cost)
        end_stream = bool(first_flags & END_STREAM)
        if self._parked and stream_id in self._parked:
            self._refill_control()
            self._send_parked(stream_id)  # the peer's trailers: it is done sending
            return
        call = self._calls.get(stream_id)
        if call is not None:
            # trailers from the client
            self._refill_control()
            if not end_stream:
                raise H2ConnectionError(PROTOCOL_ERROR, "a second header block without END_STREAM")
            call.receive(b"", True)
            return
        if stream_id <= self._last_stream:
            if any(first <= stream_id < end for first, end in self._skipped):
                raise H2ConnectionError(PROTOCOL_ERROR, "a new stream below one already opened")
            raise H2ConnectionError(STREAM_CLOSED, "HEADERS on a closed stream")
        if stream_id > self._last_stream + 2:
            self._skipped.append((self._last_stream + 1, stream_id))
        self._last_stream = stream_id
        self._streams_opened += 1
        if self._self_dependent or malformed_request(headers) is not None:
            # a stream error (RFC 9113 5.3.1, 8.1.1): no request, so no refill either
            self._spend_control()
            self._send(rst_stream(stream_id, PROTOCOL_ERROR))
            return
        limit = self.limits.max_streams_per_connection
        if self._goaway_sent or (limit and len(self._calls) >= limit):
            # a stream refused is no request: it spends the budget instead of refilling it
            self._spend_control()
            self._send(rst_stream(stream_id, REFUSED_STREAM))
            return
        self._refill_control()
        opened = open_call(self, self._registry, stream_id, headers, end_stream)
        if type(opened) is Refusal:
            self._answer(stream_id, opened.block, end_stream)

    def _on_settings(self, flags: int, stream_id: int, payload: bytes) -> None:
        entries = settings_entries(flags, stream_id, payload)
        if entries is None:
            return  # an acknowledgement
        initial_window = None
        for key, value in entries:
            if key == INITIAL_WINDOW_SIZE:
                initial_window = value  # the last one counts: applied once a frame
            elif key == MAX_FRAME_SIZE:
                self.windows.frame_size = value
            # header table size: we never index (see never_indexed); the rest is advice
        if initial_window is not None:
            streams = (call.windows for call in self._calls.values())
            self.windows.set_initial_window(initial_window, streams)
        self._send(frame(SETTINGS, ACK, 0))
        self._flush_blocked()

    def _on_window_update(self, stream_id: int, payload: bytes) -> None:
        increment = window_increment(payload)
        if not stream_id:
            if not increment:
                raise H2ConnectionError(PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
            self.windows.grow(increment)
        else:
            call = self._calls.get(stream_id)
            if call is None:
                if stream_id > self._last_stream:
                    raise H2ConnectionError(PROTOCOL_ERROR, "WINDOW_UPDATE on an idle stream")
                return
            if not increment:
                self._reset(call, PROTOCOL_ERROR)
                return
            call.windows.send += increment
            if call.windows.send > MAX_WINDOW:
                self._reset(call, FLOW_CONTROL_ERROR)
                return
        self._flush_blocked()

    def _stream_error(self, stream_id: int, code: int) -> None:
        """RST_STREAM of ``code`` (RFC 9113 5.4.2); the stream's call, if any, ends."""
        call = self._calls.get(stream_id)
        if call is not None:
            self._reset(call, code)
        else:
            self._send(rst_stream(stream_id, code))

    def _closing_by_peer(self) -> None:
        # The peer opens no new streams; the ones it has finish. Nothing else to do.
        return

    def _idle_check(self) -> None:
        """Every ``idle_timeout``: a connection that had no stream open at the last check
        and has opened none since, and has none now, is asked to go away (between one and
        two timeouts without a stream). One timer a connection, nothing on the hot path."""
        if self._closing or self._goaway_announced:
            return
        idle = not self._calls and not self._parked
        if idle and self._idle_seen == self._streams_opened:
            self._peers.log.info(
                "HTTP/2 connection from %s asked to go away: no stream for %g s",
                self._host or "?",
                self.limits.idle_timeout,
            )
            self.go_away()
            return
        self._idle_seen = self._streams_opened if idle else -1
        self._timers.append(self.loop.call_later(self.limits.idle_timeout, self._idle_check))

    def _handshake_expired(self) -> None:
        if not self._reader.preface_seen and self._transport is not None:
            self._transport.abort()

    # -- calls (CallTransport) --

    def adopt(self, call: RpcContext) -> None:
        self._calls[call.stream_id] = call

    def owns(self, call: RpcContext) -> bool:
        return self._calls.get(call.stream_id) is call

    def end_call(self, call: RpcContext, code: grpc.StatusCode, details: str) -> None:
        block = call.status(code, details)
        if block is None:
            return
        if call.windows.pending:
            call.windows.pending_status = block  # goes out after the data, when allowed
            return
        self._close_call(call, block)

    def _close_call(self, call: RpcContext, block: bytes) -> None:
        if self._closing:
            return
        if not call.failed or call.half_closed:
            self.send_headers(call.stream_id, block, end_stream=True)
        else:
            self._park(call.stream_id, block)
        self._calls.pop(call.stream_id, None)
        self._maybe_close()

    def _answer(self, stream_id: int, block: bytes, end_stream: bool) -> None:
        """Answers a stream that opens no call (see ``_park``)."""
        if end_stream:
            self.send_headers(stream_id, block, end_stream=True)
        else:
            self._park(stream_id, block)

    def _park(self, stream_id: int, block: bytes) -> None:
        """Holds an error status until the peer has finished sending (END_STREAM), at most
        ``PARK_DELAY``. A grpc-core client whose send is still under way when the status
        arrives fails the call as INTERNAL and loses the status; grpc.aio's own server
        answers late enough never to meet that. What the peer sends meanwhile is dropped
        (credited to the connection)."""
        timer = self.loop.call_later(PARK_DELAY, self._send_parked, stream_id)
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
        self._send(rst_stream(call.stream_id, code))
        self._maybe_close()

    # -- frames out --

    def _send(self, data: bytes) -> None:
        self._out.append(data)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.loop.call_soon(self._flush)

    send_frame = _send

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
        flags = END_HEADERS | (END_STREAM if end_stream else 0)
        size = self.windows.frame_size
        if len(block) <= size:
            self._send(frame(HEADERS, flags, stream_id, block))
            return
        parts = [block[i : i + size] for i in range(0, len(block), size)]
        first = END_STREAM if end_stream else 0
        self._send(frame(HEADERS, first, stream_id, parts[0]))
        for index, part in enumerate(parts[1:], start=2):
            self._send(
                frame(CONTINUATION, END_HEADERS if index == len(parts) else 0, stream_id, part)
            )

    async def send_data(self, call: RpcContext, data: bytes) -> None:
        if self._closing:
            raise CallAbortedError(grpc.StatusCode.UNAVAILABLE, "the connection is closed")
        stream = call.windows
        if stream.pending:
            stream.pending += data
        elif self.windows.send_data(stream, data):
            # out of window: the rest goes when the peer opens it, and the writer waits
            self.windows.block(stream)
        if stream.pending:
            stream.waiter = self.loop.create_future()
            try:
                await stream.waiter
            finally:
                stream.waiter = None
        if self._paused:
            await self.wait_drained()

    def _flush_blocked(self) -> None:
        for stream in self.windows.unblocked(self._is_open):
            stream.wake()
            if stream.pending_status is not None:
                status, stream.pending_status = stream.pending_status, None
                self._close_call(self._calls[stream.stream_id], status)

    def _is_open(self, stream: StreamWindows) -> bool:
        call = self._calls.get(stream.stream_id)
        return call is not None and call.windows is stream

    async def wait_drained(self) -> None:
        if self._drained is None or self._drained.done():
            self._drained = self.loop.create_future()
        await self._drained

    def credit_stream(self, call: RpcContext, size: int) -> None:
        """Gives the peer back ``size`` bytes of the stream's window."""
        if self._calls.get(call.stream_id) is call and not call.half_closed:
            self._send(window_update(call.stream_id, size))

    # -- the end: GOAWAY, drain, close --

    def go_away(self, code: int = NO_ERROR) -> None:
        """Asks the peer to open no new streams here; the connection closes when its streams
        are done (max connection age, drain, a peer that resets streams too fast: ``code``).
        In steps, as gRPC does: a GOAWAY naming no last stream and a PING; once the PING
        comes back the final GOAWAY names the last stream, and a stream the peer sent
        meanwhile is served, not refused (Envoy would answer its request 503). An HTTP/2
        stack sends a PING's answer ahead of HEADERS it had queued, so a stream the peer
        opened just before it read the GOAWAY can arrive after the answer (Envoy's do,
        under load): for ``NO_ERROR`` a second PING goes out after the first answer, and
        the final GOAWAY waits for its answer, by which time such HEADERS have left the
        peer. A peer that answers neither gets the final GOAWAY after
        ``GOAWAY_PING_TIMEOUT``."""
        if self._goaway_announced or self._closing:
            return
        self._goaway_announced = True
        self._goaway_code = code
        self._send(goaway(MAX_WINDOW, code) + frame(PING, 0, 0, _GOAWAY_PING))
        self._goaway_timer = self.loop.call_later(GOAWAY_PING_TIMEOUT, self._final_goaway)
        self._timers.append(self._goaway_timer)

    def _goaway_pinged(self) -> None:
        if self._goaway_code != NO_ERROR or self._goaway_sent or self._closing:
            self._final_goaway()
            return
        if self._goaway_timer is not None:
            self._goaway_timer.cancel()
        self._send(frame(PING, 0, 0, _GOAWAY_PING_AGAIN))
        self._goaway_timer = self.loop.call_later(GOAWAY_PING_TIMEOUT, self._final_goaway)
        self._timers.append(self._goaway_timer)

    def _final_goaway(self) -> None:
        if self._goaway_sent or self._closing:
            return
        self._goaway_sent = True
        self._send(goaway(self._last_stream, self._goaway_code))
        self._maybe_close()

    def _maybe_close(self) -> None:
        """After the final GOAWAY, once nothing is owed: the peer closes (it has no stream
        left here), or we do after ``CLOSE_LINGER``. Closing at once would lose the last
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
            self._timers.append(self.loop.call_later(CLOSE_LINGER, self._close_now))

    def _close_now(self) -> None:
        if self._transport is not None and not self._closing:
            self._flush()
            self._closing = True
            self._transport.close()

    def cancel_calls(self) -> None:
        """Ends every call still open with UNAVAILABLE (a drain past its grace)."""
        for call in list(self._calls.values()):
            self.end_call(call, grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
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
        self._peers.log.info("HTTP/2 connection closed: %s", reason)
        if self._transport is None or self._closing:
            return
        self._out.append(goaway(self._last_stream, code, reason.encode()[:256]))
        self._flush()
        self._closing = True
        for call in list(self._calls.values()):
            call.fail()
        self._calls.clear()
        self._transport.close()
