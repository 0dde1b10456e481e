"""The benchmark's SDK tracing (``tests.bench.sdk_tracing``) records what ours records.

``tests.bench.observability_overhead`` compares ``adapters.otel`` with the OpenTelemetry
SDK's spans, batch processor and OTLP exporter; the comparison is fair only if both export
the same spans for the same requests: names, kinds, the tree, attributes and error
statuses, the caller's trace continued, the same trace headers sent upstream. Checked
through the real ext_proc servicer and Director, in memory and through OTLP/gRPC to a
receiver (the latter needs the SDK's OTLP exporter, the ``bench`` extra).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import orjson
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from adapters.envoy.extproc import ExtProcServicer
from adapters.otel.tracing import OtelTracing
from adapters.prometheus.exporter import PrometheusObserver
from app.observability import EppObserver
from tests.bench.sdk_tracing import SdkTracing, otlp_exporter_available
from tests.integration.observability.otlp_receiver import OtlpReceiver, ReceivedSpan
from tests.support.extproc import (
    envoy_headers,
    replay,
    request_body,
    request_headers,
    response_body,
    response_headers,
    set_headers,
)
from tests.unit.observability.support import observed_director

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CALLER = f"00-{TRACE_ID}-b7ad6b7169203331-01"
BODY = orjson.dumps({"model": "m", "prompt": "The quick brown fox " * 16, "max_tokens": 4})
RESPONSE = orjson.dumps(
    {
        "model": "m",
        "choices": [{"text": "ok"}],
        "usage": {"prompt_tokens": 70, "completion_tokens": 4, "total_tokens": 74},
    }
)

#: A span as compared: name, kind, parent's name ("remote"/"" for a caller's/none), sorted
#: attributes, error status (its message).
Shape = tuple[str, int, str, tuple[tuple[str, object], ...], str | None]


def _requests() -> list[list[Any]]:
    """A new trace, the continuation of a caller's (with baggage), and a refused body."""

    def exchange(body: bytes, *extra: tuple[str, str], request_id: str) -> list[Any]:
        return [
            request_headers(envoy_headers(("x-request-id", request_id), *extra)),
            request_body(body, end_of_stream=True),
            response_headers([(":status", "200"), ("content-type", "application/json")]),
            response_body(RESPONSE, end_of_stream=True),
        ]

    return [
        exchange(BODY, request_id="new"),
        exchange(BODY, ("traceparent", CALLER), ("baggage", "tenant=a"), request_id="continued"),
        exchange(b"{not json", request_id="refused")[:2],
    ]


async def _drive(tracing: OtelTracing | SdkTracing) -> list[dict[str, str]]:
    """Runs the requests through the servicer and the Director; returns the trace headers
    each request had set upstream."""
    # EppObserver uses only start_span, force_flush and shutdown of its tracing
    observer = EppObserver(PrometheusObserver(), cast(OtelTracing, tracing))
    servicer = ExtProcServicer(observed_director(observer), observer)
    upstream = []
    for messages in _requests():
        headers: dict[str, str] = {}
        for reply in await replay(servicer, messages):
            kind = reply.WhichOneof("response")
            if kind in ("request_headers", "request_body"):
                for key, value in set_headers(getattr(reply, kind).response):
                    if key in ("traceparent", "tracestate", "baggage"):
                        headers[key] = value
        upstream.append(headers)
    assert tracing.force_flush()
    return upstream


def _shapes(
    spans: Sequence[Any],
    *,
    span_id: Callable[[Any], object],
    parent_id: Callable[[Any], object],
    kind: Callable[[Any], int],
    error: Callable[[Any], str | None],
) -> list[Shape]:
    names = {span_id(s): s.name for s in spans}
    shapes: list[Shape] = []
    for s in spans:
        parent = parent_id(s)
        parent_name = "" if not parent else names.get(parent, "remote")
        attributes = tuple(sorted(dict(s.attributes or {}).items()))
        shapes.append((s.name, kind(s), parent_name, attributes, error(s)))
    return sorted(shapes, key=repr)


def _readable_shapes(spans: Sequence[ReadableSpan]) -> list[Shape]:
    return _shapes(
        spans,
        span_id=lambda s: s.context.span_id,
        parent_id=lambda s: s.parent.span_id if s.parent is not None else None,
        kind=lambda s: s.kind.value,
        error=lambda s: s.status.description if not s.status.is_ok else None,
    )


