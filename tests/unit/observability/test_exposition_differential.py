"""The exporter writes its exposition text itself: it must be byte for byte what
``prometheus_client.generate_latest`` gives for the same values, whatever they are."""

from __future__ import annotations

import math

import prometheus_client
from hypothesis import given, settings
from hypothesis import strategies as st

from adapters.prometheus.exporter import PrometheusObserver
from ports.metric_catalogue import CATALOGUE, CounterMetric, GaugeMetric, HistogramMetric

#: label values with the characters the text format escapes, and other text
_LABEL_VALUES = st.text(
    alphabet=st.sampled_from(["a", "Z", "0", "-", '"', "\\", "\n", " ", "é", "{", "=", ","]),
    max_size=12,
)
_NUMBERS = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False, min_value=0, max_value=1e12),
    st.sampled_from([0.0, 1.0, 1e-9, 123456789.0, 1e22, 2.5]),
)
_REPORT = st.tuples(
    st.sampled_from(CATALOGUE), st.lists(_LABEL_VALUES, min_size=8, max_size=8), _NUMBERS
)


def _apply(observer: PrometheusObserver, reports: list[tuple[object, list[str], float]]) -> None:
    for metric, values, number in reports:
        labels = dict(zip(metric.labels, values, strict=False))  # type: ignore[attr-defined]
        if isinstance(metric, CounterMetric):
            observer.counter(metric, labels, number)
        elif isinstance(metric, GaugeMetric):
            observer.gauge(metric, labels, -number if number > 1e6 else number)
        else:
            assert isinstance(metric, HistogramMetric)
            observer.histogram(metric, labels, number)


@settings(max_examples=60, deadline=None)
@given(st.lists(_REPORT, max_size=40))
def test_the_exposition_is_what_generate_latest_writes(
    reports: list[tuple[object, list[str], float]],
) -> None:
    observer = PrometheusObserver(max_label_values=5, max_label_length=8)
    _apply(observer, reports)
    expected = prometheus_client.generate_latest(observer.registry)
    assert observer.exposition() == expected
    assert b"".join(observer.exposition_parts()) == expected


def test_a_nan_and_infinite_gauge_are_written_alike() -> None:
    observer = PrometheusObserver()
    gauges = [m for m in CATALOGUE if isinstance(m, GaugeMetric)]
    for i, metric in enumerate(gauges):
        labels = {name: "x" for name in metric.labels}
        observer.gauge(metric, labels, (math.inf, -math.inf, 0.5)[i % 3])
    assert observer.exposition() == prometheus_client.generate_latest(observer.registry)
