"""Observability: how the domain and adapters report metrics and spans.

The domain never imports prometheus-client or OpenTelemetry: it reports through an
``Observer``, naming each metric by its entry in ``ports.metric_catalogue`` (the one place
metric names, kinds, labels and buckets are declared), so a misspelt name or a gauge
reported as a counter does not type-check. A report carries exactly the entry's label names;
label values are plain strings and must have bounded cardinality (never a request id or
prompt). Implementations must be cheap when nothing consumes the data and must never raise
into the caller: a report they cannot take (labels other than the entry's, an entry they do
not export, an invalid value) is dropped, and may be logged.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from contextvars import ContextVar
from typing import Protocol

from ports.metric_catalogue import CounterMetric, GaugeMetric, HistogramMetric

__all__ = ["REQUEST_ID", "NoopObserver", "NoopSpan", "Observer", "Span"]

#: The id (``x-request-id``) of the request the current task serves; "" outside requests.
#: The gateway adapter sets it per stream; the log formatter adds it to every record.
REQUEST_ID: ContextVar[str] = ContextVar("request_id", default="")


class Span(Protocol):
    """One timed operation of a trace. ``end`` is idempotent.

    ``recording`` is False when nothing this span or its children record is kept (tracing
    off, or the request not sampled): callers may then skip work done only for spans.
    """

    @property
    def recording(self) -> bool: ...

    def set_attribute(self, key: str, value: str | int | float | bool) -> None: ...

    def record_error(self, message: str) -> None: ...

    def inject(self, carrier: MutableMapping[str, str]) -> None:
        """Write this span's trace context (``traceparent``, ...) into ``carrier``."""
        ...

    def end(self) -> None: ...


class Observer(Protocol):
    """Receives counters, histograms, gauges and spans. Called from the event loop."""

    def counter(
        self, metric: CounterMetric, labels: Mapping[str, str], value: float = 1.0
    ) -> None: ...

    def histogram(
        self, metric: HistogramMetric, labels: Mapping[str, str], value: float
    ) -> None: ...

    def gauge(self, metric: GaugeMetric, labels: Mapping[str, str], value: float) -> None: ...

    def start_span(
        self,
        name: str,
        *,
        parent: Span | None = None,
        carrier: Mapping[str, str] | None = None,
        attributes: Mapping[str, str | int | float | bool] | None = None,
    ) -> Span:
        """A new span: child of ``parent``, else of the context in ``carrier`` (request
        headers with ``traceparent``), else a new trace."""
        ...


class NoopSpan:
    recording = False

    def set_attribute(self, key: str, value: str | int | float | bool) -> None:
        return None

    def record_error(self, message: str) -> None:
        return None

    def inject(self, carrier: MutableMapping[str, str]) -> None:
        return None

    def end(self) -> None:
        return None


_NOOP_SPAN = NoopSpan()


class NoopObserver:
    """Drops everything: the default when observability is off."""

    def counter(self, metric: CounterMetric, labels: Mapping[str, str], value: float = 1.0) -> None:
        return None

    def histogram(self, metric: HistogramMetric, labels: Mapping[str, str], value: float) -> None:
        return None

    def gauge(self, metric: GaugeMetric, labels: Mapping[str, str], value: float) -> None:
        return None

    def start_span(
        self,
        name: str,
        *,
        parent: Span | None = None,
        carrier: Mapping[str, str] | None = None,
        attributes: Mapping[str, str | int | float | bool] | None = None,
    ) -> Span:
        return _NOOP_SPAN
