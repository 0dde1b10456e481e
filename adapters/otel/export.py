"""Where finished spans go: a batching queue drained by a thread, and the span sinks.

``BatchSpanQueue`` takes each ended span on the event loop (a deque append) and a thread
exports them in batches, tuned like the SDK's batch processor by ``OTEL_BSP_*``. Sinks:

- ``OtlpGrpcSink``: OTLP over gRPC (the trace service of ``opentelemetry-proto``), each
  batch encoded straight into one ``ExportTraceServiceRequest``; retries the retryable
  status codes with backoff within the export timeout;
- ``ConsoleSink``: one JSON line per span on the ``epp.traces`` logger;
- ``SdkExporterSink``: hands the spans, as SDK ``ReadableSpan``, to any OpenTelemetry SDK
  ``SpanExporter`` (slower; for exporters this module does not implement).

Failing exports are logged when the state changes (failing, recovered), not per batch.
"""

from __future__ import annotations

import gzip
import logging
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Protocol, runtime_checkable

import grpc
import orjson
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, InstrumentationScope
from opentelemetry.proto.resource.v1.resource_pb2 import Resource as ResourceProto
from opentelemetry.proto.trace.v1.trace_pb2 import ScopeSpans as ScopeSpansProto
from opentelemetry.proto.trace.v1.trace_pb2 import Span as SpanProto
from opentelemetry.proto.trace.v1.trace_pb2 import SpanFlags
from opentelemetry.proto.trace.v1.trace_pb2 import Status as StatusProto
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope as SdkScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

from adapters.otel.spans import KIND_SERVER, RecordingSpan

__all__ = [
    "BatchSpanQueue",
    "ConsoleSink",
    "EncodingSink",
    "OtlpEncoder",
    "OtlpGrpcSink",
    "OtlpHttpSink",
    "SdkExporterSink",
    "SpanSink",
    "resource_proto",
]

logger = logging.getLogger(__name__)
console_logger = logging.getLogger("epp.traces")

EXPORT_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
#: Distinct attribute sets kept encoded (the export thread's; cleared when full).
_ATTRIBUTE_CACHE_SIZE = 4096
#: Seconds between two reports of spans dropped on a full queue.
DROP_REPORT_INTERVAL = 60.0
_SAMPLED_FLAGS = 0x01 | SpanFlags.SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK
_REMOTE_FLAGS = _SAMPLED_FLAGS | SpanFlags.SPAN_FLAGS_CONTEXT_IS_REMOTE_MASK
#: HTTP answers worth trying again (as the OTLP specification lists them).
_RETRYABLE_HTTP = frozenset({429, 502, 503, 504})
_RETRYABLE = frozenset(
    {
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DATA_LOSS,
    }
)


class SpanSink(Protocol):
    """Exports finished spans; called from the export thread only."""

    def export(self, spans: Sequence[RecordingSpan]) -> bool: ...

    def shutdown(self) -> None: ...


# encoding


def _set_value(target: AnyValue, value: object) -> None:
    if isinstance(value, bool):
        target.bool_value = value
    elif isinstance(value, int):
        target.int_value = value
    elif isinstance(value, float):
        target.double_value = value
    elif isinstance(value, str):
        target.string_value = value
    elif isinstance(value, Sequence) and not isinstance(value, bytes):
        values = target.array_value.values
        for item in value:
            _set_value(values.add(), item)
    else:
        target.string_value = str(value)


_encoded_attributes: dict[tuple[tuple[str, object], ...], bytes] = {}


def _attributes_bytes(attributes: Mapping[str, object]) -> bytes:
    """``attributes`` as the serialized attributes of a ``Span``, to merge into one.

    Attribute sets repeat (a plugin span's are fixed, most others take few values), so
    each set is encoded once and merged as bytes, which costs half of building it.
    """
    key = tuple(attributes.items())
    try:
        encoded = _encoded_attributes.get(key)
    except TypeError:  # an unhashable value
        encoded, key = None, ()
    if encoded is None:
        holder = SpanProto()
        for name, value in attributes.items():
            _set_value(holder.attributes.add(key=name).value, value)
        encoded = holder.SerializeToString()
        if key:
            if len(_encoded_attributes) >= _ATTRIBUTE_CACHE_SIZE:
                _encoded_attributes.clear()
            _encoded_attributes[key] = encoded
    return encoded


