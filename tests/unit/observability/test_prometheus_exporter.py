"""The EPP's own metrics: the catalogue is the reference's (spec section 9), and every entry
is served on /metrics with its name, type, labels and buckets.

``EXPECTED`` and ``BUCKETS`` spell the public names out on purpose: they pin the catalogue
to what the reference exports, so a rename fails here. The other tests name entries."""

from __future__ import annotations

import logging
import math
import socket

import aiohttp
import prometheus_client
import pytest
from prometheus_client.parser import text_string_to_metric_families

from adapters.prometheus.exporter import MetricsServer, PrometheusObserver
from ports import metric_catalogue as catalogue
from ports.metric_catalogue import CATALOGUE, CounterMetric, HistogramMetric, MetricKind

MODEL = {"model_name", "target_model_name"}
FLOW = {"fairness_id", "priority"}
FLOW_QUEUE = FLOW | {"inference_pool"} | MODEL

#: name -> (type, label names), from spec section 9 (plus this product's two counters).
EXPECTED: dict[str, tuple[str, set[str]]] = {
    "inference_objective_request_total": ("counter", MODEL | {"priority"}),
    "inference_objective_request_error_total": ("counter", MODEL | {"error_code"}),
    "inference_objective_request_duration_seconds": ("histogram", MODEL),
    "inference_objective_request_sizes": ("histogram", MODEL),
    "inference_objective_response_sizes": ("histogram", MODEL),
    "inference_objective_input_tokens": ("histogram", MODEL),
    "inference_objective_output_tokens": ("histogram", MODEL),
    "inference_objective_prompt_cached_tokens": ("histogram", MODEL),
    "inference_objective_normalized_time_per_output_token_seconds": ("histogram", MODEL),
    "inference_objective_running_requests": ("gauge", {"model_name"}),
    "inference_pool_average_kv_cache_utilization": ("gauge", {"name"}),
    "inference_pool_average_queue_size": ("gauge", {"name"}),
    "inference_pool_average_running_requests": ("gauge", {"name"}),
    "inference_pool_ready_pods": ("gauge", {"name"}),
    "inference_pool_per_pod_queue_size": ("gauge", {"name", "model_server_pod"}),
    "inference_extension_scheduler_e2e_duration_seconds": ("histogram", set()),
    "inference_extension_scheduler_attempts_total": (
        "counter",
        {"status", "target_model_name", "pod_name", "namespace", "port"},
    ),
    "inference_extension_plugin_duration_seconds": (
        "histogram",
        {"extension_point", "plugin_type", "plugin_name"},
    ),
    "inference_extension_prefix_indexer_size": ("gauge", set()),
    "inference_extension_prefix_indexer_hit_ratio": ("histogram", set()),
    "inference_extension_prefix_indexer_hit_bytes": ("histogram", set()),
    "inference_extension_kv_capacity_gate_held_requests": ("gauge", set()),
    "inference_extension_kv_capacity_gate_wait_seconds": ("histogram", {"outcome"}),
    "inference_extension_info": ("gauge", {"commit", "build_ref"}),
    "inference_extension_model_rewrite_decisions_total": (
        "counter",
        {"model_rewrite_name", "model_name", "target_model"},
    ),
    "inference_extension_flow_control_request_queue_duration_seconds": (
        "histogram",
        FLOW | {"outcome", "inference_pool"} | MODEL,
    ),
    "inference_extension_flow_control_dispatch_cycle_duration_seconds": ("histogram", set()),
    "inference_extension_flow_control_request_enqueue_duration_seconds": (
        "histogram",
        FLOW | {"outcome"},
    ),
    "inference_extension_flow_control_queue_size": ("gauge", FLOW_QUEUE),
    "inference_extension_flow_control_queue_bytes": ("gauge", FLOW_QUEUE),
    "inference_extension_flow_control_pool_saturation": ("gauge", {"inference_pool"}),
    "inference_extension_scrape_errors_total": ("counter", {"endpoint"}),
    "inference_extension_flow_control_displaced_total": ("counter", {"priority"}),
    "inference_extension_shared_state_roundtrip_seconds": ("histogram", {"operation"}),
    "inference_extension_shared_state_deadline_misses_total": ("counter", set()),
    "inference_extension_shared_state_errors_total": ("counter", {"operation"}),
    "inference_extension_shared_state_degraded": ("gauge", set()),
    "inference_extension_shared_state_claims_total": ("counter", {"outcome"}),
    "inference_extension_shared_state_writes_total": ("counter", set()),
    "inference_extension_shared_state_dropped_writes_total": ("counter", set()),
    "inference_extension_kv_index_entries": ("gauge", set()),
    "inference_extension_kv_index_loaded_blocks_total": ("counter", set()),
    "inference_extension_kv_index_writer_leases": ("gauge", set()),
    "inference_extension_kv_index_pending_writes": ("gauge", set()),
    "inference_extension_kv_events_total": ("counter", {"endpoint", "kind"}),
    "inference_extension_kv_events_lag_seconds": ("histogram", set()),
    "inference_extension_kv_events_gaps_total": ("counter", {"endpoint"}),
    "inference_extension_kv_events_errors_total": ("counter", {"endpoint", "reason"}),
    "inference_extension_kv_events_endpoint_trusted": ("gauge", {"endpoint"}),
    "inference_extension_kv_events_subscription_state": ("gauge", {"endpoint", "state"}),
    "inference_extension_precise_prefix_unkeyed_total": ("counter", {"reason"}),
    # predicted-latency-producer: the reference's names, and the route receipts
    "inference_objective_request_ttft_seconds": ("histogram", MODEL),
    "inference_objective_request_predicted_ttft_seconds": ("histogram", MODEL),
    "inference_objective_request_ttft_prediction_duration_seconds": ("histogram", MODEL),
    "inference_objective_request_tpot_seconds": ("histogram", MODEL),
    "inference_objective_request_predicted_tpot_seconds": ("histogram", MODEL),
    "inference_objective_request_tpot_prediction_duration_seconds": ("histogram", MODEL),
    "inference_objective_request_slo_violation_total": ("counter", MODEL | {"type"}),
    "inference_extension_latency_prediction_error_seconds": ("histogram", {"endpoint", "kind"}),
    "inference_extension_prefix_hit_prediction_error_ratio": ("histogram", {"endpoint"}),
    "inference_extension_latency_samples_refused_total": ("counter", {"reason"}),
}


