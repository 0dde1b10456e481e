"""The supervisor's ``/metrics``: the workers' expositions merged by each metric's meaning."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from adapters.prometheus.exporter import PrometheusObserver
from adapters.prometheus.merge import merge_expositions
from ports.metric_catalogue import (
    POOL_READY_PODS,
    REQUEST_DURATION,
    REQUEST_TOTAL,
    RUNNING_REQUESTS,
    SCRAPE_ERRORS,
)

MODEL = {"model_name": "m", "target_model_name": "m"}
REQUEST = {**MODEL, "fairness_id": "default-flow", "priority": "0"}


def _samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text.decode())
        for s in family.samples
    }


def _worker(requests: int, running: int, duration: float) -> PrometheusObserver:
    observer = PrometheusObserver()
    for _ in range(requests):
        observer.counter(REQUEST_TOTAL, REQUEST)
        observer.histogram(REQUEST_DURATION, REQUEST, duration)
    observer.gauge(RUNNING_REQUESTS, REQUEST, running)
    observer.gauge(POOL_READY_PODS, {"name": "pool"}, 3)
    return observer


def test_counters_histograms_and_work_gauges_are_summed_pool_gauges_taken_once() -> None:
    first, second = _worker(3, 2, 0.01), _worker(5, 1, 0.2)
    merged = _samples(merge_expositions([first.exposition(), second.exposition()]))
    total = ("inference_objective_request_total", tuple(sorted({**MODEL, "priority": "0"}.items())))
    assert merged[total] == 8
    assert merged[("inference_objective_running_requests", (("model_name", "m"),))] == 3
    # the llm-d router's names of the same work gauge are summed too
    assert merged[("llm_d_epp_request_running", tuple(sorted(REQUEST.items())))] == 3
    assert merged[("inference_pool_ready_pods", (("name", "pool"),))] == 3
    labels = tuple(sorted(MODEL.items()))
    assert merged[("inference_objective_request_duration_seconds_count", labels)] == 8
    assert merged[("inference_objective_request_duration_seconds_sum", labels)] == (
        3 * 0.01 + 5 * 0.2
    )
    inf = tuple(sorted((*labels, ("le", "+Inf"))))
    assert merged[("inference_objective_request_duration_seconds_bucket", inf)] == 8


def test_series_only_one_process_has_are_kept() -> None:
    supervisor = PrometheusObserver()
    supervisor.counter(SCRAPE_ERRORS, {"endpoint": "a"}, 4)
    merged = _samples(merge_expositions([supervisor.exposition(), _worker(1, 0, 0.1).exposition()]))
    assert merged[("inference_extension_scrape_errors_total", (("endpoint", "a"),))] == 4
    assert any(name == "inference_objective_request_total" for name, _ in merged)


def test_the_merge_of_one_exposition_parses_back_to_the_same_samples() -> None:
    text = _worker(2, 1, 0.05).exposition()
    assert _samples(merge_expositions([text])) == _samples(text)