def resource_proto(resource: Resource) -> ResourceProto:
    proto = ResourceProto()
    for key, value in resource.attributes.items():
        _set_value(proto.attributes.add(key=key).value, value)
    return proto


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field: key, length, payload."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


class OtlpEncoder:
    """Spans into OTLP ``ExportTraceServiceRequest`` bytes, in two steps.

    ``fragment`` encodes some spans as a serialized ``ScopeSpans`` holding only them: the
    concatenation of their ``spans`` entries. ``request`` wraps fragments, concatenated,
    into one request with the resource and the scope (protobuf merges repeated fields of
    concatenated messages, so no fragment is decoded again).
    """

    def __init__(self, resource: Resource, scope: InstrumentationScope) -> None:
        self._resource_field = _field(1, resource_proto(resource).SerializeToString())
        self._scope_field = _field(1, scope.SerializeToString())

    def fragment(self, spans: Sequence[RecordingSpan]) -> bytes:
        holder = ScopeSpansProto()
        add = holder.spans.add
        for span in spans:
            out = add(
                trace_id=span.trace_id.to_bytes(16, "big"),
                span_id=span.span_id.to_bytes(8, "big"),
                name=span.name,
                kind=span.kind,
                start_time_unix_nano=span.start_ns,
                end_time_unix_nano=span.end_ns,
                flags=_REMOTE_FLAGS if span.remote_parent else _SAMPLED_FLAGS,
            )
            if span.parent_id:
                out.parent_span_id = span.parent_id.to_bytes(8, "big")
            trace_state = span.trace_state
            if trace_state:
                out.trace_state = trace_state
            if span.attributes:
                out.MergeFromString(_attributes_bytes(span.attributes))
            if span.error is not None:
                out.status.code = StatusProto.STATUS_CODE_ERROR
                out.status.message = span.error
        return holder.SerializeToString()

    def request(self, fragments: Sequence[bytes]) -> bytes:
        scope_spans = self._scope_field + b"".join(fragments)
        resource_spans = self._resource_field + _field(2, scope_spans)
        return _field(1, resource_spans)


# the queue


@runtime_checkable
class EncodingSink(Protocol):
    """A sink that takes spans encoded ahead (``encode``, on the event loop, a few dozen
    at a time) and exports the encoded fragments (``export_encoded``, in the thread)."""

    def encode(self, spans: Sequence[RecordingSpan]) -> bytes: ...

    def export_encoded(self, fragments: Sequence[bytes], count: int) -> bool: ...

    def shutdown(self) -> None: ...