def _received_shapes(spans: Sequence[ReceivedSpan]) -> list[Shape]:
    return _shapes(
        spans,
        span_id=lambda s: s.span_id,
        parent_id=lambda s: s.parent_span_id,
        kind=lambda s: s.kind,
        error=lambda s: s.status_message if s.status_code == 2 else None,
    )


def _check_upstream(upstream: list[dict[str, str]], *, sampled: bool) -> None:
    new, continued, _refused = upstream
    assert bool(int(new["traceparent"][-2:], 16) & 1) is sampled
    assert continued["traceparent"].startswith(f"00-{TRACE_ID}-")
    assert continued["baggage"] == "tenant=a"


async def test_the_sdk_records_the_same_spans_as_ours() -> None:
    env = {"OTEL_TRACES_SAMPLER_ARG": "1.0"}
    ours_exported, sdk_exported = InMemorySpanExporter(), InMemorySpanExporter()
    ours = OtelTracing(env, exporter=ours_exported)
    sdk = SdkTracing(env, exporter=sdk_exported)
    ours_upstream = await _drive(ours)
    sdk_upstream = await _drive(sdk)
    ours_spans = ours_exported.get_finished_spans()
    sdk_spans = sdk_exported.get_finished_spans()
    ours.shutdown()
    sdk.shutdown()

    shapes = _readable_shapes(ours_spans)
    assert _readable_shapes(sdk_spans) == shapes
    names = {shape[0] for shape in shapes}
    assert {"gateway.request", "gateway.scheduling.plugin", "gateway.pre_request"} <= names
    assert any(shape[4] for shape in shapes)  # the refused request's error
    continued = [
        sum(f"{s.context.trace_id:032x}" == TRACE_ID for s in spans)
        for spans in (ours_spans, sdk_spans)
    ]
    assert continued[0] == continued[1] > 0
    assert len({s.context.trace_id for s in sdk_spans}) == 3
    _check_upstream(ours_upstream, sampled=True)
    _check_upstream(sdk_upstream, sampled=True)
    assert [sorted(h) for h in sdk_upstream] == [sorted(h) for h in ours_upstream]


async def test_neither_records_an_unsampled_request_and_both_pass_the_context_on() -> None:
    env = {"OTEL_TRACES_SAMPLER_ARG": "0"}
    ours_exported, sdk_exported = InMemorySpanExporter(), InMemorySpanExporter()
    ours = OtelTracing(env, exporter=ours_exported)
    sdk = SdkTracing(env, exporter=sdk_exported)
    ours_upstream = await _drive(ours)
    sdk_upstream = await _drive(sdk)
    ours.shutdown()
    sdk.shutdown()
    # the caller's sampled trace is followed (parent-based); the new one is not recorded
    ours_names = sorted(s.name for s in ours_exported.get_finished_spans())
    assert sorted(s.name for s in sdk_exported.get_finished_spans()) == ours_names
    assert all(s.context.trace_id == int(TRACE_ID, 16) for s in sdk_exported.get_finished_spans())
    _check_upstream(ours_upstream, sampled=False)
    _check_upstream(sdk_upstream, sampled=False)


@pytest.mark.skipif(not otlp_exporter_available(), reason="the bench extra is not installed")
async def test_over_otlp_the_receiver_gets_the_same_spans_from_both() -> None:
    received: list[list[ReceivedSpan]] = []
    for make in (OtelTracing, SdkTracing):
        receiver = OtlpReceiver().start()
        try:
            env = {
                "OTEL_TRACES_EXPORTER": "otlp",
                "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
                "OTEL_TRACES_SAMPLER_ARG": "1.0",
            }
            tracing = make(env)
            await _drive(tracing)
            tracing.shutdown()
            received.append(receiver.spans())
        finally:
            receiver.stop()
    ours, sdk = received
    assert ours
    assert _received_shapes(sdk) == _received_shapes(ours)
    assert {s.service_name for s in sdk} == {s.service_name for s in ours}
    assert sum(s.kind == 2 for s in sdk) == sum(s.kind == 2 for s in ours) == 3
