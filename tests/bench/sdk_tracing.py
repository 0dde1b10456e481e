"""The tracing half of the EPP's ``Observer`` done the OpenTelemetry SDK's own way, for
``tests.bench.observability_overhead`` to compare with ``adapters.otel`` (not product code).

Every span is an SDK span from a ``TracerProvider`` (the same sampler as ``OtelTracing``
builds from ``OTEL_TRACES_SAMPLER``/``OTEL_TRACES_SAMPLER_ARG``, the same resource and
instrumentation scope), finished spans go through the SDK's ``BatchSpanProcessor`` (tuned by
the same ``OTEL_BSP_*`` variables) to an SDK ``SpanExporter``: by default the SDK's OTLP/gRPC
``OTLPSpanExporter``, which reads ``OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT`` and the other
exporter variables itself. Trace context comes in and goes out through the SDK's W3C
trace-context and baggage propagators.

The span names, kinds, parents, attributes and error statuses are the EPP's own (the EPP's
code starts them through the ``Observer`` port); only how a span is recorded and exported
differs. As ``OtelTracing`` does, a child of a span that records nothing is that span
itself, so an unsampled request makes one non-recording SDK span (the SDK's sampler
decides, no short-cut before it).

The OTLP exporter is in ``opentelemetry-exporter-otlp-proto-grpc`` (the ``bench`` extra);
``INSTALL_HINT`` says how to install it.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
from collections.abc import Mapping, MutableMapping
from typing import Any

from opentelemetry import trace
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.context import Context
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from adapters.otel.tracing import DEFAULT_SERVICE_NAME, INSTRUMENTATION_NAME, sampler_from
from ports.observer import Span

__all__ = ["INSTALL_HINT", "SdkSpan", "SdkTracing", "otlp_exporter_available"]

logger = logging.getLogger(__name__)


def _install_hint() -> str:
    try:
        version = importlib.metadata.version("opentelemetry-sdk")
    except importlib.metadata.PackageNotFoundError:
        version = "<the opentelemetry-sdk version>"
    return (
        "the OpenTelemetry SDK's OTLP exporter (the 'bench' extra) is not installed; the "
        f"release of the installed SDK: .venv/bin/pip install "
        f"'opentelemetry-exporter-otlp-proto-grpc=={version}'"
    )


INSTALL_HINT = _install_hint()


def otlp_exporter_available() -> bool:
    """Whether the SDK's OTLP/gRPC span exporter can be imported."""
    try:
        import opentelemetry.exporter.otlp.proto.grpc.trace_exporter  # noqa: F401
    except ImportError:
        return False
    return True


def _otlp_exporter(environ: Mapping[str, str]) -> SpanExporter:
    """The SDK's OTLP/gRPC exporter; it reads the ``OTEL_EXPORTER_OTLP_*`` variables of the
    process itself (TLS, headers, timeout, ...), the endpoint from ``environ`` too."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    exporter: SpanExporter = OTLPSpanExporter(endpoint=endpoint or None)
    return exporter


class SdkSpan:
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
        self.span.set_attribute(key, value)

    def record_error(self, message: str) -> None:
        self.span.set_status(Status(StatusCode.ERROR, message))

    def inject(self, carrier: MutableMapping[str, str]) -> None:
        self._propagator.inject(carrier, context=self.context)

    def end(self) -> None:
        self.span.end()  # idempotent in the SDK (a second call is ignored with a warning)


class SdkTracing:
    """What ``OtelTracing`` offers the process (``start_span``, ``force_flush``,
    ``shutdown``, ``describe``), on the SDK's spans, batch processor and exporter.

    ``exporter`` replaces the SDK's OTLP/gRPC exporter (tests, the in-process benchmark).
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
        self.exporter = exporter if exporter is not None else _otlp_exporter(env)
        self.provider = TracerProvider(
            sampler=self.sampler,
            resource=Resource.create({SERVICE_NAME: service}),
            shutdown_on_exit=False,
        )
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
        if type(parent) is SdkSpan:
            if not parent.recording:
                return parent  # nothing below an unsampled span is recorded either
            base: Context | None = parent.context
            kind = SpanKind.INTERNAL
        else:
            base = self.propagator.extract(carrier) if carrier is not None else None
            kind = SpanKind.SERVER
        span = self._tracer.start_span(name, context=base, kind=kind, attributes=attributes)
        return SdkSpan(span, base, self.propagator)

    def force_flush(self, timeout_seconds: float = 10.0) -> bool:
        """Export every finished span now; False when that did not finish in time."""
        return bool(self.provider.force_flush(int(timeout_seconds * 1000)))

    def shutdown(self, timeout_seconds: float = 30.0) -> None:
        """Flush what is pending and stop exporting (idempotent). Blocks: run it off-loop.
        (The SDK's shutdown takes no deadline; the caller bounds its wait.)"""
        if self._shut_down:
            return
        self._shut_down = True
        self.provider.shutdown()

    def describe(self) -> dict[str, Any]:
        """What was configured, for the start-up log line."""
        return {
            "sampler": self.sampler.get_description(),
            "exporter": f"OpenTelemetry SDK {type(self.exporter).__name__}",
        }