class BatchSpanQueue:
    """Ended spans, exported by a daemon thread in batches of up to ``max_batch_size``
    every ``schedule_delay`` seconds (sooner when a batch is full). Beyond
    ``max_queue_size`` waiting spans, new ones are dropped (and counted).

    With an ``EncodingSink`` the event loop encodes every ``chunk_size`` ended spans itself
    and the thread only sends bytes: a thread running Python code takes the interpreter
    lock from the event loop, and each hand-over costs the loop more than the encoding.
    """

    def __init__(
        self,
        sink: SpanSink | EncodingSink,
        *,
        max_queue_size: int = 2048,
        max_batch_size: int = 512,
        schedule_delay: float = 5.0,
        chunk_size: int = 64,
    ) -> None:
        self.sink = sink
        self.dropped = 0
        #: Spans dropped because they could not be encoded (logged the first time).
        self.unencodable = 0
        self._max_queue = max_queue_size
        self._max_batch = min(max_batch_size, max_queue_size)
        self._chunk = max(1, min(chunk_size, self._max_batch))
        self._delay = schedule_delay
        self._encoding = sink if isinstance(sink, EncodingSink) else None
        self._plain = None if isinstance(sink, EncodingSink) else sink
        self._spans: deque[RecordingSpan] = deque()
        self._chunks: deque[tuple[int, bytes]] = deque()  # (spans, fragment)
        self._encoded = 0  # spans in _chunks
        self._lock = threading.Lock()  # who takes spans out of _spans, and _encoded
        self._wake = threading.Event()
        self._exporting = threading.Lock()
        self._stopped = False
        self._reported_drops = 0
        self._next_drop_report = 0.0
        self._thread = threading.Thread(target=self._run, name="epp-span-export", daemon=True)
        self._thread.start()

    def add(self, span: RecordingSpan) -> None:
        """Called on the event loop when ``span`` ends."""
        spans = self._spans
        waiting = len(spans) + self._encoded
        if waiting >= self._max_queue:
            self.dropped += 1
            return
        spans.append(span)
        if self._encoding is None:
            if waiting + 1 == self._max_batch:
                self._wake.set()
        elif len(spans) >= self._chunk:
            self._encode_chunk()

    def _encode_chunk(self) -> None:
        assert self._encoding is not None
        with self._lock:
            spans = self._spans
            chunk = [spans.popleft() for _ in range(min(self._chunk, len(spans)))]
        if not chunk:
            return
        try:
            fragment = self._encoding.encode(chunk)
        except Exception:  # e.g. a string protobuf refuses: never fail the request
            self.unencodable += len(chunk)
            if self.unencodable == len(chunk):
                logger.exception("spans that cannot be encoded were dropped")
            return
        with self._lock:
            self._chunks.append((len(chunk), fragment))
            self._encoded += len(chunk)
            full = self._encoded >= self._max_batch
        if full:
            self._wake.set()

    def force_flush(self, timeout: float = 10.0) -> bool:
        """Export everything queued now (in the calling thread); False if that did not
        finish within ``timeout``."""
        if not self._exporting.acquire(timeout=timeout):
            return False
        try:
            self._drain()
        finally:
            self._exporting.release()
        return not self._spans and not self._chunks

    def shutdown(self, timeout: float = 30.0) -> None:
        """Export what is queued within ``timeout`` seconds, then stop the sink (which
        abandons an export still running). Idempotent; blocks."""
        if self._stopped:
            return
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning(
                "spans not all exported within %.0fs of shutdown; %d left",
                timeout,
                len(self._spans) + self._encoded,
            )
        self.sink.shutdown()

    def _run(self) -> None:
        while not self._stopped:
            self._wake.wait(self._delay)
            self._wake.clear()
            with self._exporting:
                self._drain()
        with self._exporting:
            self._drain()

    def _drain(self) -> None:
        if self._plain is not None:
            self._drain_spans(self._plain)
        elif self._encoding is not None:
            self._drain_encoded(self._encoding)
        dropped = self.dropped
        if dropped != self._reported_drops:
            now = time.monotonic()
            if now >= self._next_drop_report:  # at most once a minute while it lasts
                logger.warning(
                    "span queue full (%d spans): %d spans dropped so far",
                    self._max_queue,
                    dropped,
                )
                self._reported_drops = dropped
                self._next_drop_report = now + DROP_REPORT_INTERVAL

    def _drain_spans(self, sink: SpanSink) -> None:
        queue = self._spans
        while queue:
            batch = [queue.popleft() for _ in range(min(self._max_batch, len(queue)))]
            try:
                sink.export(batch)
            except Exception:
                logger.exception("span export failed; %d spans dropped", len(batch))

    def _drain_encoded(self, sink: EncodingSink) -> None:
        # What the loop has not encoded yet (fewer than a chunk, unless traffic is quiet);
        # bounded, so spans that keep arriving are left to the loop.
        for _ in range(len(self._spans) // self._chunk + 1):
            self._encode_chunk()
        while True:
            fragments: list[bytes] = []
            count = 0
            with self._lock:
                while self._chunks and (not fragments or count < self._max_batch):
                    spans, fragment = self._chunks.popleft()
                    fragments.append(fragment)
                    count += spans
                self._encoded -= count
            if not fragments:
                return
            try:
                sink.export_encoded(fragments, count)
            except Exception:
                logger.exception("span export failed; %d spans dropped", count)


# sinks


class _OtlpSink:
    """What the OTLP sinks share: encoding, retries with backoff within the export
    timeout, and logging a failing collector when that changes. ``_send`` delivers one
    request and returns None, or why it failed and whether trying again may help."""

    def __init__(
        self, target: str, *, resource: Resource, scope: InstrumentationScope, timeout: float
    ) -> None:
        self.target = target
        self.encoder = OtlpEncoder(resource, scope)
        self._timeout = timeout
        self._closing = threading.Event()
        self._failing = False

    def encode(self, spans: Sequence[RecordingSpan]) -> bytes:
        return self.encoder.fragment(spans)

    def export_encoded(self, fragments: Sequence[bytes], count: int) -> bool:
        if self._closing.is_set():  # shut down: what is left is abandoned (and counted)
            return False
        request = self.encoder.request(fragments)
        deadline = time.monotonic() + self._timeout
        backoff = 0.5
        while True:
            failure = self._send(request, max(deadline - time.monotonic(), 0.001))
            if failure is None:
                if self._failing:
                    self._failing = False
                    logger.info("trace export to %s recovered", self.target)
                return True
            reason, retryable = failure
            if retryable and time.monotonic() + backoff < deadline and not self._closing.is_set():
                self._closing.wait(backoff)
                backoff *= 2
                continue
            if self._closing.is_set():  # abandoned at shutdown, which says so itself
                return False
            if not self._failing:
                self._failing = True
                logger.warning(
                    "trace export to %s failed (%s): %d spans dropped, and spans are "
                    "dropped until it recovers",
                    self.target,
                    reason,
                    count,
                )
            return False

    def _send(self, request: bytes, timeout: float) -> tuple[str, bool] | None:
        raise NotImplementedError

    def shutdown(self) -> None:
        self._closing.set()


class OtlpGrpcSink(_OtlpSink):
    """OTLP/gRPC to ``target`` (``host:port``): an ``EncodingSink``."""

    def __init__(
        self,
        target: str,
        *,
        resource: Resource,
        scope: InstrumentationScope,
        credentials: grpc.ChannelCredentials | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: float = 10.0,
        compression: grpc.Compression = grpc.Compression.NoCompression,
    ) -> None:
        super().__init__(target, resource=resource, scope=scope, timeout=timeout)
        # Reconnect soon after a collector comes back (gRPC's default backoff grows to 2 min).
        options = [
            ("grpc.initial_reconnect_backoff_ms", 500),
            ("grpc.max_reconnect_backoff_ms", 5000),
        ]
        if credentials is None:
            self._channel = grpc.insecure_channel(target, options, compression)
        else:
            self._channel = grpc.secure_channel(target, credentials, options, compression)
        # The request goes as the bytes ``OtlpEncoder`` made (no serializer).
        self._call: Callable[..., object] = self._channel.unary_unary(
            EXPORT_METHOD,
            request_serializer=None,
            response_deserializer=ExportTraceServiceResponse.FromString,
        )
        self._metadata = tuple((headers or {}).items())

    def _send(self, request: bytes, timeout: float) -> tuple[str, bool] | None:
        try:
            self._call(
                request,
                metadata=self._metadata,
                timeout=timeout,
                wait_for_ready=True,  # a collector starting up gets the timeout's grace
            )
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else grpc.StatusCode.UNKNOWN
            return code.name, code in _RETRYABLE
        except ValueError:  # the channel was closed meanwhile (shutdown)
            return "channel closed", False
        return None

    def shutdown(self) -> None:
        super().shutdown()
        self._channel.close()


class OtlpHttpSink(_OtlpSink):
    """OTLP/HTTP with binary protobuf: ``POST`` to ``url`` (``.../v1/traces``)."""

    def __init__(
        self,
        url: str,
        *,
        resource: Resource,
        scope: InstrumentationScope,
        ssl_context: ssl.SSLContext | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: float = 10.0,
        gzip_body: bool = False,
    ) -> None:
        super().__init__(url, resource=resource, scope=scope, timeout=timeout)
        self._ssl = ssl_context
        self._headers = {**(headers or {}), "content-type": "application/x-protobuf"}
        self._gzip = gzip_body
        if gzip_body:
            self._headers["content-encoding"] = "gzip"

    def _send(self, request: bytes, timeout: float) -> tuple[str, bool] | None:
        body = gzip.compress(request, compresslevel=5) if self._gzip else request
        sent = urllib.request.Request(self.target, data=body, headers=self._headers)
        try:
            with urllib.request.urlopen(sent, timeout=timeout, context=self._ssl) as response:
                response.read()
        except urllib.error.HTTPError as exc:
            return f"HTTP {exc.code}", exc.code in _RETRYABLE_HTTP
        except (urllib.error.URLError, OSError) as exc:  # refused, reset, timed out
            reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
            return str(reason), True
        return None


def _iso(ns: int) -> str:
    return datetime.fromtimestamp(ns / 1e9, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class ConsoleSink:
    """Each span as one JSON line (an INFO record of ``epp.traces``), so spans follow the
    process's log format."""

    def __init__(self, resource: Resource) -> None:
        self._resource = dict(resource.attributes)

    def export(self, spans: Sequence[RecordingSpan]) -> bool:
        for span in spans:
            described = self.describe(span)
            line = orjson.dumps(described, default=str).decode()
            # Text log lines show the span's JSON; JSON log lines carry it as an object.
            fields = {"msg": f"span {span.name}", "span": described}
            console_logger.info("%s", line, extra={"fields": fields})
        return True

    def describe(self, span: RecordingSpan) -> dict[str, object]:
        return {
            "name": span.name,
            "context": {
                "trace_id": f"0x{span.trace_id:032x}",
                "span_id": f"0x{span.span_id:016x}",
                "trace_state": span.trace_state,
            },
            "kind": "SpanKind.SERVER" if span.kind == KIND_SERVER else "SpanKind.INTERNAL",
            "parent_id": f"0x{span.parent_id:016x}" if span.parent_id else None,
            "start_time": _iso(span.start_ns),
            "end_time": _iso(span.end_ns),
            "status": (
                {"status_code": "ERROR", "description": span.error}
                if span.error is not None
                else {"status_code": "UNSET"}
            ),
            "attributes": span.attributes,
            "resource": {"attributes": self._resource},
        }

    def shutdown(self) -> None:
        return None


class SdkExporterSink:
    """Spans as SDK ``ReadableSpan`` to an OpenTelemetry SDK ``SpanExporter``."""

    def __init__(self, exporter: SpanExporter, resource: Resource, scope_name: str) -> None:
        self.exporter = exporter
        self._resource = resource
        self._scope = SdkScope(scope_name)

    def readable(self, span: RecordingSpan) -> ReadableSpan:
        state = TraceState.from_header([span.trace_state]) if span.trace_state else None
        flags = TraceFlags(TraceFlags.SAMPLED)
        parent = None
        if span.parent_id:
            parent = SpanContext(
                span.trace_id, span.parent_id, is_remote=span.remote_parent, trace_flags=flags
            )
        return ReadableSpan(
            name=span.name,
            context=SpanContext(
                span.trace_id, span.span_id, is_remote=False, trace_flags=flags, trace_state=state
            ),
            parent=parent,
            resource=self._resource,
            attributes=span.attributes,
            kind=SpanKind.SERVER if span.kind == KIND_SERVER else SpanKind.INTERNAL,
            status=Status(StatusCode.ERROR, span.error) if span.error is not None else Status(),
            start_time=span.start_ns,
            end_time=span.end_ns,
            instrumentation_scope=self._scope,
        )

    def export(self, spans: Sequence[RecordingSpan]) -> bool:
        result = self.exporter.export([self.readable(span) for span in spans])
        return result is SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self.exporter.shutdown()
