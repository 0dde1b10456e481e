"""OpenTelemetry tracing configured from the standard ``OTEL_*`` variables, as the reference.

- service name: ``OTEL_SERVICE_NAME``, else ``gateway-api-inference-extension/epp``
  (other resource attributes from ``OTEL_RESOURCE_ATTRIBUTES``, by the SDK's ``Resource``);
- exporter ``OTEL_TRACES_EXPORTER``: unset, ``otlp`` when an OTLP endpoint variable
  (``OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT``) is set and ``none`` otherwise, so a pod never
  writes spans to its log unless asked; ``console`` (finished spans as one-line JSON log
  records, following the process's log format), ``otlp`` (OTLP over gRPC to
  ``OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT``, default ``http://localhost:4317``; plaintext
  for ``http://``, TLS for ``https://``, and for a bare ``host:port`` unless
  ``OTEL_EXPORTER_OTLP_[TRACES_]INSECURE=true``; with the ``..._HEADERS``, ``..._TIMEOUT``
  (ms), ``..._COMPRESSION`` and ``..._CERTIFICATE``/``..._CLIENT_KEY``/
  ``..._CLIENT_CERTIFICATE`` variables; ``OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL=http/protobuf``
  posts to ``<OTEL_EXPORTER_OTLP_ENDPOINT>/v1/traces``, default base
  ``http://localhost:4318``, or to ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` as given), ``none``;
- sampler ``OTEL_TRACES_SAMPLER`` (default ``parentbased_traceidratio``; also
  ``always_on``, ``always_off``, ``traceidratio``, ``parentbased_always_on``,
  ``parentbased_always_off``) with ``OTEL_TRACES_SAMPLER_ARG`` (default 0.1), decided as the
  SDK's samplers decide (the ratio on the trace id's low 64 bits);
- W3C ``traceparent``/``tracestate`` and ``baggage`` propagation; spans are batched and
  exported by a thread, tuned by ``OTEL_BSP_MAX_QUEUE_SIZE``,
  ``OTEL_BSP_MAX_EXPORT_BATCH_SIZE`` and ``OTEL_BSP_SCHEDULE_DELAY``.

The sampling decision is made once, for the request's first span: an unsampled request
costs that decision and an ``UnsampledSpan`` that passes the trace context on; a sampled
one records light ``RecordingSpan`` objects that the event loop encodes in batches and a
thread sends (see ``adapters.otel.spans`` and ``adapters.otel.export``). Nothing here
touches the OpenTelemetry globals: several ``OtelTracing`` may coexist.
"""

from __future__ import annotations

import logging
import os
import ssl
import urllib.parse
from collections.abc import Callable, Mapping
from typing import Any

import grpc
from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace.export import SpanExporter
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    ALWAYS_ON,
    ParentBased,
    Sampler,
    TraceIdRatioBased,
)

from adapters.otel.export import (
    BatchSpanQueue,
    ConsoleSink,
    EncodingSink,
    OtlpGrpcSink,
    OtlpHttpSink,
    SdkExporterSink,
    SpanSink,
)
from adapters.otel.spans import (
    KIND_INTERNAL,
    KIND_SERVER,
    TRACE_HEADERS,
    RecordingSpan,
    UnsampledSpan,
    new_span_id,
    new_trace_id,
    parse_traceparent,
)
from ports.observer import Span

__all__ = [
    "DEFAULT_OTLP_ENDPOINT",
    "DEFAULT_SAMPLER_ARG",
    "DEFAULT_SERVICE_NAME",
    "OtelTracing",
    "TracingConfigError",
    "sampler_from",
]

logger = logging.getLogger(__name__)

DEFAULT_SERVICE_NAME = "gateway-api-inference-extension/epp"
DEFAULT_OTLP_ENDPOINT = "http://localhost:4317"
DEFAULT_OTLP_HTTP_ENDPOINT = "http://localhost:4318"
DEFAULT_SAMPLER = "parentbased_traceidratio"
DEFAULT_SAMPLER_ARG = 0.1
INSTRUMENTATION_NAME = "gateway-api-inference-extension/epp"

_SAMPLERS = frozenset(
    {
        "always_on",
        "always_off",
        "traceidratio",
        "parentbased_always_on",
        "parentbased_always_off",
        DEFAULT_SAMPLER,
    }
)
_LOW_64 = (1 << 64) - 1


