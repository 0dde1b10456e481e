"""OpenTelemetry tracing from the ``OTEL_*`` environment, as the reference configures it."""

from __future__ import annotations

import io
import json
import logging
import threading
from collections.abc import Sequence

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from adapters.otel.export import ConsoleSink, OtlpEncoder, OtlpGrpcSink
from adapters.otel.spans import RecordingSpan
from adapters.otel.tracing import OtelTracing, TracingConfigError, sampler_from
from adapters.prometheus.exporter import PrometheusObserver
from app.logsetup import JsonFormatter
from app.observability import EppObserver, build_tracing
from app.settings import Settings
from ports import metric_catalogue as catalogue
from ports.observer import NoopSpan

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
SAMPLED = {"traceparent": f"00-{TRACE_ID}-b7ad6b7169203331-01", "baggage": "tenant=a"}
NOT_SAMPLED = {"traceparent": f"00-{TRACE_ID}-b7ad6b7169203331-00"}
ALWAYS = {"OTEL_TRACES_SAMPLER_ARG": "1.0"}


def _tracing(env: dict[str, str]) -> tuple[OtelTracing, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    return OtelTracing(env, exporter=exporter), exporter


def _finished(tracing: OtelTracing, exporter: InMemorySpanExporter) -> dict[str, ReadableSpan]:
    assert tracing.force_flush()
    return {s.name: s for s in exporter.get_finished_spans()}


@pytest.mark.parametrize(
    ("env", "description"),
    [
        ({}, "ParentBased{root:TraceIdRatioBased{0.1}"),
        ({"OTEL_TRACES_SAMPLER_ARG": "0.5"}, "ParentBased{root:TraceIdRatioBased{0.5}"),
        ({"OTEL_TRACES_SAMPLER_ARG": "lots"}, "ParentBased{root:TraceIdRatioBased{0.1}"),
        ({"OTEL_TRACES_SAMPLER_ARG": "7"}, "ParentBased{root:TraceIdRatioBased{0.1}"),
        ({"OTEL_TRACES_SAMPLER": "always_on"}, "AlwaysOnSampler"),
        ({"OTEL_TRACES_SAMPLER": "always_off"}, "AlwaysOffSampler"),
        ({"OTEL_TRACES_SAMPLER": "parentbased_always_on"}, "ParentBased{root:AlwaysOnSampler"),
        (
            {"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.25"},
            "TraceIdRatioBased{0.25}",
        ),
        ({"OTEL_TRACES_SAMPLER": "bogus"}, "ParentBased{root:TraceIdRatioBased{0.1}"),
    ],
)
def test_the_sampler_comes_from_the_environment(env: dict[str, str], description: str) -> None:
    assert sampler_from(env).get_description().startswith(description)


def test_the_exporter_comes_from_the_environment() -> None:
    # unset: nothing on the pod's log; OTLP as soon as an endpoint is named
    assert OtelTracing({}).sink is None
    assert isinstance(OtelTracing({"OTEL_TRACES_EXPORTER": "console"}).sink, ConsoleSink)
    implied = OtelTracing({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:2"})
    assert isinstance(implied.sink, OtlpGrpcSink)
    assert implied.sink.target == "127.0.0.1:2"
    assert OtelTracing({"OTEL_TRACES_EXPORTER": "none"}).sink is None
    otlp = OtelTracing(
        {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1"}
    )
    assert isinstance(otlp.sink, OtlpGrpcSink)
    assert otlp.sink.target == "127.0.0.1:1"
    assert otlp.describe()["exporter"] == "otlp grpc to 127.0.0.1:1"
    otlp.shutdown()


@pytest.mark.parametrize(
    ("endpoint", "target"),
    [
        ("http://collector:4317", "collector:4317"),
        ("https://collector", "collector:4317"),
        ("http://[::1]:4317", "[::1]:4317"),
        ("collector:4317", "collector:4317"),
    ],
)
def test_the_otlp_endpoint_names_the_grpc_target(endpoint: str, target: str) -> None:
    tracing = OtelTracing(
        {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": endpoint}
    )
    assert isinstance(tracing.sink, OtlpGrpcSink)
    assert tracing.sink.target == target
    tracing.shutdown()


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "ftp://collector"}, "OTEL_EXPORTER_OTLP_ENDPOINT"),
        (
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": "https://collector:4317",
                "OTEL_EXPORTER_OTLP_CERTIFICATE": "/nonexistent/ca.pem",
            },
            "OTEL_EXPORTER_OTLP_CERTIFICATE",
        ),
        (
            {
                "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "collector:4318",
            },
            "OTEL_EXPORTER_OTLP_ENDPOINT",
        ),
        (
            {
                "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
                "OTEL_EXPORTER_OTLP_ENDPOINT": "https://collector:4318",
                "OTEL_EXPORTER_OTLP_CERTIFICATE": "/nonexistent/ca.pem",
            },
            "OTEL_EXPORTER_OTLP_CERTIFICATE",
        ),
    ],
)
def test_an_unusable_otlp_setting_is_an_error_naming_it(env: dict[str, str], named: str) -> None:
    with pytest.raises(TracingConfigError, match=named):
        OtelTracing({"OTEL_TRACES_EXPORTER": "otlp", **env})


