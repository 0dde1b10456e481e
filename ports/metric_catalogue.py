"""Every metric the EPP exports, declared once: name, kind, help text, label names, buckets.

The domain reports through the ``Observer`` port by passing these entries (never a name of
its own); the Prometheus exporter builds its families from ``CATALOGUE``. Names, types,
labels and buckets are the reference EPP's (spec section 9), so its dashboards keep
working, plus two of this product's own: ``inference_extension_scrape_errors_total
{endpoint}`` and ``inference_extension_flow_control_displaced_total{priority}``.

The kind is the entry's type (``CounterMetric``, ``GaugeMetric``, ``HistogramMetric``), so
reporting a gauge as a counter is a type error. Entries compare by identity: each metric
exists once, here, and an entry hashes as cheaply as any object.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from itertools import pairwise
from typing import ClassVar

__all__ = [
    "CATALOGUE",
    "EXTENSION_INFO",
    "EXTPROC_STREAMS",
    "EXTPROC_STREAMS_INFLIGHT",
    "EXTPROC_STREAM_DURATION",
    "EXTPROC_STREAM_METRICS",
    "FLOW_CONTROL_DISPATCH_CYCLE_DURATION",
    "FLOW_CONTROL_DISPLACED",
    "FLOW_CONTROL_ENQUEUE_DURATION",
    "FLOW_CONTROL_POOL_SATURATION",
    "FLOW_CONTROL_QUEUE_BYTES",
    "FLOW_CONTROL_QUEUE_DURATION",
    "FLOW_CONTROL_QUEUE_SIZE",
    "INPUT_TOKENS",
    "KV_EVENTS",
    "KV_EVENTS_ERRORS",
    "KV_EVENTS_GAPS",
    "KV_EVENTS_LAG",
    "KV_EVENTS_TRUSTED",
    "KV_GATE_HELD",
    "KV_GATE_WAIT",
    "KV_INDEX_ENTRIES",
    "KV_INDEX_LOADED_BLOCKS",
    "KV_INDEX_PENDING_WRITES",
    "KV_INDEX_WRITER_LEASES",
    "KV_KEYS_UNKEYED",
    "LATENCY_PREDICTION_ERROR",
    "LATENCY_SAMPLES_REFUSED",
    "LLMD_PREFIX",
    "MODEL_REWRITE_DECISIONS",
    "NORMALIZED_TPOT",
    "OUTPUT_TOKENS",
    "PLUGIN_DURATION",
    "POOL_AVERAGE_KV_CACHE",
    "POOL_AVERAGE_QUEUE_SIZE",
    "POOL_AVERAGE_RUNNING_REQUESTS",
    "POOL_PER_POD_QUEUE_SIZE",
    "POOL_READY_PODS",
    "POOL_STD_DEV_KV_CACHE",
    "POOL_STD_DEV_QUEUE_SIZE",
    "POOL_STD_DEV_RUNNING_REQUESTS",
    "PREFIX_HIT_PREDICTION_ERROR",
    "PREFIX_INDEXER_HIT_BYTES",
    "PREFIX_INDEXER_HIT_RATIO",
    "PREFIX_INDEXER_SIZE",
    "PROMPT_CACHED_TOKENS",
    "REQUEST_DURATION",
    "REQUEST_ERROR_TOTAL",
    "REQUEST_PREDICTED_TPOT",
    "REQUEST_PREDICTED_TTFT",
    "REQUEST_SIZES",
    "REQUEST_SLO_VIOLATION",
    "REQUEST_TOTAL",
    "REQUEST_TPOT",
    "REQUEST_TPOT_PREDICTION_DURATION",
    "REQUEST_TTFT",
    "REQUEST_TTFT_PREDICTION_DURATION",
    "RESPONSE_SIZES",
    "RUNNING_REQUESTS",
    "SCHEDULER_ATTEMPTS",
    "SCHEDULER_E2E_DURATION",
    "SCRAPE_ERRORS",
    "SHARED_STATE_CLAIMS",
    "SHARED_STATE_DEADLINE_MISSES",
    "SHARED_STATE_DEGRADED",
    "SHARED_STATE_DROPPED_WRITES",
    "SHARED_STATE_ERRORS",
    "SHARED_STATE_ROUNDTRIP",
    "SHARED_STATE_WRITES",
    "Alias",
    "CounterMetric",
    "GaugeMetric",
    "HistogramMetric",
    "Metric",
    "MetricKind",
]


class MetricKind(Enum):
    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


@dataclass(frozen=True, slots=True)
class Alias:
    """The same values exported under another name (the llm-d router's ``llm_d_epp_*``).

    ``labels`` are the alias's label names in exposition order; ``sources`` name the
    reported label each takes its value from (empty: the same names); ``constants`` are
    labels with a fixed value, added after them. Series that differ only in reported labels
    the alias does not show are summed into one."""

    name: str
    labels: tuple[str, ...] = ()
    sources: tuple[str, ...] = ()
    constants: tuple[tuple[str, str], ...] = ()

    def source_labels(self) -> tuple[str, ...]:
        return self.sources or self.labels


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Metric:
    """One exported metric. Every report carries exactly ``reported_labels``: ``labels``
    (the names of this metric's own series, in exposition order) then ``extra_labels``,
    which only its ``aliases`` show (its own series sum over them)."""

    kind: ClassVar[MetricKind]
    name: str
    help: str
    labels: tuple[str, ...] = ()
    extra_labels: tuple[str, ...] = ()
    aliases: tuple[Alias, ...] = ()

    def __post_init__(self) -> None:
        _check_labels(self)

    @property
    def reported_labels(self) -> tuple[str, ...]:
        return self.labels + self.extra_labels

    def names(self) -> tuple[str, ...]:
        """Every name this metric is exported under: its own, then its aliases'."""
        return (self.name, *(alias.name for alias in self.aliases))


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class CounterMetric(Metric):
    """Only goes up; the name ends in ``_total``."""

    kind: ClassVar[MetricKind] = MetricKind.COUNTER


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class GaugeMetric(Metric):
    """Set to the current value; NaN removes the labelled series."""

    kind: ClassVar[MetricKind] = MetricKind.GAUGE


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class HistogramMetric(Metric):
    """``buckets`` are the upper bounds, strictly increasing, without ``+Inf``."""

    kind: ClassVar[MetricKind] = MetricKind.HISTOGRAM
    buckets: tuple[float, ...]

    def __post_init__(self) -> None:
        _check_labels(self)
        bounds = self.buckets
        if not bounds or any(low >= high for low, high in pairwise(bounds)):
            raise ValueError(f"{self.name}: buckets must be strictly increasing, not {bounds}")


def _check_labels(metric: Metric) -> None:
    reported = metric.reported_labels
    if len(set(reported)) != len(reported):
        raise ValueError(f"{metric.name}: duplicate label name in {reported}")
    for alias in metric.aliases:
        if not set(alias.source_labels()) <= set(reported):
            raise ValueError(f"{alias.name}: labels {alias.source_labels()} not in {reported}")
        if len(alias.source_labels()) != len(alias.labels):
            raise ValueError(f"{alias.name}: {alias.labels} and {alias.sources} differ")


#: The llm-d router's metric prefix (``llm_d_epp_``): its dashboards and alerts read these.
LLMD_PREFIX = "llm_d_epp_"


def _llmd(
    name: str,
    labels: tuple[str, ...] = (),
    *,
    sources: tuple[str, ...] = (),
    constants: tuple[tuple[str, str], ...] = (),
) -> tuple[Alias, ...]:
    return (Alias(LLMD_PREFIX + name, labels, sources, constants),)


def _powers_of_two(low: int, high: int) -> tuple[float, ...]:
    out: list[float] = []
    value = low
    while value <= high:
        out.append(float(value))
        value *= 2
    return tuple(out)


_MODEL = ("model_name", "target_model_name")
#: The labels of the llm-d router's request metrics: the model's, the fairness id's and the
#: priority's.
_REQUEST = (*_MODEL, "fairness_id", "priority")
_FAIRNESS_PRIORITY = ("fairness_id", "priority")
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
_SHARED_STATE_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
)  # fmt: skip
_FLOW = ("fairness_id", "priority")
_FLOW_QUEUE = (*_FLOW, "inference_pool", *_MODEL)

# --- per request (the Director) ---

REQUEST_TOTAL = CounterMetric(
    name="inference_objective_request_total",
    help="Counter of inference objective requests broken out for each model and target model.",
    labels=(*_MODEL, "priority"),
    extra_labels=("fairness_id",),
    aliases=_llmd("request_total", _REQUEST),
)
REQUEST_ERROR_TOTAL = CounterMetric(
    name="inference_objective_request_error_total",
    help="Counter of inference objective requests errors broken out for each model and "
    "target model.",
    labels=(*_MODEL, "error_code"),
    extra_labels=_FAIRNESS_PRIORITY,
    aliases=_llmd("request_error_total", (*_REQUEST, "error_code")),
)
REQUEST_DURATION = HistogramMetric(
    name="inference_objective_request_duration_seconds",
    help="Inference objective response latency distribution in seconds for each model "
    "and target model.",
    labels=_MODEL,
    buckets=_DURATION_BUCKETS,
    extra_labels=_FAIRNESS_PRIORITY,
    aliases=_llmd("request_duration_seconds", _REQUEST),
)
REQUEST_SIZES = HistogramMetric(
    name="inference_objective_request_sizes",
    help="Inference objective requests size distribution in bytes for each model and target model.",
    labels=_MODEL,
    buckets=_REQUEST_SIZE_BUCKETS,
    extra_labels=_FAIRNESS_PRIORITY,
    aliases=_llmd("request_size_bytes", _REQUEST),
)
RESPONSE_SIZES = HistogramMetric(
    name="inference_objective_response_sizes",
    help="Inference objective responses size distribution in bytes for each model and "
    "target model.",
    labels=_MODEL,
    buckets=_RESPONSE_SIZE_BUCKETS,
    extra_labels=_FAIRNESS_PRIORITY,
    aliases=_llmd("response_size_bytes", _REQUEST),
)
INPUT_TOKENS = HistogramMetric(
    name="inference_objective_input_tokens",
    help="Inference objective input token count distribution for requests in each model.",
    labels=_MODEL,
    buckets=_INPUT_TOKEN_BUCKETS,
    extra_labels=_FAIRNESS_PRIORITY,
    aliases=_llmd("request_input_tokens", _REQUEST),
)
OUTPUT_TOKENS = HistogramMetric(
    name="inference_objective_output_tokens",
    help="Inference objective output token count distribution for requests in each model.",
    labels=_MODEL,
    buckets=_OUTPUT_TOKEN_BUCKETS,
    extra_labels=_FAIRNESS_PRIORITY,
    aliases=_llmd("request_output_tokens", _REQUEST),
)
PROMPT_CACHED_TOKENS = HistogramMetric(
    name="inference_objective_prompt_cached_tokens",
    help="Inference objective prompt cached token count distribution for requests in each model.",
    labels=_MODEL,
    buckets=_INPUT_TOKEN_BUCKETS,
    extra_labels=_FAIRNESS_PRIORITY,
    aliases=_llmd("request_cached_tokens", _REQUEST),
)
NORMALIZED_TPOT = HistogramMetric(
    name="inference_objective_normalized_time_per_output_token_seconds",
    help="Inference objective latency divided by number of output tokens in seconds for "
    "each model and target model.",
    labels=_MODEL,
    buckets=_TPOT_BUCKETS,
    extra_labels=_FAIRNESS_PRIORITY,
    aliases=_llmd("request_ntpot_seconds", _REQUEST),
)
RUNNING_REQUESTS = GaugeMetric(
    name="inference_objective_running_requests",
    help="Inference objective number of running requests in each model.",
    labels=("model_name",),
    extra_labels=("target_model_name", *_FAIRNESS_PRIORITY),
    aliases=_llmd("request_running", _REQUEST),
)

# --- pool (every --refresh-prometheus-metrics-interval) ---

POOL_AVERAGE_KV_CACHE = GaugeMetric(
    name="inference_pool_average_kv_cache_utilization",
    help="The average kv cache utilization for an inference server pool.",
    labels=("name",),
    aliases=_llmd("average_kv_cache_utilization", ("name",)),
)
POOL_AVERAGE_QUEUE_SIZE = GaugeMetric(
    name="inference_pool_average_queue_size",
    help="The average number of requests pending in the model server queue.",
    labels=("name",),
    aliases=_llmd("average_queue_size", ("name",)),
)
POOL_AVERAGE_RUNNING_REQUESTS = GaugeMetric(
    name="inference_pool_average_running_requests",
    help="The average number of requests currently being processed by the model servers.",
    labels=("name",),
    aliases=_llmd("average_running_requests", ("name",)),
)
POOL_READY_PODS = GaugeMetric(
    name="inference_pool_ready_pods",
    help="The number of ready pods in the inference server pool.",
    labels=("name",),
    aliases=_llmd("ready_endpoints", ("name",)),
)
POOL_PER_POD_QUEUE_SIZE = GaugeMetric(
    name="inference_pool_per_pod_queue_size",
    help="The total number of requests pending in the model server queue for each underlying pod.",
    labels=("name", "model_server_pod"),
    aliases=_llmd(
        "per_endpoint_queue_size",
        ("name", "model_server_endpoint"),
        sources=("name", "model_server_pod"),
    ),
)

# --- extension: scheduler, plugins, prefix indexer, build, model rewrites ---

SCHEDULER_E2E_DURATION = HistogramMetric(
    name="inference_extension_scheduler_e2e_duration_seconds",
    help="End-to-end scheduling latency distribution in seconds.",
    buckets=_SCHEDULER_BUCKETS,
    aliases=_llmd("scheduler_e2e_duration_seconds"),
)
SCHEDULER_ATTEMPTS = CounterMetric(
    name="inference_extension_scheduler_attempts_total",
    help="Total number of scheduling attempts.",
    labels=("status", "target_model_name", "pod_name", "namespace", "port"),
    aliases=_llmd(
        "scheduler_attempts_total",
        ("status", "target_model_name", "endpoint_name", "namespace", "port"),
        sources=("status", "target_model_name", "pod_name", "namespace", "port"),
    ),
)
PLUGIN_DURATION = HistogramMetric(
    name="inference_extension_plugin_duration_seconds",
    help="Plugin processing latency distribution in seconds for each extension point, "
    "plugin type and plugin name.",
    labels=("extension_point", "plugin_type", "plugin_name"),
    buckets=_SCHEDULER_BUCKETS,
    aliases=_llmd("plugin_duration_seconds", ("extension_point", "plugin_type", "plugin_name")),
)
PREFIX_INDEXER_SIZE = GaugeMetric(
    name="inference_extension_prefix_indexer_size",
    help="Size of the prefix indexer.",
    aliases=_llmd("prefix_indexer_size"),
)
PREFIX_INDEXER_HIT_RATIO = HistogramMetric(
    name="inference_extension_prefix_indexer_hit_ratio",
    help="Ratio of prefix length matched to total prefix length in the cache lookup.",
    buckets=_RATIO_BUCKETS,
    aliases=_llmd("prefix_indexer_hit_ratio"),
)
PREFIX_INDEXER_HIT_BYTES = HistogramMetric(
    name="inference_extension_prefix_indexer_hit_bytes",
    help="Length of the prefix match in number of bytes in the cache lookup.",
    buckets=_HIT_BYTES_BUCKETS,
    aliases=_llmd("prefix_indexer_hit_bytes"),
)
EXTENSION_INFO = GaugeMetric(
    name="inference_extension_info",
    help="General information of the current build of Inference Extension.",
    labels=("commit", "build_ref"),
    aliases=_llmd("info", ("commit", "build_ref")),
)
MODEL_REWRITE_DECISIONS = CounterMetric(
    name="inference_extension_model_rewrite_decisions_total",
    help="Total number of model rewrite decisions.",
    labels=("model_rewrite_name", "model_name", "target_model"),
    aliases=_llmd(
        "model_rewrite_decisions_total", ("model_rewrite_name", "model_name", "target_model")
    ),
)

# --- flow control ---

#: Seconds from enqueue to the final outcome, every request.
#: ``kv-capacity-gate``: requests waiting now for KV-cache room on their endpoint.
KV_GATE_HELD = GaugeMetric(
    name="inference_extension_kv_capacity_gate_held_requests",
    help="Requests the kv-capacity-gate holds until their endpoint has KV-cache room.",
)
#: ``kv-capacity-gate``: how long each request it held waited, by how it left the wait.
KV_GATE_WAIT = HistogramMetric(
    name="inference_extension_kv_capacity_gate_wait_seconds",
    help="Time requests held by the kv-capacity-gate waited, by outcome (let_in: room "
    "freed; deadline: maxHoldMs passed; gone: the client left; deleted: the endpoint went).",
    labels=("outcome",),
    buckets=_QUEUE_DURATION_BUCKETS,
)
FLOW_CONTROL_QUEUE_DURATION = HistogramMetric(
    name="inference_extension_flow_control_request_queue_duration_seconds",
    help="Distribution of the total time requests spend in the flow control layer, from "
    "enqueue to final outcome.",
    labels=(*_FLOW, "outcome", "inference_pool", *_MODEL),
    buckets=_QUEUE_DURATION_BUCKETS,
    aliases=_llmd(
        "flow_control_request_queue_duration_seconds",
        (*_FLOW, "outcome", "inference_pool", *_MODEL),
    ),
)
#: Seconds per dispatch cycle.
FLOW_CONTROL_DISPATCH_CYCLE_DURATION = HistogramMetric(
    name="inference_extension_flow_control_dispatch_cycle_duration_seconds",
    help="Distribution of the time taken for each dispatch cycle of the flow control layer.",
    buckets=_FAST_BUCKETS,
    aliases=_llmd("flow_control_dispatch_cycle_duration_seconds"),
)
#: Seconds spent in the enqueue step (capacity checks, displacement, insertion);
#: ``outcome`` is the state right after it (``NotYetFinalized`` when queued,
#: ``Dispatched`` on the fast path, ``Rejected*``).
FLOW_CONTROL_ENQUEUE_DURATION = HistogramMetric(
    name="inference_extension_flow_control_request_enqueue_duration_seconds",
    help="Distribution of the time taken to enqueue requests in the flow control layer.",
    labels=(*_FLOW, "outcome"),
    buckets=_FAST_BUCKETS,
    aliases=_llmd("flow_control_request_enqueue_duration_seconds", (*_FLOW, "outcome")),
)
FLOW_CONTROL_QUEUE_SIZE = GaugeMetric(
    name="inference_extension_flow_control_queue_size",
    help="Current number of requests held in the flow control queues.",
    labels=_FLOW_QUEUE,
    aliases=_llmd("flow_control_queue_size", _FLOW_QUEUE),
)
FLOW_CONTROL_QUEUE_BYTES = GaugeMetric(
    name="inference_extension_flow_control_queue_bytes",
    help="Current total size in bytes of the requests held in the flow control queues.",
    labels=_FLOW_QUEUE,
    aliases=_llmd("flow_control_queue_bytes", _FLOW_QUEUE),
)
#: The saturation last read.
FLOW_CONTROL_POOL_SATURATION = GaugeMetric(
    name="inference_extension_flow_control_pool_saturation",
    help="Current saturation of the inference pool as seen by the flow control layer.",
    labels=("inference_pool",),
    # one stage here (no prefill/decode split of saturation): the gating value
    aliases=_llmd(
        "flow_control_pool_saturation", ("inference_pool",), constants=(("stage", "effective"),)
    ),
)

# --- this product's own ---

SCRAPE_ERRORS = CounterMetric(
    name="inference_extension_scrape_errors_total",
    help="Failed polls of a model server's metrics, per endpoint.",
    labels=("endpoint",),
    # every failed poll of the model servers' metrics, by source type (one here)
    aliases=_llmd(
        "datalayer_poll_errors_total", constants=(("source_type", "metrics-data-source"),)
    ),
)
#: Queued requests displaced by higher-priority arrivals, by the displaced one's priority.
FLOW_CONTROL_DISPLACED = CounterMetric(
    name="inference_extension_flow_control_displaced_total",
    help="Queued requests displaced by higher-priority requests in the flow control "
    "layer, per priority of the displaced request.",
    labels=("priority",),
)

# --- shared state (several EPP processes on one store; see docs/shared-state.md) ---

#: Seconds per answered round trip to the shared store, by ``operation`` (``match``,
#: ``add``, ``remove_endpoint``, ``probe``); misses and errors are not observed here.
SHARED_STATE_ROUNDTRIP = HistogramMetric(
    name="inference_extension_shared_state_roundtrip_seconds",
    help="Round-trip latency distribution in seconds of answered shared-state operations.",
    labels=("operation",),
    buckets=_SHARED_STATE_BUCKETS,
)
#: Routing-path reads that missed their deadline and used the local state instead.
SHARED_STATE_DEADLINE_MISSES = CounterMetric(
    name="inference_extension_shared_state_deadline_misses_total",
    help="Shared-state reads on the routing path that missed their deadline (answered "
    "from local state).",
)
SHARED_STATE_ERRORS = CounterMetric(
    name="inference_extension_shared_state_errors_total",
    help="Failed shared-state operations, per operation.",
    labels=("operation",),
)
#: 1 while the shared state is degraded (routing on local state only), else 0.
SHARED_STATE_DEGRADED = GaugeMetric(
    name="inference_extension_shared_state_degraded",
    help="1 while the shared state is degraded and routing uses local state only, else 0.",
)
SHARED_STATE_CLAIMS = CounterMetric(
    name="inference_extension_shared_state_claims_total",
    help="Claims of a new prompt prefix after the pick, by outcome: won (recorded for the "
    "pick), moved (recorded for an endpoint tied with the pick that fewer new prefixes went to "
    "lately), lost (another process's endpoint owns it), fallback (no answer in time: the pick "
    "stands).",
    labels=("outcome",),
)
SHARED_STATE_WRITES = CounterMetric(
    name="inference_extension_shared_state_writes_total",
    help="Writes sent to the shared store and acknowledged.",
)
#: Writes never sent: the pending queue was full, or the store was degraded (the rebuild
#: after recovery re-sends what the local state still knows).
SHARED_STATE_DROPPED_WRITES = CounterMetric(
    name="inference_extension_shared_state_dropped_writes_total",
    help="Writes to the shared store dropped (pending queue full, store degraded, or more refused "
    "writes than are kept for sending again).",
)

# --- KV-cache events (precise prefix-cache routing) ---

KV_INDEX_ENTRIES = GaugeMetric(
    name="inference_extension_kv_index_entries",
    help="(block, endpoint) entries in the KV-block index fed by the model servers' events.",
)
#: The shared copy (``indexerConfig.backend: redis``): what this process loaded from it,
#: the endpoints it writes, and how far its writes are behind its events.
KV_INDEX_LOADED_BLOCKS = CounterMetric(
    name="inference_extension_kv_index_loaded_blocks_total",
    help="KV-block index entries loaded from the shared copy (warm start).",
)
KV_INDEX_WRITER_LEASES = GaugeMetric(
    name="inference_extension_kv_index_writer_leases",
    help="Endpoints whose events this process writes to the shared KV-block index copy.",
)
KV_INDEX_PENDING_WRITES = GaugeMetric(
    name="inference_extension_kv_index_pending_writes",
    help="KV-event batches and rewrites waiting to be written to the shared copy.",
)
KV_EVENTS = CounterMetric(
    name="inference_extension_kv_events_total",
    help="KV-cache events received, per endpoint and kind (BlockStored, BlockRemoved, "
    "AllBlocksCleared).",
    labels=("endpoint", "kind"),
)
#: Seconds from a batch's timestamp (the engine's clock) to its arrival.
KV_EVENTS_LAG = HistogramMetric(
    name="inference_extension_kv_events_lag_seconds",
    help="Delay in seconds between a KV-event batch's timestamp and its arrival.",
    buckets=(*_FAST_BUCKETS, 0.5, 1.0, 5.0),
)
KV_EVENTS_GAPS = CounterMetric(
    name="inference_extension_kv_events_gaps_total",
    help="Breaks in an endpoint's KV-event stream (sequence gaps, lost connections).",
    labels=("endpoint",),
)
KV_EVENTS_ERRORS = CounterMetric(
    name="inference_extension_kv_events_errors_total",
    help="KV-event messages or events dropped, per endpoint and reason (malformed, unknown_kind).",
    labels=("endpoint", "reason"),
)
KV_EVENTS_TRUSTED = GaugeMetric(
    name="inference_extension_kv_events_endpoint_trusted",
    help="1 while an endpoint's KV-event stream is unbroken (its index entries are used), else 0.",
    labels=("endpoint",),
)
KV_KEYS_UNKEYED = CounterMetric(
    name="inference_extension_precise_prefix_unkeyed_total",
    help="Requests precise-prefix-cache-producer could not key as the model server does "
    "(matched on the approximate path instead), per reason.",
    labels=("reason",),
)

# --- the pool's spread, under the llm-d router's names ---

POOL_STD_DEV_KV_CACHE = GaugeMetric(
    name=LLMD_PREFIX + "std_dev_kv_cache_utilization",
    help="Standard deviation of the KV-cache utilization of the pool's fresh endpoints.",
    labels=("name",),
)
POOL_STD_DEV_QUEUE_SIZE = GaugeMetric(
    name=LLMD_PREFIX + "std_dev_queue_size",
    help="Standard deviation of the queue size of the pool's fresh endpoints.",
    labels=("name",),
)
POOL_STD_DEV_RUNNING_REQUESTS = GaugeMetric(
    name=LLMD_PREFIX + "std_dev_running_requests",
    help="Standard deviation of the running requests of the pool's fresh endpoints.",
    labels=("name",),
)

# --- ext_proc streams (--enable-grpc-stream-metrics), under the llm-d router's names ---

EXTPROC_STREAMS_INFLIGHT = GaugeMetric(
    name=LLMD_PREFIX + "extproc_streams_inflight",
    help="Number of ext_proc gRPC streams currently open.",
)
EXTPROC_STREAM_DURATION = HistogramMetric(
    name=LLMD_PREFIX + "extproc_stream_duration_seconds",
    help="Duration an ext_proc gRPC stream stays open, in seconds.",
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0),
)
EXTPROC_STREAMS = CounterMetric(
    name=LLMD_PREFIX + "extproc_streams_total",
    help="Total ext_proc gRPC streams completed, by gRPC status code.",
    labels=("code",),
)