class TracingConfigError(ValueError):
    """An ``OTEL_*`` setting that cannot work (the message names the variable)."""


def _ratio(text: str | None) -> float:
    if text is None or not text.strip():
        return DEFAULT_SAMPLER_ARG
    try:
        ratio = float(text)
    except ValueError:
        logger.warning(
            "OTEL_TRACES_SAMPLER_ARG=%r is not a number; using %s", text, DEFAULT_SAMPLER_ARG
        )
        return DEFAULT_SAMPLER_ARG
    if not 0.0 <= ratio <= 1.0:
        logger.warning(
            "OTEL_TRACES_SAMPLER_ARG=%r is not in [0, 1]; using %s", text, DEFAULT_SAMPLER_ARG
        )
        return DEFAULT_SAMPLER_ARG
    return ratio


def _sampler_name(environ: Mapping[str, str]) -> str:
    name = (environ.get("OTEL_TRACES_SAMPLER") or DEFAULT_SAMPLER).strip().lower()
    if name not in _SAMPLERS:
        logger.warning("unknown OTEL_TRACES_SAMPLER %r; using %s", name, DEFAULT_SAMPLER)
        return DEFAULT_SAMPLER
    return name


def sampler_from(environ: Mapping[str, str]) -> Sampler:
    """The SDK sampler ``OTEL_TRACES_SAMPLER``/``OTEL_TRACES_SAMPLER_ARG`` name (or the
    default): what ``OtelTracing`` decides like, and describes itself with."""
    name = _sampler_name(environ)
    arg = environ.get("OTEL_TRACES_SAMPLER_ARG")
    if name == "always_on":
        return ALWAYS_ON
    if name == "always_off":
        return ALWAYS_OFF
    if name == "traceidratio":
        return TraceIdRatioBased(_ratio(arg))
    if name == "parentbased_always_on":
        return ParentBased(ALWAYS_ON)
    if name == "parentbased_always_off":
        return ParentBased(ALWAYS_OFF)
    return ParentBased(TraceIdRatioBased(_ratio(arg)))


def _env(environ: Mapping[str, str], name: str) -> str | None:
    """``OTEL_EXPORTER_OTLP_TRACES_<name>``, else ``OTEL_EXPORTER_OTLP_<name>``."""
    value = environ.get(f"OTEL_EXPORTER_OTLP_TRACES_{name}") or environ.get(
        f"OTEL_EXPORTER_OTLP_{name}"
    )
    return value.strip() if value and value.strip() else None


def _read(environ: Mapping[str, str], name: str) -> bytes | None:
    path = _env(environ, name)
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise TracingConfigError(f"OTEL_EXPORTER_OTLP_{name}={path!r}: {exc.strerror}") from exc


def _headers(text: str | None) -> dict[str, str]:
    headers: dict[str, str] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            logger.warning("OTEL_EXPORTER_OTLP_HEADERS: ignored %r (not key=value)", item)
            continue
        headers[urllib.parse.unquote(key.strip()).lower()] = urllib.parse.unquote(value.strip())
    return headers


def _timeout(environ: Mapping[str, str]) -> float:
    text = _env(environ, "TIMEOUT")
    if text is not None:
        try:
            return float(text) / 1000
        except ValueError:
            logger.warning("OTEL_EXPORTER_OTLP_TIMEOUT=%r is not milliseconds; 10s", text)
    return 10.0


def _gzip(environ: Mapping[str, str]) -> bool:
    return (_env(environ, "COMPRESSION") or "none").lower() == "gzip"