def test_the_service_name_defaults_to_the_references() -> None:
    default, _ = _tracing({})
    named, _ = _tracing({"OTEL_SERVICE_NAME": "my-epp"})
    assert default.resource.attributes["service.name"] == "gateway-api-inference-extension/epp"
    assert named.resource.attributes["service.name"] == "my-epp"


def test_a_span_from_request_headers_continues_the_callers_trace() -> None:
    tracing, exporter = _tracing({})  # parent-based: the caller sampled it
    root = tracing.start_span("gateway.request", carrier=SAMPLED)
    child = tracing.start_span("gateway.request_orchestration", parent=root)
    child.set_attribute("target_model", "m")
    child.set_attribute("request_prio", 2)
    carrier: dict[str, str] = {}
    child.inject(carrier)
    child.end()
    root.end()
    spans = _finished(tracing, exporter)
    server, internal = spans["gateway.request"], spans["gateway.request_orchestration"]
    assert server.kind is SpanKind.SERVER
    assert internal.kind is SpanKind.INTERNAL
    assert f"{server.context.trace_id:032x}" == TRACE_ID
    assert server.parent is not None
    assert f"{server.parent.span_id:016x}" == "b7ad6b7169203331"
    assert internal.parent is not None
    assert internal.parent.span_id == server.context.span_id
    assert dict(internal.attributes or {}) == {"target_model": "m", "request_prio": 2}
    assert carrier["traceparent"] == f"00-{TRACE_ID}-{internal.context.span_id:016x}-01"
    assert carrier["baggage"] == "tenant=a"
    assert server.resource.attributes["service.name"] == "gateway-api-inference-extension/epp"


def test_an_error_sets_the_span_status() -> None:
    tracing, exporter = _tracing(ALWAYS)
    span = tracing.start_span("gateway.request")
    span.record_error("BadRequest: no model")
    span.end()
    span.end()  # idempotent
    (finished,) = _finished(tracing, exporter).values()
    assert finished.status.status_code is StatusCode.ERROR
    assert finished.status.description == "BadRequest: no model"


def test_an_unsampled_trace_records_nothing_but_still_propagates() -> None:
    tracing, exporter = _tracing({})
    root = tracing.start_span("gateway.request", carrier=NOT_SAMPLED)
    child = tracing.start_span("gateway.request_orchestration", parent=root)
    assert child is root  # no new span below an unsampled one
    child.set_attribute("target_model", "m")
    carrier: dict[str, str] = {}
    child.inject(carrier)
    child.end()
    root.end()
    assert _finished(tracing, exporter) == {}
    version, trace_id, _, flags = carrier["traceparent"].split("-")
    assert (version, trace_id, flags) == ("00", TRACE_ID, "00")


def test_roots_are_sampled_at_the_configured_ratio() -> None:
    never, never_exporter = _tracing({"OTEL_TRACES_SAMPLER_ARG": "0"})
    always, always_exporter = _tracing(ALWAYS)
    for _ in range(20):
        never.start_span("gateway.request").end()
        always.start_span("gateway.request").end()
    assert never.force_flush()
    assert always.force_flush()
    assert len(never_exporter.get_finished_spans()) == 0
    assert len(always_exporter.get_finished_spans()) == 20