REQUEST = MODEL | FLOW
#: The llm-d router's names of the same values (its docs/metrics.md and
#: pkg/epp/metrics/llm_d_router_metrics.go): name -> (type, label names).
LLMD_EXPECTED: dict[str, tuple[str, set[str]]] = {
    "llm_d_epp_request_total": ("counter", REQUEST),
    "llm_d_epp_request_error_total": ("counter", REQUEST | {"error_code"}),
    "llm_d_epp_request_duration_seconds": ("histogram", REQUEST),
    "llm_d_epp_request_size_bytes": ("histogram", REQUEST),
    "llm_d_epp_response_size_bytes": ("histogram", REQUEST),
    "llm_d_epp_request_input_tokens": ("histogram", REQUEST),
    "llm_d_epp_request_output_tokens": ("histogram", REQUEST),
    "llm_d_epp_request_cached_tokens": ("histogram", REQUEST),
    "llm_d_epp_request_ntpot_seconds": ("histogram", REQUEST),
    "llm_d_epp_request_running": ("gauge", REQUEST),
    "llm_d_epp_average_kv_cache_utilization": ("gauge", {"name"}),
    "llm_d_epp_average_queue_size": ("gauge", {"name"}),
    "llm_d_epp_average_running_requests": ("gauge", {"name"}),
    "llm_d_epp_ready_endpoints": ("gauge", {"name"}),
    "llm_d_epp_per_endpoint_queue_size": ("gauge", {"name", "model_server_endpoint"}),
    "llm_d_epp_scheduler_e2e_duration_seconds": ("histogram", set()),
    "llm_d_epp_scheduler_attempts_total": (
        "counter",
        {"status", "target_model_name", "endpoint_name", "namespace", "port"},
    ),
    "llm_d_epp_plugin_duration_seconds": (
        "histogram",
        {"extension_point", "plugin_type", "plugin_name"},
    ),
    "llm_d_epp_prefix_indexer_size": ("gauge", set()),
    "llm_d_epp_prefix_indexer_hit_ratio": ("histogram", set()),
    "llm_d_epp_prefix_indexer_hit_bytes": ("histogram", set()),
    "llm_d_epp_info": ("gauge", {"commit", "build_ref"}),
    "llm_d_epp_model_rewrite_decisions_total": (
        "counter",
        {"model_rewrite_name", "model_name", "target_model"},
    ),
    "llm_d_epp_flow_control_request_queue_duration_seconds": (
        "histogram",
        FLOW | {"outcome", "inference_pool"} | MODEL,
    ),
    "llm_d_epp_flow_control_dispatch_cycle_duration_seconds": ("histogram", set()),
    "llm_d_epp_flow_control_request_enqueue_duration_seconds": ("histogram", FLOW | {"outcome"}),
    "llm_d_epp_flow_control_queue_size": ("gauge", FLOW_QUEUE),
    "llm_d_epp_flow_control_queue_bytes": ("gauge", FLOW_QUEUE),
    "llm_d_epp_flow_control_pool_saturation": ("gauge", {"inference_pool", "stage"}),
    "llm_d_epp_datalayer_poll_errors_total": ("counter", {"source_type"}),
}
#: The llm-d router's metrics of values the reference has no metric for, under its names.
LLMD_ONLY: dict[str, tuple[str, set[str]]] = {
    "llm_d_epp_extproc_streams_inflight": ("gauge", set()),
    "llm_d_epp_extproc_stream_duration_seconds": ("histogram", set()),
    "llm_d_epp_extproc_streams_total": ("counter", {"code"}),
    "llm_d_epp_std_dev_kv_cache_utilization": ("gauge", {"name"}),
    "llm_d_epp_std_dev_queue_size": ("gauge", {"name"}),
    "llm_d_epp_std_dev_running_requests": ("gauge", {"name"}),
}
#: histogram name -> its bucket upper bounds (without +Inf), byte for byte on /metrics.
BUCKETS: dict[str, tuple[float, ...]] = {
    "inference_objective_request_duration_seconds": (
        0.005, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.25, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0,
        8.0, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 120.0, 180.0, 240.0, 300.0, 360.0, 480.0,
        600.0, 900.0, 1200.0, 1800.0, 2700.0, 3600.0,
    ),
    "inference_objective_request_sizes": tuple(64.0 * 2**i for i in range(25)),
    "inference_objective_response_sizes": (1.0, *(8.0 * 2**i for i in range(14))),
    "inference_objective_input_tokens": (1.0, *(8.0 * 2**i for i in range(18))),
    "inference_objective_output_tokens": (1.0, *(8.0 * 2**i for i in range(11))),
    "inference_objective_prompt_cached_tokens": (1.0, *(8.0 * 2**i for i in range(18))),
    "inference_objective_normalized_time_per_output_token_seconds": (
        0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0,
    ),
    "inference_extension_scheduler_e2e_duration_seconds": (
        0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1,
    ),
    "inference_extension_plugin_duration_seconds": (
        0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1,
    ),
    "inference_extension_prefix_indexer_hit_ratio": (
        0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0,
    ),
    "inference_extension_prefix_indexer_hit_bytes": (0.0, *(1024.0 * 2**i for i in range(7))),
    "inference_extension_kv_capacity_gate_wait_seconds": (
        0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0,
        120.0,
    ),
    "inference_extension_flow_control_request_queue_duration_seconds": (
        0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0,
        120.0,
    ),
    "inference_extension_flow_control_dispatch_cycle_duration_seconds": (
        0.00001, 0.00005, 0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1,
    ),
    "inference_extension_flow_control_request_enqueue_duration_seconds": (
        0.00001, 0.00005, 0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1,
    ),
    "inference_extension_shared_state_roundtrip_seconds": (
        0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
    ),
    "inference_extension_kv_events_lag_seconds": (
        0.00001, 0.00005, 0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0,
    ),
    "llm_d_epp_extproc_stream_duration_seconds": (
        0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
    ),
    # the reference's latency-predictor histograms: its general latency buckets for TTFT,
    # our TPOT buckets; prediction takes microseconds here, not a sidecar's milliseconds
    "inference_objective_request_ttft_seconds": (
        0.005, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.25, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0,
        8.0, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 120.0, 180.0, 240.0, 300.0, 360.0, 480.0,
        600.0, 900.0, 1200.0, 1800.0, 2700.0, 3600.0,
    ),
    "inference_objective_request_predicted_ttft_seconds": (
        0.005, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.25, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0,
        8.0, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 120.0, 180.0, 240.0, 300.0, 360.0, 480.0,
        600.0, 900.0, 1200.0, 1800.0, 2700.0, 3600.0,
    ),
    "inference_objective_request_ttft_prediction_duration_seconds": (
        0.000001, 0.000005, 0.00001, 0.00005, 0.0001, 0.0005, 0.001, 0.005, 0.01,
    ),
    "inference_objective_request_tpot_seconds": (
        0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0,
    ),
    "inference_objective_request_predicted_tpot_seconds": (
        0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0,
    ),
    "inference_objective_request_tpot_prediction_duration_seconds": (
        0.000001, 0.000005, 0.00001, 0.00005, 0.0001, 0.0005, 0.001, 0.005, 0.01,
    ),
    "inference_extension_prefix_hit_prediction_error_ratio": (
        0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0,
    ),
    "inference_extension_latency_prediction_error_seconds": (
        0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0,
        60.0,
    ),
}  # fmt: skip


