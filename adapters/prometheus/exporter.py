"""The EPP's own Prometheus metrics: the metric part of the ``Observer``, and ``/metrics``.

``PrometheusObserver`` declares every metric of the reference EPP (spec section 9) with
the reference's name, type, label names and buckets, plus two of this product's own
(``inference_extension_scrape_errors_total{endpoint}`` and
``inference_extension_flow_control_displaced_total{priority}``). Values live in plain
Python counters updated on the event loop (a few hundred nanoseconds per call) and are
turned into Prometheus families by a collector registered in the observer's own
``CollectorRegistry`` (never the process-global one) when ``/metrics`` is scraped.

A report naming an undeclared metric, using the wrong kind, or with a label set other than
the declared one is dropped and logged once per metric; nothing ever raises into the
caller. A gauge set to NaN removes that labelled series (how a reporter says "this pod is
gone"). ``MetricsServer`` serves the registry as Prometheus text on ``/metrics``.
"""

from __future__ import annotations

import logging
import math
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from operator import itemgetter
from typing import Any, cast

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from ports.observer import NoopSpan, Span

_go_float = cast(Callable[[float], str], floatToGoString)

__all__ = [
    "METRICS",
    "MetricKind",
    "MetricSpec",
    "MetricsServer",
    "PrometheusObserver",
]

logger = logging.getLogger(__name__)


class MetricKind(Enum):
    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


@dataclass(frozen=True, slots=True, kw_only=True)
class MetricSpec:
    """One declared metric. ``buckets`` are the histogram's upper bounds (without +Inf)."""

    name: str
    kind: MetricKind
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()


def _powers_of_two(low: int, high: int) -> tuple[float, ...]:
    out: list[float] = []
    value = low
    while value <= high:
        out.append(float(value))
        value *= 2
    return tuple(out)


_MODEL = ("model_name", "target_model_name")
_DURATION_BUCKETS = (
    0.005, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.25, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0,
    10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 120.0, 180.0, 240.0, 300.0, 360.0, 480.0, 600.0, 900.0,
    1200.0, 1800.0, 2700.0, 3600.0,
)  # fmt: skip
_REQUEST_SIZE_BUCKETS = _powers_of_two(64, 1 << 30)  # 64 B ... 1 GiB
_RESPONSE_SIZE_BUCKETS = (1.0, *_powers_of_two(8, 65536))
_INPUT_TOKEN_BUCKETS = (1.0, *_powers_of_two(8, 1 << 20))
_OUTPUT_TOKEN_BUCKETS = (1.0, *_powers_of_two(8, 8192))
_TPOT_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
_SCHEDULER_BUCKETS = (0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1)
_RATIO_BUCKETS = tuple(round(i * 0.1, 1) for i in range(11))
_HIT_BYTES_BUCKETS = (0.0, *_powers_of_two(1024, 65536))
_QUEUE_DURATION_BUCKETS = (
    0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0,
)  # fmt: skip
_FAST_BUCKETS = (0.00001, 0.00005, 0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1)
_FLOW = ("fairness_id", "priority")
_FLOW_QUEUE = (*_FLOW, "inference_pool", *_MODEL)

_C, _G, _H = MetricKind.COUNTER, MetricKind.GAUGE, MetricKind.HISTOGRAM

