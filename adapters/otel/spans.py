"""The spans the EPP records, and the W3C trace context they carry.

A sampled request records a ``RecordingSpan`` per timed operation: a slotted object holding
ids, name, kind, nanosecond timestamps, attributes and an error, and nothing else. Ending
it hands it to ``sink`` (the batch exporter's queue), where the event loop later encodes it
in a batch and a thread only sends the bytes.
This keeps a sampled span at about a microsecond on the request path, where an SDK span
(context objects, locks, bounded attributes, span processors) costs ten times that.

An ``UnsampledSpan`` records nothing and only passes the trace context on.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from random import Random

__all__ = [
    "KIND_INTERNAL",
    "KIND_SERVER",
    "TRACE_HEADERS",
    "ParentContext",
    "RecordingSpan",
    "UnsampledSpan",
    "new_span_id",
    "new_trace_id",
    "parse_traceparent",
]

#: OTLP ``Span.SpanKind`` values.
KIND_INTERNAL = 1
KIND_SERVER = 2

#: The headers that carry a trace on: W3C trace context and baggage.
TRACE_HEADERS = ("traceparent", "tracestate", "baggage")

_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")

_ids = Random()
_bits = _ids.getrandbits


@dataclass(frozen=True, slots=True)
class ParentContext:
    """A caller's span, from its ``traceparent``."""

    trace_id: int
    span_id: int
    sampled: bool


def parse_traceparent(value: str | None) -> ParentContext | None:
    """The caller's span from a W3C ``traceparent``, or None when absent or invalid (the
    request then starts a new trace, as the W3C recommendation says)."""
    if not value:
        return None
    match = _TRACEPARENT.fullmatch(value.strip())
    if match is None:
        return None
    version, trace_hex, span_hex, flags, rest = match.groups()
    if version == "ff" or (version == "00" and rest is not None):
        return None
    trace_id, span_id = int(trace_hex, 16), int(span_hex, 16)
    if not trace_id or not span_id:
        return None
    return ParentContext(trace_id, span_id, bool(int(flags, 16) & 1))


def new_trace_id() -> int:
    return _bits(128) or 1


def new_span_id() -> int:
    return _bits(64) or 1


class RecordingSpan:
    """A sampled span. ``end`` is idempotent and hands the span to ``sink``.

    ``onward`` are the caller's ``tracestate`` and ``baggage`` headers, passed on unchanged
    with this span's ``traceparent`` by ``inject``.
    """

    __slots__ = (
        "attributes",
        "end_ns",
        "error",
        "kind",
        "name",
        "onward",
        "parent_id",
        "remote_parent",
        "sink",
        "span_id",
        "start_ns",
        "trace_id",
    )

    recording = True

    def __init__(
        self,
        name: str,
        trace_id: int,
        parent_id: int,
        *,
        kind: int,
        sink: Callable[[RecordingSpan], None],
        onward: Mapping[str, str],
        remote_parent: bool = False,
        attributes: Mapping[str, str | int | float | bool] | None = None,
    ) -> None:
        self.name = name
        self.trace_id = trace_id
        self.span_id = _bits(64) or 1
        self.parent_id = parent_id
        self.remote_parent = remote_parent
        self.kind = kind
        self.sink = sink
        self.onward = onward
        self.attributes: dict[str, str | int | float | bool] = (
            dict(attributes) if attributes else {}
        )
        self.error: str | None = None
        self.end_ns = 0
        self.start_ns = time.time_ns()

    @property
    def trace_state(self) -> str:
        return self.onward.get("tracestate", "")

    def set_attribute(self, key: str, value: str | int | float | bool) -> None:
        self.attributes[key] = value

    def record_error(self, message: str) -> None:
        self.error = message

    def inject(self, carrier: MutableMapping[str, str]) -> None:
        carrier["traceparent"] = f"00-{self.trace_id:032x}-{self.span_id:016x}-01"
        if self.onward:
            carrier.update(self.onward)

    def end(self) -> None:
        if not self.end_ns:
            self.end_ns = time.time_ns()
            self.sink(self)

    def __repr__(self) -> str:
        return f"RecordingSpan({self.name!r}, {self.trace_id:032x}/{self.span_id:016x})"


class UnsampledSpan:
    """A span the sampler dropped: it records nothing, its children are itself, and it
    only carries the trace context on (``inject``), so the model server still joins the
    caller's trace.

    ``headers`` are the trace headers to pass on: a new unsampled ``traceparent`` for a new
    trace, or the caller's own ``traceparent``/``tracestate``/``baggage``.
    """

    __slots__ = ("headers",)

    recording = False

    def __init__(self, headers: Mapping[str, str]) -> None:
        self.headers = headers

    def set_attribute(self, key: str, value: str | int | float | bool) -> None:
        return None

    def record_error(self, message: str) -> None:
        return None

    def inject(self, carrier: MutableMapping[str, str]) -> None:
        carrier.update(self.headers)

    def end(self) -> None:
        return None