#: The metrics ``--enable-grpc-stream-metrics`` adds.
EXTPROC_STREAM_METRICS = frozenset(
    {EXTPROC_STREAMS_INFLIGHT, EXTPROC_STREAM_DURATION, EXTPROC_STREAMS}
)

# --- predicted latency (``predicted-latency-producer``): the reference's names, and the
# route receipts (prediction against observation, per endpoint) ---

_PREDICTION_DURATION_BUCKETS = (
    0.000001, 0.000005, 0.00001, 0.00005, 0.0001, 0.0005, 0.001, 0.005, 0.01,
)  # fmt: skip
_PREDICTION_ERROR_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0,
)  # fmt: skip
REQUEST_TTFT = HistogramMetric(
    name="inference_objective_request_ttft_seconds",
    help="Time to first token observed by the EPP (first response body chunk minus the "
    "routing decision), per model.",
    labels=_MODEL,
    buckets=_DURATION_BUCKETS,
)
REQUEST_PREDICTED_TTFT = HistogramMetric(
    name="inference_objective_request_predicted_ttft_seconds",
    help="Time to first token predicted for the chosen endpoint, per model.",
    labels=_MODEL,
    buckets=_DURATION_BUCKETS,
)
REQUEST_TTFT_PREDICTION_DURATION = HistogramMetric(
    name="inference_objective_request_ttft_prediction_duration_seconds",
    help="Time spent predicting every candidate's TTFT and TPOT for one request.",
    labels=_MODEL,
    buckets=_PREDICTION_DURATION_BUCKETS,
)
REQUEST_TPOT = HistogramMetric(
    name="inference_objective_request_tpot_seconds",
    help="Time per output token after the first observed by the EPP, per model.",
    labels=_MODEL,
    buckets=_TPOT_BUCKETS,
)
REQUEST_PREDICTED_TPOT = HistogramMetric(
    name="inference_objective_request_predicted_tpot_seconds",
    help="Time per output token predicted for the chosen endpoint, per model.",
    labels=_MODEL,
    buckets=_TPOT_BUCKETS,
)
REQUEST_TPOT_PREDICTION_DURATION = HistogramMetric(
    name="inference_objective_request_tpot_prediction_duration_seconds",
    help="Time spent predicting every candidate's TTFT and TPOT for one request.",
    labels=_MODEL,
    buckets=_PREDICTION_DURATION_BUCKETS,
)
REQUEST_SLO_VIOLATION = CounterMetric(
    name="inference_objective_request_slo_violation_total",
    help="Requests whose observed TTFT or TPOT exceeded their SLO header, by type.",
    labels=(*_MODEL, "type"),
)
#: The route receipts: |observed - predicted| per endpoint, for TTFT and TPOT.
LATENCY_PREDICTION_ERROR = HistogramMetric(
    name="inference_extension_latency_prediction_error_seconds",
    help="Absolute error of the latency predicted for the chosen endpoint against the one "
    "observed, per endpoint and kind (ttft, tpot).",
    labels=("endpoint", "kind"),
    buckets=_PREDICTION_ERROR_BUCKETS,
)
PREFIX_HIT_PREDICTION_ERROR = HistogramMetric(
    name="inference_extension_prefix_hit_prediction_error_ratio",
    help="Absolute difference between the prompt share predicted cached on the chosen "
    "endpoint and the share its server reported cached, per endpoint.",
    labels=("endpoint",),
    buckets=_RATIO_BUCKETS,
)
LATENCY_SAMPLES_REFUSED = CounterMetric(
    name="inference_extension_latency_samples_refused_total",
    help="Latency observations the predictor did not learn from, by reason (out_of_range: "
    "not within (0, 10 min]; clipped: learnt with its residual bounded).",
    labels=("reason",),
)