#: Every metric the EPP exposes (spec section 9), in exposition order.
METRICS: tuple[MetricSpec, ...] = (
    # per request
    MetricSpec(
        name="inference_objective_request_total",
        kind=_C,
        help="Counter of inference objective requests broken out for each model and target model.",
        labels=(*_MODEL, "priority"),
    ),
    MetricSpec(
        name="inference_objective_request_error_total",
        kind=_C,
        help="Counter of inference objective requests errors broken out for each model and "
        "target model.",
        labels=(*_MODEL, "error_code"),
    ),
    MetricSpec(
        name="inference_objective_request_duration_seconds",
        kind=_H,
        help="Inference objective response latency distribution in seconds for each model "
        "and target model.",
        labels=_MODEL,
        buckets=_DURATION_BUCKETS,
    ),
    MetricSpec(
        name="inference_objective_request_sizes",
        kind=_H,
        help="Inference objective requests size distribution in bytes for each model and "
        "target model.",
        labels=_MODEL,
        buckets=_REQUEST_SIZE_BUCKETS,
    ),
    MetricSpec(
        name="inference_objective_response_sizes",
        kind=_H,
        help="Inference objective responses size distribution in bytes for each model and "
        "target model.",
        labels=_MODEL,
        buckets=_RESPONSE_SIZE_BUCKETS,
    ),
    MetricSpec(
        name="inference_objective_input_tokens",
        kind=_H,
        help="Inference objective input token count distribution for requests in each model.",
        labels=_MODEL,
        buckets=_INPUT_TOKEN_BUCKETS,
    ),
    MetricSpec(
        name="inference_objective_output_tokens",
        kind=_H,
        help="Inference objective output token count distribution for requests in each model.",
        labels=_MODEL,
        buckets=_OUTPUT_TOKEN_BUCKETS,
    ),
    MetricSpec(
        name="inference_objective_prompt_cached_tokens",
        kind=_H,
        help="Inference objective prompt cached token count distribution for requests in each "
        "model.",
        labels=_MODEL,
        buckets=_INPUT_TOKEN_BUCKETS,
    ),
    MetricSpec(
        name="inference_objective_normalized_time_per_output_token_seconds",
        kind=_H,
        help="Inference objective latency divided by number of output tokens in seconds for "
        "each model and target model.",
        labels=_MODEL,
        buckets=_TPOT_BUCKETS,
    ),
    MetricSpec(
        name="inference_objective_running_requests",
        kind=_G,
        help="Inference objective number of running requests in each model.",
        labels=("model_name",),
    ),
    # pool
    MetricSpec(
        name="inference_pool_average_kv_cache_utilization",
        kind=_G,
        help="The average kv cache utilization for an inference server pool.",
        labels=("name",),
    ),
    MetricSpec(
        name="inference_pool_average_queue_size",
        kind=_G,
        help="The average number of requests pending in the model server queue.",
        labels=("name",),
    ),
    MetricSpec(
        name="inference_pool_average_running_requests",
        kind=_G,
        help="The average number of requests currently being processed by the model servers.",
        labels=("name",),
    ),
    MetricSpec(
        name="inference_pool_ready_pods",
        kind=_G,
        help="The number of ready pods in the inference server pool.",
        labels=("name",),
    ),
    MetricSpec(
        name="inference_pool_per_pod_queue_size",
        kind=_G,
        help="The total number of requests pending in the model server queue for each "
        "underlying pod.",
        labels=("name", "model_server_pod"),
    ),
    # extension
    MetricSpec(
        name="inference_extension_scheduler_e2e_duration_seconds",
        kind=_H,
        help="End-to-end scheduling latency distribution in seconds.",
        buckets=_SCHEDULER_BUCKETS,
    ),
    MetricSpec(
        name="inference_extension_scheduler_attempts_total",
        kind=_C,
        help="Total number of scheduling attempts.",
        labels=("status", "target_model_name", "pod_name", "namespace", "port"),
    ),
    MetricSpec(
        name="inference_extension_plugin_duration_seconds",
        kind=_H,
        help="Plugin processing latency distribution in seconds for each extension point, "
        "plugin type and plugin name.",
        labels=("extension_point", "plugin_type", "plugin_name"),
        buckets=_SCHEDULER_BUCKETS,
    ),
    MetricSpec(
        name="inference_extension_prefix_indexer_size",
        kind=_G,
        help="Size of the prefix indexer.",
    ),
    MetricSpec(
        name="inference_extension_prefix_indexer_hit_ratio",
        kind=_H,
        help="Ratio of prefix length matched to total prefix length in the cache lookup.",
        buckets=_RATIO_BUCKETS,
    ),
    MetricSpec(
        name="inference_extension_prefix_indexer_hit_bytes",
        kind=_H,
        help="Length of the prefix match in number of bytes in the cache lookup.",
        buckets=_HIT_BYTES_BUCKETS,
    ),
    MetricSpec(
        name="inference_extension_info",
        kind=_G,
        help="General information of the current build of Inference Extension.",
        labels=("commit", "build_ref"),
    ),
    MetricSpec(
        name="inference_extension_model_rewrite_decisions_total",
        kind=_C,
        help="Total number of model rewrite decisions.",
        labels=("model_rewrite_name", "model_name", "target_model"),
    ),
    # flow control
    MetricSpec(
        name="inference_extension_flow_control_request_queue_duration_seconds",
        kind=_H,
        help="Distribution of the total time requests spend in the flow control layer, from "
        "enqueue to final outcome.",
        labels=(*_FLOW, "outcome", "inference_pool", *_MODEL),
        buckets=_QUEUE_DURATION_BUCKETS,
    ),
    MetricSpec(
        name="inference_extension_flow_control_dispatch_cycle_duration_seconds",
        kind=_H,
        help="Distribution of the time taken for each dispatch cycle of the flow control layer.",
        buckets=_FAST_BUCKETS,
    ),
    MetricSpec(
        name="inference_extension_flow_control_request_enqueue_duration_seconds",
        kind=_H,
        help="Distribution of the time taken to enqueue requests in the flow control layer.",
        labels=(*_FLOW, "outcome"),
        buckets=_FAST_BUCKETS,
    ),
    MetricSpec(
        name="inference_extension_flow_control_queue_size",
        kind=_G,
        help="Current number of requests held in the flow control queues.",
        labels=_FLOW_QUEUE,
    ),
    MetricSpec(
        name="inference_extension_flow_control_queue_bytes",
        kind=_G,
        help="Current total size in bytes of the requests held in the flow control queues.",
        labels=_FLOW_QUEUE,
    ),
    MetricSpec(
        name="inference_extension_flow_control_pool_saturation",
        kind=_G,
        help="Current saturation of the inference pool as seen by the flow control layer.",
        labels=("inference_pool",),
    ),
    # this product's own
    MetricSpec(
        name="inference_extension_scrape_errors_total",
        kind=_C,
        help="Failed polls of a model server's metrics, per endpoint.",
        labels=("endpoint",),
    ),
    MetricSpec(
        name="inference_extension_flow_control_displaced_total",
        kind=_C,
        help="Queued requests displaced by higher-priority requests in the flow control "
        "layer, per priority of the displaced request.",
        labels=("priority",),
    ),
)

