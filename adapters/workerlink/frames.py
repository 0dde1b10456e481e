"""Length-prefixed frames over a unix stream socket, in two encodings.

A frame is a 4-byte big-endian length, then a payload whose first byte says how the rest is
encoded:

- ``P``: a pickled message (endpoint events, readiness, objectives, rules, raw poll results
  of sources with custom extractors, watch events, and the worker's hello and status).
  Only the pod's own processes reach the socket (a 0700 directory of the supervisor's
  user), so these are trusted like the processes themselves.
- ``M``: one endpoint's metrics snapshot (``MetricsSnapshot``), msgpack with a fixed,
  validated schema: the message the supervisor sends for every model-server poll, so it is
  compact (about 120 bytes instead of the ~11 KB ``/metrics`` body) and cheap to decode.

``read_frame`` returns the payload; a frame above ``MAX_FRAME_BYTES`` ends the connection
(``ValueError``: the stream cannot be trusted past it). ``decode_message`` raises
``MalformedFrameError`` for a payload it cannot read; the frame boundaries still hold, so
the reader skips that one frame and goes on.
"""

from __future__ import annotations

import asyncio
import math
import pickle
from typing import Annotated, Final

import msgspec

__all__ = [
    "MAX_FRAME_BYTES",
    "MalformedFrameError",
    "MetricsSnapshot",
    "decode_message",
    "encode_frame",
    "encode_snapshot_frame",
    "read_frame",
    "write_frame",
]

#: A model server's ``/metrics`` is bounded by the scrape client (64 MiB at most).
MAX_FRAME_BYTES = 80 * 1024 * 1024

_PICKLE: Final = b"P"
_SNAPSHOT: Final = b"M"

_Count = Annotated[int, msgspec.Meta(ge=0)]


class MalformedFrameError(Exception):
    """A frame whose payload cannot be decoded into a message (the link goes on)."""


class MetricsSnapshot(msgspec.Struct, array_like=True, frozen=True):
    """One endpoint's metrics as the supervisor's extractors left them: the values of the
    domain's ``EndpointMetrics``, field for field (``kv_cache_usage_percent`` a fraction in
    [0, 1]; ``update_time`` the supervisor's monotonic time of the scrape, one clock for
    the pod's processes on one host)."""

    waiting_queue_size: _Count
    running_requests_size: _Count
    kv_cache_usage_percent: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
    active_models: frozenset[str]
    waiting_models: frozenset[str]
    max_active_models: _Count
    cache_block_size: _Count
    cache_num_blocks: _Count
    update_time: float


class _SnapshotMessage(msgspec.Struct, array_like=True, frozen=True):
    source: str
    endpoint: str
    metrics: MetricsSnapshot


_snapshot_encoder: Final = msgspec.msgpack.Encoder()
_snapshot_decoder: Final = msgspec.msgpack.Decoder(_SnapshotMessage)


async def read_frame(reader: asyncio.StreamReader) -> bytes:
    """The next frame's payload; raises ``asyncio.IncompleteReadError`` at the end of the
    stream and ``ValueError`` for an oversized frame."""
    header = await reader.readexactly(4)
    size = int.from_bytes(header, "big")
    if size > MAX_FRAME_BYTES:
        raise ValueError(f"frame of {size} bytes is larger than {MAX_FRAME_BYTES}")
    return await reader.readexactly(size)


def decode_message(payload: bytes) -> object:
    """The message in one payload: a pickled object, or for a snapshot frame the tuple
    ``("poll", source, endpoint, MetricsSnapshot)``. Raises ``MalformedFrameError``."""
    tag = payload[:1]
    if tag == _SNAPSHOT:
        try:
            message = _snapshot_decoder.decode(payload[1:])
        except msgspec.MsgspecError as exc:
            raise MalformedFrameError(f"metrics snapshot: {exc}") from None
        if not math.isfinite(message.metrics.update_time):
            raise MalformedFrameError("metrics snapshot: update_time is not finite")
        return ("poll", message.source, message.endpoint, message.metrics)
    if tag == _PICKLE:
        try:
            return pickle.loads(payload[1:])
        except Exception as exc:  # unpickling garbage raises many kinds
            raise MalformedFrameError(f"pickled message: {exc!r}") from None
    raise MalformedFrameError(f"unknown frame type {tag!r}")


def _frame(payload: bytes) -> bytes:
    return len(payload).to_bytes(4, "big") + payload


def encode_frame(message: object) -> bytes:
    """One pickled frame, encoded once for any number of writers."""
    return _frame(_PICKLE + pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def encode_snapshot_frame(source: str, endpoint: str, metrics: MetricsSnapshot) -> bytes:
    """One metrics-snapshot frame (see the module docstring)."""
    return _frame(_SNAPSHOT + _snapshot_encoder.encode(_SnapshotMessage(source, endpoint, metrics)))


def write_frame(writer: asyncio.StreamWriter, message: object) -> None:
    writer.write(encode_frame(message))