def test_the_console_exporter_logs_one_json_line_per_span(
    caplog: pytest.LogCaptureFixture,
) -> None:
    tracing = OtelTracing({**ALWAYS, "OTEL_TRACES_EXPORTER": "console"})
    with caplog.at_level(logging.INFO, logger="epp.traces"):
        tracing.start_span("gateway.request").end()
        tracing.shutdown()
    (record,) = [r for r in caplog.records if r.name == "epp.traces"]
    assert "\n" not in record.getMessage()
    assert json.loads(record.getMessage())["name"] == "gateway.request"


class _Slow(SpanExporter):
    def __init__(self) -> None:
        self.exported: list[str] = []

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.exported.extend(s.name for s in spans)
        return SpanExportResult.SUCCESS


def test_shutdown_flushes_pending_spans() -> None:
    exporter = _Slow()
    tracing = OtelTracing(ALWAYS, exporter=exporter)
    for i in range(5):
        tracing.start_span(f"s{i}").end()
    tracing.shutdown()
    tracing.shutdown()  # idempotent
    assert exporter.exported == [f"s{i}" for i in range(5)]


def test_the_process_observer_sends_metrics_to_prometheus_and_spans_to_tracing() -> None:
    metrics = PrometheusObserver()
    tracing, exporter = _tracing(ALWAYS)
    observer = EppObserver(metrics, tracing)
    observer.counter(catalogue.SCRAPE_ERRORS, {"endpoint": "e"})
    observer.start_span("gateway.request").end()
    assert b'inference_extension_scrape_errors_total{endpoint="e"} 1.0' in metrics.exposition()
    assert list(_finished(tracing, exporter)) == ["gateway.request"]
    untraced = EppObserver(metrics, None)
    assert isinstance(untraced.start_span("gateway.request", carrier=SAMPLED), NoopSpan)


def test_tracing_follows_the_flag() -> None:
    base = {"static_endpoints": "127.0.0.1:8000", "metrics_endpoint_auth": False}
    assert build_tracing(Settings(**base, tracing=False)) is None  # type: ignore[arg-type]
    tracing = build_tracing(
        Settings(**base),  # type: ignore[arg-type]
        {"OTEL_TRACES_EXPORTER": "none"},
    )
    assert isinstance(tracing, OtelTracing)
    tracing.shutdown()


# The default sampler decides before the SDK: an unsampled request costs no SDK span.


def test_an_unsampled_new_trace_still_propagates_a_traceparent() -> None:
    tracing, exporter = _tracing({"OTEL_TRACES_SAMPLER_ARG": "0"})
    span = tracing.start_span("gateway.request", carrier={})
    child = tracing.start_span("gateway.request_orchestration", parent=span)
    headers: dict[str, str] = {}
    child.inject(headers)
    child.end()
    span.end()
    version, trace_id, span_id, flags = headers["traceparent"].split("-")
    assert (version, flags) == ("00", "00")
    assert len(trace_id) == 32 and len(span_id) == 16  # noqa: PT018
    assert int(trace_id, 16) != 0
    assert _finished(tracing, exporter) == {}


def test_a_caller_sampled_trace_is_recorded_even_at_ratio_0() -> None:
    tracing, exporter = _tracing({"OTEL_TRACES_SAMPLER_ARG": "0"})
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    span = tracing.start_span("gateway.request", carrier={"traceparent": parent})
    span.end()
    finished = _finished(tracing, exporter)
    assert list(finished) == ["gateway.request"]
    context = finished["gateway.request"].context
    assert context is not None
    assert f"{context.trace_id:032x}" == "0af7651916cd43dd8448eb211c80319c"


def test_a_caller_unsampled_trace_is_passed_on_unchanged_at_ratio_1() -> None:
    tracing, exporter = _tracing({"OTEL_TRACES_SAMPLER_ARG": "1"})
    carrier = {
        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00",
        "tracestate": "vendor=1",
        "x-other": "not a trace header",
    }
    span = tracing.start_span("gateway.request", carrier=carrier)
    headers: dict[str, str] = {}
    span.inject(headers)
    span.end()
    assert headers == {k: carrier[k] for k in ("traceparent", "tracestate")}
    assert _finished(tracing, exporter) == {}