def _otlp_sink(environ: Mapping[str, str], resource: Resource) -> OtlpGrpcSink | OtlpHttpSink:
    protocol = (_env(environ, "PROTOCOL") or "grpc").lower()
    if protocol == "http/protobuf":
        return _otlp_http_sink(environ, resource)
    if protocol != "grpc":
        logger.warning(
            "OTEL_EXPORTER_OTLP_PROTOCOL=%r is not supported (grpc, http/protobuf); using grpc",
            protocol,
        )
    endpoint = _env(environ, "ENDPOINT") or DEFAULT_OTLP_ENDPOINT
    if "://" in endpoint:
        parsed = urllib.parse.urlsplit(endpoint)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise TracingConfigError(
                f"OTEL_EXPORTER_OTLP_ENDPOINT={endpoint!r}: expected http(s)://host:port"
            )
        host = f"[{parsed.hostname}]" if ":" in parsed.hostname else parsed.hostname
        target = f"{host}:{parsed.port or 4317}"
        insecure = parsed.scheme == "http"
    else:
        target = endpoint
        insecure = (_env(environ, "INSECURE") or "").lower() == "true"
    credentials = None
    if not insecure:
        credentials = grpc.ssl_channel_credentials(
            root_certificates=_read(environ, "CERTIFICATE"),
            private_key=_read(environ, "CLIENT_KEY"),
            certificate_chain=_read(environ, "CLIENT_CERTIFICATE"),
        )
    return OtlpGrpcSink(
        target,
        resource=resource,
        scope=InstrumentationScope(name=INSTRUMENTATION_NAME),
        credentials=credentials,
        headers=_headers(_env(environ, "HEADERS")),
        timeout=_timeout(environ),
        compression=grpc.Compression.Gzip if _gzip(environ) else grpc.Compression.NoCompression,
    )


def _otlp_http_sink(environ: Mapping[str, str], resource: Resource) -> OtlpHttpSink:
    """``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` is the URL itself; ``OTEL_EXPORTER_OTLP_ENDPOINT``
    (default ``http://localhost:4318``) is the base the ``/v1/traces`` path goes under."""
    url = (environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or "").strip()
    if not url:
        base = (environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or "").strip()
        url = (base or DEFAULT_OTLP_HTTP_ENDPOINT).rstrip("/") + "/v1/traces"
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise TracingConfigError(
            f"OTEL_EXPORTER_OTLP_ENDPOINT: {url!r} is not an http(s) URL for OTLP/HTTP"
        )
    context = None
    if parsed.scheme == "https":
        ca = _env(environ, "CERTIFICATE")
        client_certificate = _env(environ, "CLIENT_CERTIFICATE")
        try:
            context = ssl.create_default_context(cafile=ca)
            if client_certificate is not None:
                context.load_cert_chain(client_certificate, _env(environ, "CLIENT_KEY"))
        except (OSError, ssl.SSLError) as exc:
            raise TracingConfigError(
                f"OTEL_EXPORTER_OTLP_CERTIFICATE/CLIENT_CERTIFICATE/CLIENT_KEY: {exc}"
            ) from exc
    return OtlpHttpSink(
        url,
        resource=resource,
        scope=InstrumentationScope(name=INSTRUMENTATION_NAME),
        ssl_context=context,
        headers=_headers(_env(environ, "HEADERS")),
        timeout=_timeout(environ),
        gzip_body=_gzip(environ),
    )


def _sink_from(environ: Mapping[str, str], resource: Resource) -> SpanSink | EncodingSink | None:
    kind = (environ.get("OTEL_TRACES_EXPORTER") or "").strip().lower()
    if not kind:
        endpoint = _env(environ, "ENDPOINT")
        kind = "otlp" if endpoint else "none"
    if kind == "none":
        return None
    if kind == "otlp":
        return _otlp_sink(environ, resource)
    if kind != "console":
        logger.warning("unknown OTEL_TRACES_EXPORTER %r; spans are not exported", kind)
        return None
    return ConsoleSink(resource)


def _bsp(environ: Mapping[str, str], name: str, default: int) -> int:
    text = environ.get(f"OTEL_BSP_{name}")
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        logger.warning("OTEL_BSP_%s=%r is not a positive integer; using %d", name, text, default)
        return default
    return value