def _buckets(name: str) -> tuple[float, ...]:
    (metric,) = [m for m in CATALOGUE if name in m.names()]
    assert isinstance(metric, HistogramMetric), name
    return metric.buckets


def _one_of_each(observer: PrometheusObserver) -> None:
    for metric in CATALOGUE:
        labels = {label: f"{label}-value" for label in metric.reported_labels}
        if isinstance(metric, CounterMetric):
            observer.counter(metric, labels, 2)
        elif isinstance(metric, HistogramMetric):
            observer.histogram(metric, labels, 0.05)
        else:
            assert isinstance(metric, catalogue.GaugeMetric)
            observer.gauge(metric, labels, 3)


def _families(text: str) -> dict[str, prometheus_client.Metric]:
    families = {}
    for family in text_string_to_metric_families(text):
        name = family.name + ("_total" if family.type == "counter" else "")
        families[name] = family
    return families


def test_every_metric_is_declared_with_the_reference_name_type_and_labels() -> None:
    declared = {m.name: (m.kind.value, set(m.labels)) for m in CATALOGUE}
    assert declared == EXPECTED | LLMD_ONLY


def test_buckets_are_the_references() -> None:
    duration = _buckets("inference_objective_request_duration_seconds")
    assert (duration[0], duration[-1]) == (0.005, 3600)
    assert _buckets("inference_objective_request_sizes") == tuple(
        float(64 * 2**i) for i in range(25)
    )
    assert _buckets("inference_objective_request_sizes")[-1] == 1024**3
    response = _buckets("inference_objective_response_sizes")
    assert (response[0], response[-1]) == (1, 65536)
    scheduler = _buckets("inference_extension_scheduler_e2e_duration_seconds")
    assert (scheduler[0], scheduler[-1]) == (0.0001, 0.1)
    assert _buckets("inference_extension_prefix_indexer_hit_ratio") == tuple(
        i / 10 for i in range(11)
    )
    for metric in CATALOGUE:
        buckets = metric.buckets if isinstance(metric, HistogramMetric) else ()
        assert list(buckets) == sorted(set(buckets)), metric.name
        assert bool(buckets) == (metric.kind is MetricKind.HISTOGRAM), metric.name
    assert {m.name: m.buckets for m in CATALOGUE if isinstance(m, HistogramMetric)} == BUCKETS