#: Every metric the EPP exports, in exposition order.
CATALOGUE: tuple[Metric, ...] = (
    REQUEST_TOTAL,
    REQUEST_ERROR_TOTAL,
    REQUEST_DURATION,
    REQUEST_SIZES,
    RESPONSE_SIZES,
    INPUT_TOKENS,
    OUTPUT_TOKENS,
    PROMPT_CACHED_TOKENS,
    NORMALIZED_TPOT,
    RUNNING_REQUESTS,
    POOL_AVERAGE_KV_CACHE,
    POOL_AVERAGE_QUEUE_SIZE,
    POOL_AVERAGE_RUNNING_REQUESTS,
    POOL_READY_PODS,
    POOL_PER_POD_QUEUE_SIZE,
    SCHEDULER_E2E_DURATION,
    SCHEDULER_ATTEMPTS,
    PLUGIN_DURATION,
    PREFIX_INDEXER_SIZE,
    PREFIX_INDEXER_HIT_RATIO,
    PREFIX_INDEXER_HIT_BYTES,
    KV_GATE_HELD,
    KV_GATE_WAIT,
    EXTENSION_INFO,
    MODEL_REWRITE_DECISIONS,
    FLOW_CONTROL_QUEUE_DURATION,
    FLOW_CONTROL_DISPATCH_CYCLE_DURATION,
    FLOW_CONTROL_ENQUEUE_DURATION,
    FLOW_CONTROL_QUEUE_SIZE,
    FLOW_CONTROL_QUEUE_BYTES,
    FLOW_CONTROL_POOL_SATURATION,
    SCRAPE_ERRORS,
    FLOW_CONTROL_DISPLACED,
    SHARED_STATE_ROUNDTRIP,
    SHARED_STATE_DEADLINE_MISSES,
    SHARED_STATE_ERRORS,
    SHARED_STATE_DEGRADED,
    SHARED_STATE_CLAIMS,
    SHARED_STATE_WRITES,
    SHARED_STATE_DROPPED_WRITES,
    KV_INDEX_ENTRIES,
    KV_INDEX_LOADED_BLOCKS,
    KV_INDEX_WRITER_LEASES,
    KV_INDEX_PENDING_WRITES,
    KV_EVENTS,
    KV_EVENTS_LAG,
    KV_EVENTS_GAPS,
    KV_EVENTS_ERRORS,
    KV_EVENTS_TRUSTED,
    KV_KEYS_UNKEYED,
    POOL_STD_DEV_KV_CACHE,
    POOL_STD_DEV_QUEUE_SIZE,
    POOL_STD_DEV_RUNNING_REQUESTS,
    EXTPROC_STREAMS_INFLIGHT,
    EXTPROC_STREAM_DURATION,
    EXTPROC_STREAMS,
    REQUEST_TTFT,
    REQUEST_PREDICTED_TTFT,
    REQUEST_TTFT_PREDICTION_DURATION,
    REQUEST_TPOT,
    REQUEST_PREDICTED_TPOT,
    REQUEST_TPOT_PREDICTION_DURATION,
    REQUEST_SLO_VIOLATION,
    LATENCY_PREDICTION_ERROR,
    PREFIX_HIT_PREDICTION_ERROR,
    LATENCY_SAMPLES_REFUSED,
)
