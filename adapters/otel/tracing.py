"""OpenTelemetry tracing configured from the standard ``OTEL_*`` variables, as the reference.

- service name: ``OTEL_SERVICE_NAME``, else ``gateway-api-inference-extension/epp``;
- exporter ``OTEL_TRACES_EXPORTER``: ``console`` (the default: finished spans as one-line
  JSON log records, so they follow the process's log format), ``otlp`` (OTLP over gRPC to
  ``OTEL_EXPORTER_OTLP_ENDPOINT``, default ``http://localhost:4317``, plaintext for
  ``http://``), ``none``;
- sampler ``OTEL_TRACES_SAMPLER`` (default ``parentbased_traceidratio``) with
  ``OTEL_TRACES_SAMPLER_ARG`` (default 0.1);
- W3C ``traceparent``/``tracestate`` and ``baggage`` propagation; spans are batched
  (``BatchSpanProcessor``, tuned by the ``OTEL_BSP_*`` variables).

Nothing here touches the OpenTelemetry globals: several ``OtelTracing`` may coexist.
A span that is not sampled is not recorded, and its children are the span itself, so an
unsampled request costs one sampling decision and a few calls.
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.context import Context
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    ALWAYS_ON,
    ParentBased,
    Sampler,
    TraceIdRatioBased,
)
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from ports.observer import Span

__all__ = [
    "DEFAULT_OTLP_ENDPOINT",
    "DEFAULT_SAMPLER_ARG",
    "DEFAULT_SERVICE_NAME",
    "LoggingSpanExporter",
    "OtelSpan",
    "OtelTracing",
    "sampler_from",
]

logger = logging.getLogger(__name__)
console_logger = logging.getLogger("epp.traces")

DEFAULT_SERVICE_NAME = "gateway-api-inference-extension/epp"
DEFAULT_OTLP_ENDPOINT = "http://localhost:4317"
DEFAULT_SAMPLER = "parentbased_traceidratio"
DEFAULT_SAMPLER_ARG = 0.1
INSTRUMENTATION_NAME = "gateway-api-inference-extension/epp"


class LoggingSpanExporter(SpanExporter):
    """The ``console`` exporter: each finished span as one INFO record of ``epp.traces``."""

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        for span in spans:
            console_logger.info("%s", span.to_json(indent=None))
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None


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


def sampler_from(environ: Mapping[str, str]) -> Sampler:
    """The sampler ``OTEL_TRACES_SAMPLER``/``OTEL_TRACES_SAMPLER_ARG`` name (or the default)."""
    name = (environ.get("OTEL_TRACES_SAMPLER") or DEFAULT_SAMPLER).strip().lower()
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
    if name != DEFAULT_SAMPLER:
        logger.warning("unknown OTEL_TRACES_SAMPLER %r; using %s", name, DEFAULT_SAMPLER)
    return ParentBased(TraceIdRatioBased(_ratio(arg)))


def _exporter_from(environ: Mapping[str, str]) -> SpanExporter | None:
    kind = (environ.get("OTEL_TRACES_EXPORTER") or "console").strip().lower()
    if kind == "none":
        return None
    if kind == "otlp":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        endpoint = environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or DEFAULT_OTLP_ENDPOINT
        return OTLPSpanExporter(endpoint=endpoint, insecure=endpoint.startswith("http://"))
    if kind != "console":
        logger.warning("unknown OTEL_TRACES_EXPORTER %r; spans are not exported", kind)
        return None
    return LoggingSpanExporter()


class OtelSpan:
    """A port ``Span`` backed by an SDK span; ``context`` is what its children descend from."""

    __slots__ = ("_base", "_context", "_propagator", "recording", "span")

    def __init__(
        self, span: trace.Span, base: Context | None, propagator: CompositePropagator
    ) -> None:
        self.span = span
        self.recording = span.is_recording()
        self._base = base
        self._context: Context | None = None
        self._propagator = propagator

    @property
    def context(self) -> Context:
        context = self._context
        if context is None:
            context = self._context = trace.set_span_in_context(self.span, self._base)
        return context

    def set_attribute(self, key: str, value: str | int | float | bool) -> None:
        if self.recording:
            self.span.set_attribute(key, value)

    def record_error(self, message: str) -> None:
        if self.recording:
            self.span.set_status(Status(StatusCode.ERROR, message))

    def inject(self, carrier: MutableMapping[str, str]) -> None:
        self._propagator.inject(carrier, context=self.context)

    def end(self) -> None:
        self.span.end()  # idempotent in the SDK (a second call is ignored)


class UnsampledSpan:
    """A span the sampler dropped, without the SDK: it records nothing and only carries the
    trace context on (``inject``), so the model server still joins the caller's trace.

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


