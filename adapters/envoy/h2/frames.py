"""HTTP/2 framing (RFC 9113 sections 4 and 6): the codes, frames built to send, frames cut
from the bytes a peer sends, and the checks of each frame's shape.

A frame that breaks the framing rules is a connection error: ``H2ConnectionError`` carries
the code the GOAWAY names. Nothing here knows streams or calls.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

__all__ = [
    "ACK",
    "CANCEL",
    "COMPRESSION_ERROR",
    "CONTINUATION",
    "DATA",
    "DEFAULT_WINDOW",
    "ENABLE_PUSH",
    "END_HEADERS",
    "END_STREAM",
    "ENHANCE_YOUR_CALM",
    "FLOW_CONTROL_ERROR",
    "FRAME_SIZE",
    "FRAME_SIZE_ERROR",
    "GOAWAY",
    "HEADERS",
    "HEADER_TABLE_SIZE",
    "INITIAL_WINDOW_SIZE",
    "INTERNAL_ERROR",
    "MAX_CONCURRENT_STREAMS",
    "MAX_FRAME_SIZE",
    "MAX_HEADER_LIST_SIZE",
    "MAX_SETTINGS",
    "MAX_WINDOW",
    "NO_ERROR",
    "PADDED",
    "PING",
    "PREFACE",
    "PRIORITY",
    "PROTOCOL_ERROR",
    "PUSH_PROMISE",
    "REFUSED_STREAM",
    "RST_STREAM",
    "SETTINGS",
    "STREAM_CLOSED",
    "WINDOW_UPDATE",
    "FrameReader",
    "H2ConnectionError",
    "check_ping",
    "check_priority",
    "check_rst_stream",
    "frame",
    "goaway",
    "headers_payload",
    "rst_stream",
    "settings_entries",
    "unpad",
    "window_increment",
    "window_update",
]

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# frame types (RFC 9113 section 6)
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS = 0x0, 0x1, 0x2, 0x3, 0x4
PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = 0x5, 0x6, 0x7, 0x8, 0x9
# flags
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
# error codes
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0x0, 0x1, 0x2, 0x3
STREAM_CLOSED, FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL = 0x5, 0x6, 0x7, 0x8
COMPRESSION_ERROR, ENHANCE_YOUR_CALM = 0x9, 0xB
# settings
HEADER_TABLE_SIZE, ENABLE_PUSH, MAX_CONCURRENT_STREAMS = 0x1, 0x2, 0x3
INITIAL_WINDOW_SIZE, MAX_FRAME_SIZE, MAX_HEADER_LIST_SIZE = 0x4, 0x5, 0x6

DEFAULT_WINDOW = 65_535
MAX_WINDOW = 2**31 - 1
FRAME_SIZE = 16_384  # what we accept, and what we send until the peer allows more
# Entries one SETTINGS frame may carry (libnghttp2's bound). RFC 9113 defines six settings;
# a 16 KiB frame of 2,730 entries is work for the receiver, not information.
MAX_SETTINGS = 32

# a frame header: length (24 bits) and type as one word, flags, stream id (RFC 9113 4.1)
_FRAME_HEADER = struct.Struct(">IBI")


class H2ConnectionError(Exception):
    """A connection error (RFC 9113 5.4.1): the connection ends with a GOAWAY of ``code``."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return (
        len(payload).to_bytes(3, "big")
        + bytes((kind, flags))
        + stream_id.to_bytes(4, "big")
        + payload
    )


def goaway(last_stream: int, code: int, debug: bytes = b"") -> bytes:
    return frame(GOAWAY, 0, 0, last_stream.to_bytes(4, "big") + code.to_bytes(4, "big") + debug)


def rst_stream(stream_id: int, code: int) -> bytes:
    return frame(RST_STREAM, 0, stream_id, code.to_bytes(4, "big"))


def window_update(stream_id: int, increment: int) -> bytes:
    return frame(WINDOW_UPDATE, 0, stream_id, increment.to_bytes(4, "big"))


# -- the shape of each frame --


def unpad(payload: bytes) -> bytes:
    """A PADDED frame's payload without its padding."""
    if not payload or payload[0] >= len(payload):
        raise H2ConnectionError(PROTOCOL_ERROR, "bad padding")
    return payload[1 : len(payload) - payload[0]]


def headers_payload(flags: int, payload: bytes) -> bytes:
    """A HEADERS frame's header block fragment: without padding and priority fields."""
    if flags & PADDED:
        payload = unpad(payload)
    if flags & PRIORITY_FLAG:
        if len(payload) < 5:
            raise H2ConnectionError(PROTOCOL_ERROR, "bad priority")
        payload = payload[5:]
    return payload


def check_ping(stream_id: int, payload: bytes) -> None:
    if len(payload) != 8 or stream_id:
        raise H2ConnectionError(FRAME_SIZE_ERROR, "bad PING")