class OtelTracing:
    """The tracing half of an ``Observer``: ``start_span``, ``force_flush`` and ``shutdown``.

    ``environ`` defaults to the process environment; ``exporter`` (an SDK ``SpanExporter``)
    or ``sink`` replaces the exporter the environment names. Spans started without a
    parent (a new trace, or the continuation of a ``carrier``'s) are SERVER spans, the
    others INTERNAL.
    """

    def __init__(
        self,
        environ: Mapping[str, str] | None = None,
        *,
        exporter: SpanExporter | None = None,
        sink: SpanSink | EncodingSink | None = None,
    ) -> None:
        env = os.environ if environ is None else environ
        service = env.get("OTEL_SERVICE_NAME") or DEFAULT_SERVICE_NAME
        self.resource = Resource.create({SERVICE_NAME: service})
        self.sampler = sampler_from(env)
        name = _sampler_name(env)
        self._parent_based = name.startswith("parentbased_")
        root = name.removeprefix("parentbased_")
        ratio = 1.0 if root == "always_on" else 0.0 if root == "always_off" else None
        if ratio is None:
            ratio = _ratio(env.get("OTEL_TRACES_SAMPLER_ARG"))
        self._bound = round(ratio * (1 << 64))
        self.sink: SpanSink | EncodingSink | None
        if sink is not None:
            self.sink = sink
        elif exporter is not None:
            self.sink = SdkExporterSink(exporter, self.resource, INSTRUMENTATION_NAME)
        else:
            self.sink = _sink_from(env, self.resource)
        self._queue: BatchSpanQueue | None = None
        self._add: Callable[[RecordingSpan], None] = _discard
        if self.sink is not None:
            self._queue = BatchSpanQueue(
                self.sink,
                max_queue_size=_bsp(env, "MAX_QUEUE_SIZE", 2048),
                max_batch_size=_bsp(env, "MAX_EXPORT_BATCH_SIZE", 512),
                schedule_delay=_bsp(env, "SCHEDULE_DELAY", 5000) / 1000,
            )
            self._add = self._queue.add

    def start_span(
        self,
        name: str,
        *,
        parent: Span | None = None,
        carrier: Mapping[str, str] | None = None,
        attributes: Mapping[str, str | int | float | bool] | None = None,
    ) -> Span:
        if parent is not None:
            if type(parent) is RecordingSpan:
                return RecordingSpan(
                    name,
                    parent.trace_id,
                    parent.span_id,
                    kind=KIND_INTERNAL,
                    sink=self._add,
                    onward=parent.onward,
                    attributes=attributes,
                )
            if type(parent) is UnsampledSpan:
                return parent  # nothing below an unsampled span is recorded either
        traceparent = carrier.get("traceparent") if carrier is not None else None
        caller = parse_traceparent(traceparent) if traceparent else None
        if caller is None:
            trace_id = new_trace_id()
            sampled = (trace_id & _LOW_64) < self._bound
        elif self._parent_based:
            trace_id = caller.trace_id
            sampled = caller.sampled
        else:
            trace_id = caller.trace_id
            sampled = (trace_id & _LOW_64) < self._bound
        onward: dict[str, str] = {}
        if carrier is not None:
            if caller is not None and "tracestate" in carrier:
                onward["tracestate"] = carrier["tracestate"]
            if "baggage" in carrier:
                onward["baggage"] = carrier["baggage"]
        if not sampled:
            if caller is not None and not caller.sampled:
                assert carrier is not None
                return UnsampledSpan({k: carrier[k] for k in TRACE_HEADERS if k in carrier})
            onward["traceparent"] = f"00-{trace_id:032x}-{new_span_id():016x}-00"
            return UnsampledSpan(onward)
        return RecordingSpan(
            name,
            trace_id,
            caller.span_id if caller is not None else 0,
            kind=KIND_SERVER,
            sink=self._add,
            onward=onward,
            remote_parent=caller is not None,
            attributes=attributes,
        )

    def force_flush(self, timeout_seconds: float = 10.0) -> bool:
        """Export every finished span now; False when that did not finish in time."""
        return self._queue.force_flush(timeout_seconds) if self._queue is not None else True

    def shutdown(self, timeout_seconds: float = 30.0) -> None:
        """Flush what is pending within ``timeout_seconds`` and stop exporting (idempotent).
        Blocks: run it off the event loop."""
        if self._queue is not None:
            self._queue.shutdown(timeout_seconds)

    def describe(self) -> dict[str, Any]:
        """What was configured, for the start-up log line."""
        sink = self.sink
        if isinstance(sink, OtlpGrpcSink):
            exporter = f"otlp grpc to {sink.target}"
        elif isinstance(sink, OtlpHttpSink):
            exporter = f"otlp http/protobuf to {sink.target}"
        elif isinstance(sink, ConsoleSink):
            exporter = "console"
        elif isinstance(sink, SdkExporterSink):
            exporter = type(sink.exporter).__name__
        else:
            exporter = "none"
        return {"sampler": self.sampler.get_description(), "exporter": exporter}


def _discard(span: RecordingSpan) -> None:
    return None
