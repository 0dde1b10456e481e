"""Traces and request ids end to end: a client's ``traceparent`` through Envoy and the EPP
(exporting OTLP to a receiver in this test) to the model server; JSON logs per request."""

from __future__ import annotations

import json
from collections.abc import Iterator

import orjson
import pytest
import urllib3

from tests.integration.observability.otlp_receiver import OtlpReceiver, ReceivedSpan
from tests.simulator import DEFAULT_MODEL, REQUEST_ID_HEADER
from tests.support.stack import Stack, StackOptions

pytestmark = pytest.mark.e2e

CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"
SERVER_KIND = 2  # opentelemetry.proto.trace.v1.Span.SPAN_KIND_SERVER
TRACEPARENT_SEEN_HEADER = "x-simulator-traceparent"


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    running = OtlpReceiver().start()
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def stack(receiver: OtlpReceiver) -> Iterator[Stack]:
    options = StackOptions(
        simulators=2,
        epp_args=["--log-format", "json", "-v", "4"],
        epp_env={
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
            "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
            "OTEL_TRACES_SAMPLER_ARG": "1.0",
            "OTEL_BSP_SCHEDULE_DELAY": "50",
        },
    )
    with Stack.run(options) as running:
        yield running


def _post(
    stack: Stack, headers: dict[str, str], prompt: str = "Trace me"
) -> urllib3.BaseHTTPResponse:
    body = orjson.dumps({"model": DEFAULT_MODEL, "prompt": prompt, "max_tokens": 3})
    response = urllib3.request(
        "POST",
        f"{stack.url}/v1/completions",
        body=body,
        headers={"content-type": "application/json", **headers},
        timeout=30,
    )
    assert response.status == 200, response.data
    return response


def _by_name(spans: list[ReceivedSpan], trace_id: str) -> dict[str, list[ReceivedSpan]]:
    named: dict[str, list[ReceivedSpan]] = {}
    for span in spans:
        if span.trace_id == trace_id:
            named.setdefault(span.name, []).append(span)
    return named


def test_the_epp_continues_the_clients_trace_and_propagates_it_upstream(
    stack: Stack, receiver: OtlpReceiver
) -> None:
    traceparent = f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"
    response = _post(stack, {"traceparent": traceparent})

    def complete(spans: list[ReceivedSpan]) -> bool:
        names = _by_name(spans, CLIENT_TRACE_ID)
        return {"gateway.request", "gateway.scheduling.plugin"} <= set(names)

    spans = receiver.wait_for(complete, timeout=30, what="the request's spans")
    named = _by_name(spans, CLIENT_TRACE_ID)
    (gateway,) = named["gateway.request"]
    (orchestration,) = named["gateway.request_orchestration"]
    (scheduling,) = named["gateway.scheduling"]
    (profile,) = named["gateway.scheduling.profile"]
    assert gateway.parent_span_id == CLIENT_SPAN_ID
    assert gateway.kind == SERVER_KIND
    assert gateway.service_name == "gateway-api-inference-extension/epp"
    assert orchestration.parent_span_id == gateway.span_id
    assert orchestration.attributes == {"target_model": DEFAULT_MODEL, "request_prio": 0}
    assert scheduling.parent_span_id == orchestration.span_id
    assert profile.parent_span_id == scheduling.span_id
    assert profile.attributes["profile"] == "default"
    plugins = named["gateway.scheduling.plugin"]
    assert {p.parent_span_id for p in plugins} == {profile.span_id}
    assert {p.attributes["extension_point"] for p in plugins} == {"Filter", "Scorer", "Picker"}
    assert all(profile.start_ns <= p.start_ns <= p.end_ns <= profile.end_ns for p in plugins)
    producers = named["gateway.prepare_data"]
    assert {p.parent_span_id for p in producers} == {orchestration.span_id}

    # The model server received the EPP's context: same trace, the orchestration span.
    seen = response.headers[TRACEPARENT_SEEN_HEADER]
    assert seen == f"00-{CLIENT_TRACE_ID}-{orchestration.span_id}-01"


def test_a_request_without_a_traceparent_starts_a_trace_the_model_server_joins(
    stack: Stack, receiver: OtlpReceiver
) -> None:
    response = _post(stack, {})
    _, trace_id, parent_id, flags = response.headers[TRACEPARENT_SEEN_HEADER].split("-")
    assert int(flags, 16) & 1  # sampled at ratio 1.0

    def arrived(spans: list[ReceivedSpan]) -> bool:
        # the stream's span ends after the response, so it may come in a later export
        names = _by_name(spans, trace_id)
        return "gateway.request_orchestration" in names and "gateway.request" in names

    named = _by_name(receiver.wait_for(arrived, timeout=30, what="a new trace"), trace_id)
    (gateway,) = named["gateway.request"]
    assert gateway.parent_span_id == ""
    assert named["gateway.request_orchestration"][0].span_id == parent_id


def test_every_log_line_of_a_request_carries_its_request_id(stack: Stack) -> None:
    ids = [_post(stack, {}, prompt=f"log {i}").headers[REQUEST_ID_HEADER] for i in range(3)]
    assert len(set(ids)) == 3
    assert stack.epp is not None

    def lines() -> list[dict[str, object]]:
        assert stack.epp is not None
        out = []
        for line in stack.epp.log().splitlines():
            if line.startswith("{"):
                out.append(json.loads(line))
        return out

    for request_id in ids:
        mine = [line for line in lines() if line.get("request_id") == request_id]
        assert any(line["level"] == "debug" for line in mine), request_id
        # a line that names the request belongs to it
        assert all(
            line.get("request_id") == request_id
            for line in lines()
            if request_id in str(line.get("msg", ""))
        )