LabelKey = tuple[object, ...]
_NOOP_SPAN = NoopSpan()


class _Histogram:
    """Per-bucket (not cumulative) counts, the last one for +Inf, and the sum."""

    __slots__ = ("counts", "sum")

    def __init__(self, buckets: int) -> None:
        self.counts = [0] * (buckets + 1)
        self.sum = 0.0


def _key_function(names: Sequence[str]) -> Callable[[Mapping[str, str]], LabelKey | None]:
    """Label values in declared order, or ``None`` when the label set is not ``names``."""
    count = len(names)
    if count == 0:

        def empty(labels: Mapping[str, str]) -> LabelKey | None:
            return () if not labels else None

        return empty
    getter = itemgetter(*names)
    single = count == 1

    def key(labels: Mapping[str, str]) -> LabelKey | None:
        if len(labels) != count:
            return None
        try:
            values = getter(labels)
        except KeyError:
            return None
        return (values,) if single else cast(LabelKey, values)

    return key


class _Family:
    __slots__ = ("bounds", "children", "key", "le", "spec")

    def __init__(self, spec: MetricSpec) -> None:
        self.spec = spec
        self.key = _key_function(spec.labels)
        self.bounds = spec.buckets
        self.le = [_go_float(b) for b in spec.buckets] + ["+Inf"]
        #: label values -> ``[value]`` (counter, gauge) or ``_Histogram``
        self.children: dict[LabelKey, Any] = {}

    def metric(self) -> Metric:
        spec = self.spec
        children = list(self.children.items())
        if not children and not spec.labels:
            children = [((), self._zero())]
        if spec.kind is MetricKind.HISTOGRAM:
            family = HistogramMetricFamily(spec.name, spec.help, labels=spec.labels)
            for key, child in children:
                cumulative = 0
                buckets: list[tuple[str, float]] = []
                for le, count in zip(self.le, child.counts, strict=True):
                    cumulative += count
                    buckets.append((le, cumulative))
                family.add_metric(_values(key), buckets, child.sum)
            return family
        scalar_family: CounterMetricFamily | GaugeMetricFamily
        if spec.kind is MetricKind.COUNTER:
            scalar_family = CounterMetricFamily(spec.name, spec.help, labels=spec.labels)
        else:
            scalar_family = GaugeMetricFamily(spec.name, spec.help, labels=spec.labels)
        for key, child in children:
            scalar_family.add_metric(_values(key), child[0])
        return scalar_family

    def _zero(self) -> Any:
        if self.spec.kind is MetricKind.HISTOGRAM:
            return _Histogram(len(self.bounds))
        return [0.0]


def _values(key: LabelKey) -> list[str]:
    return [v if isinstance(v, str) else str(v) for v in key]


class _Collector:
    """Turns the observer's values into metric families at scrape time."""

    def __init__(self, families: Iterable[_Family]) -> None:
        self._families = tuple(families)

    def collect(self) -> Iterator[Metric]:
        for family in self._families:
            yield family.metric()

    def describe(self) -> Iterator[Metric]:
        for family in self._families:
            spec = family.spec
            if spec.kind is MetricKind.HISTOGRAM:
                yield HistogramMetricFamily(spec.name, spec.help, labels=spec.labels)
            elif spec.kind is MetricKind.COUNTER:
                yield CounterMetricFamily(spec.name, spec.help, labels=spec.labels)
            else:
                yield GaugeMetricFamily(spec.name, spec.help, labels=spec.labels)