_TRACE_HEADERS = ("traceparent", "tracestate", "baggage")
_OTHER_SAMPLERS = frozenset(
    {
        "always_on",
        "always_off",
        "traceidratio",
        "parentbased_always_on",
        "parentbased_always_off",
    }
)


class OtelTracing:
    """The tracing half of an ``Observer``: ``start_span`` and ``shutdown``.

    ``environ`` defaults to the process environment; ``exporter`` replaces the one the
    environment names (tests). Spans started without a parent (a new trace, or the
    continuation of a ``carrier``'s) are SERVER spans, the others INTERNAL.
    """

    def __init__(
        self,
        environ: Mapping[str, str] | None = None,
        *,
        exporter: SpanExporter | None = None,
    ) -> None:
        env = os.environ if environ is None else environ
        service = env.get("OTEL_SERVICE_NAME") or DEFAULT_SERVICE_NAME
        self.sampler = sampler_from(env)
        # The default ``parentbased_traceidratio``: the ratio decision for new traces, and
        # "follow the caller" for continued ones, are made here before the SDK is involved,
        # so an unsampled request costs no SDK span; the SDK then records every span it
        # is asked for (its sampler follows the parent, which is always sampled).
        self._root_ratio: float | None = None
        sdk_sampler: Sampler = self.sampler
        sampler_name = (env.get("OTEL_TRACES_SAMPLER") or DEFAULT_SAMPLER).strip().lower()
        if sampler_name not in _OTHER_SAMPLERS:  # the default (also for unknown names)
            self._root_ratio = _ratio(env.get("OTEL_TRACES_SAMPLER_ARG"))
            sdk_sampler = ParentBased(ALWAYS_ON)
        self._random = random.Random()
        self.exporter = exporter if exporter is not None else _exporter_from(env)
        self.provider = TracerProvider(
            sampler=sdk_sampler,
            resource=Resource.create({SERVICE_NAME: service}),
            shutdown_on_exit=False,
        )
        if self.exporter is not None:
            self.provider.add_span_processor(BatchSpanProcessor(self.exporter))
        self._tracer = self.provider.get_tracer(INSTRUMENTATION_NAME)
        self.propagator = CompositePropagator(
            [TraceContextTextMapPropagator(), W3CBaggagePropagator()]
        )
        self._shut_down = False

    def start_span(
        self,
        name: str,
        *,
        parent: Span | None = None,
        carrier: Mapping[str, str] | None = None,
        attributes: Mapping[str, str | int | float | bool] | None = None,
    ) -> Span:
        if isinstance(parent, UnsampledSpan):
            return parent
        if isinstance(parent, OtelSpan):
            if not parent.recording:
                return parent  # unsampled: nothing below it is recorded either
            base = parent.context
            kind = SpanKind.INTERNAL
        elif self._root_ratio is not None and (unsampled := self._presample(carrier)):
            return unsampled
        elif carrier is not None:
            base = self.propagator.extract(carrier)
            kind = SpanKind.SERVER
        else:
            base = None
            kind = SpanKind.SERVER
        span = self._tracer.start_span(name, context=base, kind=kind, attributes=attributes)
        return OtelSpan(span, base, self.propagator)

    def _presample(self, carrier: Mapping[str, str] | None) -> UnsampledSpan | None:
        """An ``UnsampledSpan`` when the request is not to be traced, else None."""
        assert self._root_ratio is not None
        traceparent = carrier.get("traceparent") if carrier is not None else None
        if traceparent:
            # Follow the caller: its flags end the header ("00-<trace>-<span>-<flags>").
            flags = traceparent.strip()[-2:]
            try:
                sampled = bool(int(flags, 16) & 1)
            except ValueError:
                return None  # a malformed header: the SDK decides what it means
            if sampled:
                return None
            assert carrier is not None
            return UnsampledSpan({k: carrier[k] for k in _TRACE_HEADERS if k in carrier})
        if self._random.random() < self._root_ratio:
            return None
        trace_id = self._random.getrandbits(128) or 1
        span_id = self._random.getrandbits(64) or 1
        return UnsampledSpan({"traceparent": f"00-{trace_id:032x}-{span_id:016x}-00"})

    def force_flush(self, timeout_seconds: float = 10.0) -> bool:
        """Export every finished span now; False when that did not finish in time."""
        return bool(self.provider.force_flush(int(timeout_seconds * 1000)))

    def shutdown(self) -> None:
        """Flush what is pending and stop exporting (idempotent). Blocks: run it off-loop."""
        if self._shut_down:
            return
        self._shut_down = True
        self.provider.shutdown()

    def describe(self) -> dict[str, Any]:
        """What was configured, for the start-up log line."""
        return {
            "sampler": self.sampler.get_description(),
            "exporter": type(self.exporter).__name__ if self.exporter else "none",
        }
