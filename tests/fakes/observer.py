"""An ``Observer`` that records every call, for tests of what the domain reports.

Not a mock: it implements the port, and a test reads what was reported afterwards
(``total``, ``observations``, ``gauge_value``, ``spans_named``), naming metrics by their
``ports.metric_catalogue`` entries. A report whose label names are not its entry's fails
the test at once (the Prometheus exporter would drop it). Spans get W3C-looking
ids: a child shares its parent's trace id, a span started from a carrier continues the
carrier's ``traceparent``, and ``inject`` writes this span's ``traceparent``.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field

from ports.metric_catalogue import CounterMetric, GaugeMetric, HistogramMetric, Metric

__all__ = ["RecordedSpan", "RecordingObserver", "Report"]

_ids = itertools.count(1)


@dataclass(frozen=True, slots=True)
class Report:
    """One ``counter``/``histogram``/``gauge`` call."""

    metric: Metric
    labels: Mapping[str, str]
    value: float

    @property
    def name(self) -> str:
        return self.metric.name


@dataclass(eq=False)
class RecordedSpan:
    name: str
    trace_id: str
    span_id: str
    parent: RecordedSpan | None = None
    remote_parent_id: str = ""
    attributes: dict[str, str | int | float | bool] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    end_calls: int = 0
    recording = True

    @property
    def ended(self) -> bool:
        return self.end_calls > 0

    def set_attribute(self, key: str, value: str | int | float | bool) -> None:
        self.attributes[key] = value

    def record_error(self, message: str) -> None:
        self.errors.append(message)

    def inject(self, carrier: MutableMapping[str, str]) -> None:
        carrier["traceparent"] = f"00-{self.trace_id}-{self.span_id}-01"

    def end(self) -> None:
        self.end_calls += 1

    def ancestors(self) -> list[RecordedSpan]:
        out = []
        span = self.parent
        while span is not None:
            out.append(span)
            span = span.parent
        return out


class RecordingObserver:
    def __init__(self) -> None:
        self.counters: list[Report] = []
        self.histograms: list[Report] = []
        self.gauges: list[Report] = []
        self.spans: list[RecordedSpan] = []

    # Observer

    def counter(self, metric: CounterMetric, labels: Mapping[str, str], value: float = 1.0) -> None:
        self.counters.append(_report(metric, labels, value))

    def histogram(self, metric: HistogramMetric, labels: Mapping[str, str], value: float) -> None:
        self.histograms.append(_report(metric, labels, value))

    def gauge(self, metric: GaugeMetric, labels: Mapping[str, str], value: float) -> None:
        self.gauges.append(_report(metric, labels, value))

    def start_span(
        self,
        name: str,
        *,
        parent: object | None = None,
        carrier: Mapping[str, str] | None = None,
        attributes: Mapping[str, str | int | float | bool] | None = None,
    ) -> RecordedSpan:
        span_id = f"{next(_ids):016x}"
        if isinstance(parent, RecordedSpan):
            span = RecordedSpan(name, parent.trace_id, span_id, parent=parent)
        else:
            trace_id, remote = f"{next(_ids):032x}", ""
            traceparent = (carrier or {}).get("traceparent", "")
            parts = traceparent.split("-")
            if len(parts) == 4:
                trace_id, remote = parts[1], parts[2]
            span = RecordedSpan(name, trace_id, span_id, remote_parent_id=remote)
        span.attributes.update(attributes or {})
        self.spans.append(span)
        return span

    # reading

    def reported_names(self) -> set[str]:
        return {r.name for r in (*self.counters, *self.histograms, *self.gauges)}

    def total(self, metric: CounterMetric, /, **labels: str) -> float:
        """Sum of the counter ``metric`` over the reports whose labels include ``labels``."""
        return sum(r.value for r in self.counters if r.metric is metric and _has(r, labels))

    def observations(self, metric: HistogramMetric, /, **labels: str) -> list[float]:
        return [r.value for r in self.histograms if r.metric is metric and _has(r, labels)]

    def gauge_value(self, metric: GaugeMetric, /, **labels: str) -> float | None:
        """The last value reported for the gauge series that includes ``labels``."""
        values = [r.value for r in self.gauges if r.metric is metric and _has(r, labels)]
        return values[-1] if values else None

    def spans_named(self, name: str) -> list[RecordedSpan]:
        return [s for s in self.spans if s.name == name]


def _report(metric: Metric, labels: Mapping[str, str], value: float) -> Report:
    if sorted(labels) != sorted(metric.reported_labels):
        raise AssertionError(
            f"{metric.name} reported with labels {sorted(labels)}, "
            f"declared {sorted(metric.reported_labels)}"
        )
    return Report(metric, dict(labels), value)


def _has(report: Report, labels: Mapping[str, str]) -> bool:
    return all(report.labels.get(k) == v for k, v in labels.items())