def test_the_exposition_has_every_metric_with_its_type_labels_and_buckets() -> None:
    observer = PrometheusObserver()
    _one_of_each(observer)
    families = _families(observer.exposition().decode())
    assert set(families) == set(EXPECTED) | set(LLMD_EXPECTED) | set(LLMD_ONLY)
    for name, (kind, labels) in {**EXPECTED, **LLMD_EXPECTED, **LLMD_ONLY}.items():
        family = families[name]
        assert family.type == kind, name
        for sample in family.samples:
            assert set(sample.labels) - {"le"} == labels, name
        if kind == "histogram":
            bounds = [float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")]
            assert bounds == [*_buckets(name), math.inf], name
        else:
            assert [s.value for s in family.samples] == [2 if kind == "counter" else 3], name


def test_the_registry_is_its_own_not_the_global_one() -> None:
    observer = PrometheusObserver()
    observer.counter(catalogue.SCRAPE_ERRORS, {"endpoint": "e"})
    assert observer.registry is not prometheus_client.REGISTRY
    assert b"inference_extension_scrape_errors_total" not in prometheus_client.generate_latest()


def test_counters_add_gauges_set_and_histograms_bucket_cumulatively() -> None:
    observer = PrometheusObserver()
    labels = {"model_name": "m", "target_model_name": "t", "priority": "0"}
    for tenant, count in (("a", 1), ("b", 2)):
        observer.counter(catalogue.REQUEST_TOTAL, {**labels, "fairness_id": tenant}, count)
    observer.gauge(catalogue.POOL_READY_PODS, {"name": "p"}, 3)
    observer.gauge(catalogue.POOL_READY_PODS, {"name": "p"}, 2)
    for value in (0.05, 0.25, 0.3, 1.0):
        observer.histogram(catalogue.PREFIX_INDEXER_HIT_RATIO, {}, value)
    families = _families(observer.exposition().decode())
    (total,) = families["inference_objective_request_total"].samples
    assert total.value == 3  # the reference's series: summed over the fairness ids
    assert total.labels == labels
    by_tenant = {
        s.labels["fairness_id"]: s.value for s in families["llm_d_epp_request_total"].samples
    }
    assert by_tenant == {"a": 1, "b": 2}
    assert families["inference_pool_ready_pods"].samples[0].value == 2
    ratio = {
        s.labels.get("le", s.name): s.value
        for s in families["inference_extension_prefix_indexer_hit_ratio"].samples
    }
    assert ratio["0.0"] == 0
    assert ratio["0.1"] == 1
    assert ratio["0.3"] == 3
    assert ratio["1.0"] == 4
    assert ratio["+Inf"] == 4
    assert ratio["inference_extension_prefix_indexer_hit_ratio_count"] == 4
    assert ratio["inference_extension_prefix_indexer_hit_ratio_sum"] == pytest.approx(1.6)


def test_unlabelled_metrics_are_exposed_at_zero_before_any_report() -> None:
    families = _families(PrometheusObserver().exposition().decode())
    (size,) = families["inference_extension_prefix_indexer_size"].samples
    assert size.value == 0
    assert not families["inference_objective_request_total"].samples


def test_a_nan_gauge_removes_its_series() -> None:
    observer = PrometheusObserver()
    gauge = catalogue.POOL_PER_POD_QUEUE_SIZE
    observer.gauge(gauge, {"name": "p", "model_server_pod": "a"}, 1)
    observer.gauge(gauge, {"name": "p", "model_server_pod": "b"}, 2)
    observer.gauge(gauge, {"name": "p", "model_server_pod": "a"}, math.nan)
    samples = _families(observer.exposition().decode())[gauge.name].samples
    assert [(s.labels["model_server_pod"], s.value) for s in samples] == [("b", 2)]


def test_bad_reports_are_dropped_and_logged_once_never_raised(
    caplog: pytest.LogCaptureFixture,
) -> None:
    observer = PrometheusObserver()
    # Outside the catalogue: a plugin's own entry, say. Impossible for the EPP's own reports.
    unknown = CounterMetric(name="no_such_metric_total", help="Not in the catalogue.")
    with caplog.at_level(logging.WARNING, logger="adapters.prometheus.exporter"):
        for _ in range(3):
            observer.counter(unknown, {})
            observer.counter(catalogue.POOL_READY_PODS, {"name": "p"})  # type: ignore[arg-type]
            observer.gauge(catalogue.RUNNING_REQUESTS, {"model": "m"}, 1)
            observer.histogram(catalogue.REQUEST_SIZES, {"model_name": "m"}, 1)
            observer.counter(catalogue.SCRAPE_ERRORS, {"endpoint": "e"}, -1)
            observer.histogram(catalogue.PREFIX_INDEXER_HIT_RATIO, {}, math.nan)
    assert len(caplog.records) == 6
    assert any("no_such_metric_total" in r.getMessage() for r in caplog.records)
    families = _families(observer.exposition().decode())
    assert not families["inference_objective_running_requests"].samples
    assert not families["inference_extension_scrape_errors_total"].samples
    (count,) = [
        s
        for s in families["inference_extension_prefix_indexer_hit_ratio"].samples
        if s.name.endswith("_count")
    ]
    assert count.value == 0


async def test_the_server_serves_metrics_text_on_a_free_port_until_stopped() -> None:
    observer = PrometheusObserver()
    observer.counter(catalogue.SCRAPE_ERRORS, {"endpoint": "10.0.0.1:8000"})
    server = MetricsServer(observer.registry, host="127.0.0.1", port=0)
    await server.start()
    url = f"http://127.0.0.1:{server.bound_port}/metrics"
    try:
        assert server.bound_port > 0
        async with aiohttp.ClientSession() as session, session.get(url) as response:
            assert response.status == 200
            assert response.headers["content-type"].startswith("text/plain")
            text = await response.text()
        assert (
            'inference_extension_scrape_errors_total{endpoint="10.0.0.1:8000"} 1.0'
            in text.splitlines()
        )
    finally:
        await server.stop()
    await server.stop()  # idempotent
    with pytest.raises(aiohttp.ClientConnectionError):
        async with aiohttp.ClientSession() as session, session.get(url):
            pass


async def test_a_port_in_use_names_the_flag() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = MetricsServer(PrometheusObserver().registry, host="127.0.0.1", port=port)
        with pytest.raises(OSError, match="--metrics-port"):
            await server.start()


def test_request_labelled_series_stay_within_their_text_budget() -> None:
    """Each label within its caps, every model name long and new, yet ``/metrics`` stops
    growing at the budget: the series past it are folded into ``other``."""
    budget = 256 * 1024
    observer = PrometheusObserver(max_request_series_bytes=budget)
    empty = len(b"".join(observer.exposition_parts()))
    for i in range(1000):
        model = f"model-{i:04d}-".ljust(200, "m")
        labels = {
            "model_name": model,
            "target_model_name": model,
            "fairness_id": "tenant",
            "priority": "0",
        }
        for metric in (catalogue.REQUEST_DURATION, catalogue.RESPONSE_SIZES):
            observer.histogram(metric, labels, 0.5)
    body = b"".join(observer.exposition_parts())
    assert budget // 2 < len(body) - empty <= budget
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    models = {
        s.labels["model_name"]
        for s in families["inference_objective_request_duration_seconds"].samples
    }
    assert "other" in models
    assert 2 < len(models) < 1000  # a few models of 200 characters, then only "other"