def check_rst_stream(stream_id: int, payload: bytes) -> None:
    if len(payload) != 4 or not stream_id:
        raise H2ConnectionError(PROTOCOL_ERROR, "bad RST_STREAM")


def check_priority(stream_id: int, payload: bytes) -> None:
    if len(payload) != 5 or not stream_id:
        raise H2ConnectionError(PROTOCOL_ERROR, "bad PRIORITY")


def window_increment(payload: bytes) -> int:
    if len(payload) != 4:
        raise H2ConnectionError(FRAME_SIZE_ERROR, "bad WINDOW_UPDATE")
    return int.from_bytes(payload, "big") & MAX_WINDOW


def settings_entries(flags: int, stream_id: int, payload: bytes) -> list[tuple[int, int]] | None:
    """A SETTINGS frame's entries, each value checked (None for an acknowledgement); more
    than ``MAX_SETTINGS`` is ENHANCE_YOUR_CALM."""
    if stream_id:
        raise H2ConnectionError(PROTOCOL_ERROR, "SETTINGS on a stream")
    if flags & ACK:
        if payload:
            raise H2ConnectionError(FRAME_SIZE_ERROR, "SETTINGS ack with a payload")
        return None
    if len(payload) % 6:
        raise H2ConnectionError(FRAME_SIZE_ERROR, "SETTINGS of a bad length")
    if len(payload) > 6 * MAX_SETTINGS:
        raise H2ConnectionError(
            ENHANCE_YOUR_CALM, f"SETTINGS of {len(payload) // 6} entries (at most {MAX_SETTINGS})"
        )
    entries = []
    for offset in range(0, len(payload), 6):
        key = int.from_bytes(payload[offset : offset + 2], "big")
        value = int.from_bytes(payload[offset + 2 : offset + 6], "big")
        if key == INITIAL_WINDOW_SIZE and value > MAX_WINDOW:
            raise H2ConnectionError(FLOW_CONTROL_ERROR, "initial window too large")
        if key == MAX_FRAME_SIZE and not FRAME_SIZE <= value <= (1 << 24) - 1:
            raise H2ConnectionError(PROTOCOL_ERROR, "bad SETTINGS_MAX_FRAME_SIZE")
        if key == ENABLE_PUSH and value > 1:
            raise H2ConnectionError(PROTOCOL_ERROR, "bad SETTINGS_ENABLE_PUSH")
        entries.append((key, value))
    return entries


# -- frames cut from the bytes received --

OnFrame = Callable[[int, int, int, bytes], None]


class FrameReader:
    """Cuts what a peer sends into frames: the client preface first, then frames of at most
    ``FRAME_SIZE`` (a larger one is FRAME_SIZE_ERROR as soon as its header is read, never
    buffered). Bytes of an incomplete frame wait for the next read. ``read`` hands each
    frame to ``on_frame`` until ``stop()`` says so (the connection closed, or its time
    slice is spent); what is left waits for the next call."""

    __slots__ = ("_buffer", "preface_seen")

    def __init__(self) -> None:
        self._buffer = b""
        self.preface_seen = False

    @property
    def pending(self) -> int:
        """Bytes received and not yet handed over."""
        return len(self._buffer)

    def keep(self, data: bytes) -> None:
        """Keeps ``data`` for a later ``read`` without reading it now."""
        self._buffer += data

    def read(self, data: bytes, on_frame: OnFrame, stop: Callable[[], bool]) -> bool:
        """Hands over the frames in what was kept and ``data``; returns True when the
        preface has just been seen. Stops early (the rest kept) when ``stop()`` is true
        after a frame."""
        if self._buffer:
            data = self._buffer + data
            self._buffer = b""
        position = 0
        preface_now = False
        if not self.preface_seen:
            if len(data) < len(PREFACE):
                if not PREFACE.startswith(data):
                    raise H2ConnectionError(PROTOCOL_ERROR, "not an HTTP/2 preface")
                self._buffer = data
                return False
            if not data.startswith(PREFACE):
                raise H2ConnectionError(PROTOCOL_ERROR, "not an HTTP/2 preface")
            self.preface_seen = preface_now = True
            position = len(PREFACE)
        end = len(data)
        unpack = _FRAME_HEADER.unpack_from
        while end - position >= 9:
            word, flags, stream_id = unpack(data, position)
            length = word >> 8
            if length > FRAME_SIZE:
                raise H2ConnectionError(FRAME_SIZE_ERROR, f"frame of {length} bytes")
            if end - position - 9 < length:
                break
            payload = data[position + 9 : position + 9 + length]
            position += 9 + length
            on_frame(word & 0xFF, flags, stream_id & MAX_WINDOW, payload)
            if stop():
                break
        if position < end:
            self._buffer = data[position:]
        return preface_now