class PrometheusObserver:
    """An ``Observer`` of metrics only (``start_span`` gives a no-op span).

    Call it from the event loop thread only. ``registry`` holds exactly the declared
    metrics; ``specs`` defaults to ``METRICS``.
    """

    def __init__(self, specs: Sequence[MetricSpec] = METRICS) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        families = [_Family(spec) for spec in specs]
        self.specs: Mapping[str, MetricSpec] = {f.spec.name: f.spec for f in families}
        if len(self.specs) != len(families):
            raise ValueError("duplicate metric name in specs")
        self._counters = {f.spec.name: f for f in families if f.spec.kind is MetricKind.COUNTER}
        self._gauges = {f.spec.name: f for f in families if f.spec.kind is MetricKind.GAUGE}
        self._histograms = {f.spec.name: f for f in families if f.spec.kind is MetricKind.HISTOGRAM}
        self._warned: set[str] = set()
        self.registry.register(_Collector(families))

    def counter(self, name: str, labels: Mapping[str, str], value: float = 1.0) -> None:
        family = self._counters.get(name)
        if family is None:
            self._reject(name, "counter", labels)
            return
        key = family.key(labels)
        if key is None:
            self._reject(name, "counter", labels)
            return
        if not value >= 0.0:  # negative or NaN: a counter never goes down
            self._warn(name, f"counter {name}: dropped the invalid increment {value!r}")
            return
        child = family.children.get(key)
        if child is None:
            family.children[key] = [value]
        else:
            child[0] += value

    def gauge(self, name: str, labels: Mapping[str, str], value: float) -> None:
        family = self._gauges.get(name)
        if family is None:
            self._reject(name, "gauge", labels)
            return
        key = family.key(labels)
        if key is None:
            self._reject(name, "gauge", labels)
            return
        if value != value:  # NaN: the series is gone
            family.children.pop(key, None)
            return
        child = family.children.get(key)
        if child is None:
            family.children[key] = [value]
        else:
            child[0] = value

    def histogram(self, name: str, labels: Mapping[str, str], value: float) -> None:
        family = self._histograms.get(name)
        if family is None:
            self._reject(name, "histogram", labels)
            return
        key = family.key(labels)
        if key is None:
            self._reject(name, "histogram", labels)
            return
        if value != value or math.isinf(value):
            self._warn(name, f"histogram {name}: dropped the invalid observation {value!r}")
            return
        child = family.children.get(key)
        if child is None:
            child = family.children[key] = _Histogram(len(family.bounds))
        child.counts[bisect_left(family.bounds, value)] += 1
        child.sum += value

    def start_span(
        self,
        name: str,
        *,
        parent: Span | None = None,
        carrier: Mapping[str, str] | None = None,
        attributes: Mapping[str, str | int | float | bool] | None = None,
    ) -> Span:
        return _NOOP_SPAN

    def exposition(self) -> bytes:
        """The registry in the Prometheus text format (0.0.4)."""
        return generate_latest(self.registry)

    def _reject(self, name: str, kind: str, labels: Mapping[str, str]) -> None:
        spec = self.specs.get(name)
        if spec is None:
            why = f"{kind} {name!r} is not a declared metric; dropped"
        elif spec.kind.value != kind:
            why = f"{name} is a {spec.kind.value}, reported as a {kind}; dropped"
        else:
            why = (
                f"{kind} {name}: labels {sorted(labels)} are not the declared "
                f"{list(spec.labels)}; dropped"
            )
        self._warn(name, why)

    def _warn(self, name: str, message: str) -> None:
        if name in self._warned:
            return
        self._warned.add(name)
        logger.warning("%s (logged once per metric)", message)


class MetricsServer:
    """Serves a registry as Prometheus text on ``GET /metrics`` (aiohttp, on the event loop).

    ``start`` binds ``host:port`` (port 0: any free port, see ``bound_port``) and raises
    ``OSError`` naming ``--metrics-port`` when it cannot; ``stop`` closes it (idempotent).
    """

    def __init__(self, registry: CollectorRegistry, *, host: str, port: int) -> None:
        self._registry = registry
        self._host = host
        self._port = port
        self._runner: web.AppRunner | None = None
        self.bound_port = 0

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        site = web.TCPSite(runner, self._host, self._port, reuse_address=True)
        try:
            await site.start()
        except OSError as exc:
            await runner.cleanup()
            raise OSError(
                f"--metrics-port: cannot listen on {self._host}:{self._port}: {exc}"
            ) from exc
        self._runner = runner
        address = runner.addresses[0]
        self.bound_port = int(address[1])
        logger.info("metrics serving on %s:%d (/metrics)", self._host, self.bound_port)

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def _metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self._registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_PLAIN_0_0_4})