def test_new_traces_are_sampled_at_the_configured_ratio() -> None:
    tracing, exporter = _tracing({"OTEL_TRACES_SAMPLER_ARG": "0.3"})
    for _ in range(2000):
        tracing.start_span("gateway.request").end()
    recorded = len(exporter.get_finished_spans()) if tracing.force_flush() else -1
    assert 480 <= recorded <= 720


@pytest.mark.parametrize(
    ("sampler", "new_trace", "caller_sampled", "caller_unsampled"),
    [
        ("always_on", True, True, True),
        ("always_off", False, False, False),
        ("parentbased_always_on", True, True, False),
        ("parentbased_always_off", False, True, False),
    ],
)
def test_every_sampler_decides_as_the_sdks(
    sampler: str, new_trace: bool, caller_sampled: bool, caller_unsampled: bool
) -> None:
    tracing, exporter = _tracing({"OTEL_TRACES_SAMPLER": sampler})
    tracing.start_span("new").end()
    tracing.start_span("sampled", carrier=SAMPLED).end()
    tracing.start_span("unsampled", carrier=NOT_SAMPLED).end()
    recorded = set(_finished(tracing, exporter))
    assert recorded == {
        name
        for name, kept in [
            ("new", new_trace),
            ("sampled", caller_sampled),
            ("unsampled", caller_unsampled),
        ]
        if kept
    }


def test_traceidratio_decides_on_the_trace_id_whatever_the_caller_says() -> None:
    tracing, exporter = _tracing(
        {"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.5"}
    )
    low = "00-0af7651916cd43dd0000000000000001-b7ad6b7169203331-00"  # low 64 bits tiny
    high = "00-0af7651916cd43ddffffffffffffffff-b7ad6b7169203331-01"
    tracing.start_span("low", carrier={"traceparent": low}).end()
    dropped = tracing.start_span("high", carrier={"traceparent": high, "tracestate": "v=1"})
    headers: dict[str, str] = {}
    dropped.inject(headers)
    dropped.end()
    assert list(_finished(tracing, exporter)) == ["low"]
    _version, trace_id, span_id, flags = headers["traceparent"].split("-")
    assert (trace_id, flags) == ("0af7651916cd43ddffffffffffffffff", "00")
    assert span_id != "b7ad6b7169203331"  # a span of ours, not the caller's
    assert headers["tracestate"] == "v=1"


@pytest.mark.parametrize(
    "traceparent",
    [
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331",  # no flags
        "00-00000000000000000000000000000000-b7ad6b7169203331-01",  # zero trace id
        "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",  # zero span id
        "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",  # forbidden version
        "00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01",  # upper case
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-extra",  # v00 with more
    ],
)
def test_an_invalid_traceparent_starts_a_new_trace(traceparent: str) -> None:
    tracing, exporter = _tracing(ALWAYS)
    tracing.start_span("gateway.request", carrier={"traceparent": traceparent}).end()
    (span,) = _finished(tracing, exporter).values()
    assert span.parent is None
    assert f"{span.context.trace_id:032x}" not in traceparent


def test_a_later_version_traceparent_is_followed() -> None:
    tracing, exporter = _tracing({"OTEL_TRACES_SAMPLER_ARG": "0"})
    parent = f"01-{TRACE_ID}-b7ad6b7169203331-01-future"
    tracing.start_span("gateway.request", carrier={"traceparent": parent}).end()
    (span,) = _finished(tracing, exporter).values()
    assert f"{span.context.trace_id:032x}" == TRACE_ID


class _Blocking(SpanExporter):
    """Holds the export thread in its first export until released."""

    def __init__(self) -> None:
        self.exported: list[str] = []
        self.exporting = threading.Event()
        self.release = threading.Event()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.exporting.set()
        assert self.release.wait(10)
        self.exported.extend(s.name for s in spans)
        return SpanExportResult.SUCCESS


def test_a_full_queue_drops_new_spans_counts_them_and_says_so_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    exporter = _Blocking()
    env = {**ALWAYS, "OTEL_BSP_MAX_QUEUE_SIZE": "2", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "1"}
    tracing = OtelTracing(env, exporter=exporter)
    tracing.start_span("first").end()  # a full batch: the thread takes it and blocks
    assert exporter.exporting.wait(10)
    for i in range(5):
        tracing.start_span(f"later{i}").end()
    with caplog.at_level(logging.WARNING, logger="adapters.otel.export"):
        exporter.release.set()
        tracing.shutdown()
    assert exporter.exported == ["first", "later0", "later1"]
    (warning,) = [r for r in caplog.records if "dropped" in r.getMessage()]
    assert "3 spans dropped" in warning.getMessage()  # two fit behind the blocked export


