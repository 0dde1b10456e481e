"""HTTP/2 flow control (RFC 9113 5.2 and 6.9), both ways.

Receiving: a stream may have ``STREAM_WINDOW`` bytes in flight to us, the connection
``CONNECTION_WINDOW``. The connection's window is given back as bytes arrive (each stream's
own window bounds what waits unread); a stream's as its messages are read, in steps of
``CREDIT_BATCH``, so a handler that does not read stops its peer within one window.

Sending: what the peer's windows and frame size allow goes at once; the rest waits on its
stream (``StreamWindows.pending``) until a WINDOW_UPDATE or SETTINGS opens the windows.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Iterator

from adapters.envoy.h2.frames import (
    DATA,
    DEFAULT_WINDOW,
    FLOW_CONTROL_ERROR,
    FRAME_SIZE,
    MAX_WINDOW,
    H2ConnectionError,
    frame,
    window_update,
)

__all__ = [
    "CONNECTION_WINDOW",
    "CREDIT_BATCH",
    "STREAM_WINDOW",
    "ConnectionWindows",
    "StreamWindows",
]

# Our receive windows: a stream may have this many bytes in flight to us; the connection
# (all streams) the second. Credit returns as messages are read.
STREAM_WINDOW = 1 << 20
CONNECTION_WINDOW = 16 << 20
CREDIT_BATCH = STREAM_WINDOW // 4  # window returned in steps of at least this


class StreamWindows:
    """One stream's windows: what it may still send (``send``), what it received and has
    not credited back (``uncredited``), and the data (then the status) waiting for the
    peer's window, with the writer waiting for it."""

    __slots__ = ("pending", "pending_status", "send", "stream_id", "uncredited", "waiter")

    def __init__(self, stream_id: int, send: int) -> None:
        self.stream_id = stream_id
        self.send = send
        self.uncredited = 0
        self.pending = b""
        self.pending_status: bytes | None = None
        self.waiter: asyncio.Future[None] | None = None

    def receive(self, size: int) -> bool:
        """Counts ``size`` bytes received; False if they exceed the stream's window."""
        if self.uncredited + size > STREAM_WINDOW:
            return False
        self.uncredited += size
        return True

    def credit(self, held: int) -> int:
        """The credit to give back, all that was received but the ``held`` bytes, once it
        is at least ``CREDIT_BATCH`` (else 0)."""
        creditable = self.uncredited - held
        if creditable >= CREDIT_BATCH:
            self.uncredited -= creditable
            return creditable
        return 0

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def cancel(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.cancel()


class ConnectionWindows:
    """The connection's windows and the peer's frame size; the streams whose data waits for
    window, in turn. ``out`` sends a frame."""

    __slots__ = ("_blocked", "_out", "_received", "frame_size", "initial_window", "send")

    def __init__(self, out: Callable[[bytes], None]) -> None:
        self._out = out
        self.send = DEFAULT_WINDOW  # what we may still send on the connection
        self.initial_window = DEFAULT_WINDOW  # a new stream's send window (the peer's setting)
        self.frame_size = FRAME_SIZE  # the largest frame the peer accepts
        self._received = 0  # bytes received since the connection's window was last given back
        self._blocked: deque[StreamWindows] = deque()

    # -- receiving --

    def received(self, size: int) -> None:
        """Counts a DATA frame's ``size`` against the connection's window, given back in
        quarters."""
        self._received += size
        if self._received > CONNECTION_WINDOW:
            raise H2ConnectionError(FLOW_CONTROL_ERROR, "the connection window was exceeded")
        if self._received >= CONNECTION_WINDOW // 4:
            self._out(window_update(0, self._received))
            self._received = 0

    # -- sending --

    def take(self, stream: StreamWindows, size: int, largest: int) -> bool:
        """Spends ``size`` bytes of both windows if they allow it now and the largest frame
        (``largest`` bytes) fits the peer's frame size; else spends nothing (False)."""
        if largest > self.frame_size or size > stream.send or size > self.send:
            return False
        stream.send -= size
        self.send -= size
        return True

    def send_data(self, stream: StreamWindows, data: bytes) -> bool:
        """Sends what the windows allow as DATA frames; keeps the rest in ``stream.pending``
        (True if there is a rest: the stream then waits its turn)."""
        while data:
            allowed = min(stream.send, self.send, self.frame_size)
            if allowed <= 0:
                stream.pending = data
                return True
            chunk = data[:allowed] if allowed < len(data) else data
            data = data[len(chunk) :]
            stream.send -= len(chunk)
            self.send -= len(chunk)
            self._out(frame(DATA, 0, stream.stream_id, chunk))
        stream.pending = b""
        return False

    def block(self, stream: StreamWindows) -> None:
        self._blocked.append(stream)

    def unblocked(self, is_open: Callable[[StreamWindows], bool]) -> Iterator[StreamWindows]:
        """Sends what waits, in turn, as far as the windows now allow; yields each open
        stream whose data has all gone."""
        blocked = self._blocked
        for _ in range(len(blocked)):
            stream = blocked.popleft()
            if not is_open(stream):
                continue
            if self.send_data(stream, stream.pending):
                blocked.append(stream)
                continue
            yield stream

    def clear(self) -> None:
        self._blocked.clear()

    # -- the peer opens (or shrinks) the windows --

    def set_initial_window(self, value: int, streams: Iterator[StreamWindows]) -> None:
        """SETTINGS_INITIAL_WINDOW_SIZE: every open stream's window moves by the change."""
        delta = value - self.initial_window
        self.initial_window = value
        for stream in streams:
            stream.send += delta
            if stream.send > MAX_WINDOW:
                raise H2ConnectionError(FLOW_CONTROL_ERROR, "window too large")

    def grow(self, increment: int) -> None:
        """A WINDOW_UPDATE of the connection."""
        self.send += increment
        if self.send > MAX_WINDOW:
            raise H2ConnectionError(FLOW_CONTROL_ERROR, "connection window too large")
