"""HTTP/2 frames by hand, for the raw-frame tests and benchmarks of the native transport
(``adapters/envoy/h2/``): frame and error codes, flags, and builders."""

from __future__ import annotations

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS = 0x0, 0x1, 0x2, 0x3, 0x4
PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = 0x6, 0x7, 0x8, 0x9
END_STREAM, ACK, END_HEADERS = 0x1, 0x1, 0x4
PROTOCOL_ERROR, FLOW_CONTROL_ERROR, STREAM_CLOSED, FRAME_SIZE_ERROR = 0x1, 0x3, 0x5, 0x6
REFUSED_STREAM, CANCEL, COMPRESSION_ERROR, ENHANCE_YOUR_CALM = 0x7, 0x8, 0x9, 0xB
INITIAL_WINDOW_SIZE = 0x4  # a SETTINGS parameter
MAX_WINDOW = 2**31 - 1


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    head = len(payload).to_bytes(3, "big") + bytes((kind, flags)) + stream_id.to_bytes(4, "big")
    return head + payload


def message(payload: bytes, flag: int = 0) -> bytes:
    """A gRPC length-prefixed message."""
    return bytes((flag,)) + len(payload).to_bytes(4, "big") + payload


def settings(*pairs: tuple[int, int]) -> bytes:
    body = b"".join(k.to_bytes(2, "big") + v.to_bytes(4, "big") for k, v in pairs)
    return frame(SETTINGS, 0, 0, body)