def test_fragments_encoded_apart_make_one_otlp_request() -> None:
    spans: list[RecordingSpan] = []
    tracing = OtelTracing(ALWAYS, sink=_Collecting(spans))
    root = tracing.start_span("root", carrier=SAMPLED)
    for name in ("a", "b"):
        child = tracing.start_span(name, parent=root, attributes={"n": len(name), "s": name})
        child.end()
    root.end()
    assert tracing.force_flush()
    encoder = OtlpEncoder(tracing.resource, InstrumentationScope(name="epp"))
    request = ExportTraceServiceRequest.FromString(
        encoder.request([encoder.fragment(spans[:1]), encoder.fragment(spans[1:])])
    )
    (resource_spans,) = request.resource_spans
    assert {kv.key for kv in resource_spans.resource.attributes} >= {"service.name"}
    (scope_spans,) = resource_spans.scope_spans
    assert scope_spans.scope.name == "epp"
    assert [s.name for s in scope_spans.spans] == ["a", "b", "root"]
    a = scope_spans.spans[0]
    assert a.parent_span_id == scope_spans.spans[2].span_id
    assert {kv.key: kv.value.string_value or kv.value.int_value for kv in a.attributes} == {
        "n": 1,
        "s": "a",
    }
    assert scope_spans.spans[2].trace_state == ""  # the caller sent none


class _Collecting:
    def __init__(self, into: list[RecordingSpan]) -> None:
        self.into = into

    def export(self, spans: Sequence[RecordingSpan]) -> bool:
        self.into.extend(spans)
        return True

    def shutdown(self) -> None:
        return None


def test_a_span_that_cannot_be_encoded_is_dropped_without_failing_the_caller(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sink = _EncodeAndKeep()
    tracing = OtelTracing({**ALWAYS, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "1"}, sink=sink)
    with caplog.at_level(logging.ERROR, logger="adapters.otel.export"):
        span = tracing.start_span("gateway.request")
        span.set_attribute("target_model", "\ud800")  # a lone surrogate: not UTF-8
        span.end()  # encoded on the spot (a chunk of one): must not raise
        tracing.start_span("fine").end()
        assert tracing.force_flush()
    assert sink.names == ["fine"]
    assert [r.getMessage() for r in caplog.records] == ["spans that cannot be encoded were dropped"]
    tracing.shutdown()


class _EncodeAndKeep:
    def __init__(self) -> None:
        self.encoder = OtlpEncoder(Resource.create({}), InstrumentationScope(name="t"))
        self.names: list[str] = []

    def encode(self, spans: Sequence[RecordingSpan]) -> bytes:
        return self.encoder.fragment(spans)

    def export_encoded(self, fragments: Sequence[bytes], count: int) -> bool:
        request = ExportTraceServiceRequest.FromString(self.encoder.request(fragments))
        self.names += [s.name for s in request.resource_spans[0].scope_spans[0].spans]
        return True

    def shutdown(self) -> None:
        return None


def test_in_json_logs_a_console_span_is_an_object_of_its_own() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    traces = logging.getLogger("epp.traces")
    traces.addHandler(handler)
    level = traces.level
    traces.setLevel(logging.INFO)
    try:
        tracing = OtelTracing({**ALWAYS, "OTEL_TRACES_EXPORTER": "console"})
        span = tracing.start_span("gateway.request", carrier=SAMPLED)
        span.set_attribute("target_model", "m")
        span.end()
        tracing.shutdown()
    finally:
        traces.removeHandler(handler)
        traces.setLevel(level)
    (line,) = stream.getvalue().splitlines()
    entry = json.loads(line)
    assert entry["logger"] == "epp.traces"
    assert entry["span"]["name"] == "gateway.request"
    assert entry["span"]["context"]["trace_id"] == f"0x{TRACE_ID}"
    assert entry["span"]["attributes"] == {"target_model": "m"}
    assert entry["msg"] == "span gateway.request"
