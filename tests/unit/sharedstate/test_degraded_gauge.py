"""The process's one shared-state degraded gauge, reported by several components."""

from __future__ import annotations

from domain.sharedstate.degraded import DegradedGauge
from ports.metric_catalogue import SHARED_STATE_DEGRADED
from tests.fakes.observer import RecordingObserver


def test_the_gauge_is_one_while_any_component_is_degraded() -> None:
    observer = RecordingObserver()
    gauge = DegradedGauge(observer)
    gauge.set("prefix_index", False)
    gauge.set("kv_index", True)
    gauge.set("prefix_index", True)
    gauge.set("prefix_index", False)  # the other one still is
    assert gauge.degraded
    gauge.set("kv_index", False)
    assert not gauge.degraded
    values = [r.value for r in observer.gauges if r.metric is SHARED_STATE_DEGRADED]
    assert values == [0.0, 1.0, 1.0, 1.0, 0.0]
