"""What the Director, the scheduler and the prefix producer report per request."""

from __future__ import annotations

import asyncio
import time

import orjson
import pytest

from domain.datastore.objectives import ObjectiveStore
from domain.datastore.store import Datastore
from domain.flowcontrol import FlowControlConfig, FlowController
from domain.requestcontrol.admission import FlowControlAdmission
from domain.requestcontrol.director import Director
from ports import metric_catalogue as catalogue
from ports.objectives import ModelRewriteRule, ModelRewriteTarget
from tests.fakes.observer import RecordingObserver
from tests.unit.observability.support import inbound, observed_director

PROMPT = "The quick brown fox jumps over the lazy dog. " * 8


def _body(model: str = "m", prompt: str = PROMPT) -> bytes:
    return orjson.dumps({"model": model, "prompt": prompt, "max_tokens": 4})


def _usage_body(prompt_tokens: int, completion_tokens: int, cached: int = 0) -> bytes:
    return orjson.dumps(
        {
            "model": "m",
            "choices": [{"text": "hi"}],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached},
            },
        }
    )


async def _complete(
    director: Director, body: bytes, *, status: int = 200, response: bytes | None = None
) -> None:
    exchange = director.open(inbound(body))
    decision = await exchange.route()
    assert decision.error is None, decision.error
    await exchange.response_headers(
        {":status": str(status), "content-type": "application/json"}, {}
    )
    await exchange.response_body(response or _usage_body(100, 4, cached=32), True)
    await exchange.close()


async def test_a_routed_request_counts_by_model_target_and_priority() -> None:
    observer = RecordingObserver()
    director = observed_director(observer)
    body = _body()
    await _complete(director, body)
    labels = {"model_name": "m", "target_model_name": "m"}
    assert observer.total(catalogue.REQUEST_TOTAL, priority="0", **labels) == 1
    assert observer.observations(catalogue.REQUEST_SIZES, **labels) == [len(body)]


async def test_running_requests_rise_on_routing_and_fall_on_close() -> None:
    observer = RecordingObserver()
    director = observed_director(observer)
    first = director.open(inbound(_body(), request_id="a"))
    second = director.open(inbound(_body(), request_id="b"))
    await first.route()
    await second.route()
    gauge = catalogue.RUNNING_REQUESTS
    assert observer.gauge_value(gauge, model_name="m") == 2
    await first.close()
    assert observer.gauge_value(gauge, model_name="m") == 1
    await first.close()  # idempotent: counted once
    await second.close()
    assert observer.gauge_value(gauge, model_name="m") == 0
    assert director.running("m") == 0


async def test_a_completed_response_records_duration_size_tokens_and_tpot() -> None:
    observer = RecordingObserver()
    director = observed_director(observer)
    response = _usage_body(100, 4, cached=32)
    await _complete(director, _body(), response=response)
    labels = {"model_name": "m", "target_model_name": "m"}
    (duration,) = observer.observations(catalogue.REQUEST_DURATION, **labels)
    assert duration >= 0
    assert observer.observations(catalogue.RESPONSE_SIZES, **labels) == [len(response)]
    assert observer.observations(catalogue.INPUT_TOKENS, **labels) == [100]
    assert observer.observations(catalogue.OUTPUT_TOKENS, **labels) == [4]
    assert observer.observations(catalogue.PROMPT_CACHED_TOKENS, **labels) == [32]
    (tpot,) = observer.observations(catalogue.NORMALIZED_TPOT, **labels)
    assert tpot == pytest.approx(duration / 4)


async def test_a_streamed_response_counts_every_chunk_and_the_final_usage() -> None:
    observer = RecordingObserver()
    director = observed_director(observer)
    exchange = director.open(inbound(_body()))
    await exchange.route()
    await exchange.response_headers({":status": "200", "content-type": "text/event-stream"}, {})
    chunks = [
        b'data: {"choices":[{"text":"a"}]}\n\n',
        b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":2}}\n\n',
        b"data: [DONE]\n\n",
    ]
    for i, chunk in enumerate(chunks):
        await exchange.response_body(chunk, i == len(chunks) - 1)
    await exchange.close()
    assert observer.observations(catalogue.RESPONSE_SIZES) == [sum(len(c) for c in chunks)]
    assert observer.observations(catalogue.OUTPUT_TOKENS) == [2]


async def test_a_model_server_error_counts_as_model_server_error() -> None:
    observer = RecordingObserver()
    director = observed_director(observer)
    await _complete(director, _body(), status=503, response=b'{"error": "overloaded"}')
    assert (
        observer.total(
            catalogue.REQUEST_ERROR_TOTAL,
            model_name="m",
            target_model_name="m",
            error_code="ModelServerError",
        )
        == 1
    )
    assert observer.observations(catalogue.REQUEST_DURATION) == []


async def test_refused_requests_count_errors_by_code() -> None:
    observer = RecordingObserver()
    director = observed_director(observer)
    decision = await director.open(inbound(b"{not json")).route()
    assert decision.error is not None
    errors = catalogue.REQUEST_ERROR_TOTAL
    assert observer.total(errors, error_code="BadRequest", model_name="") == 1

    no_endpoints = Datastore()
    no_endpoints.mark_synced()
    empty = observed_director(observer, no_endpoints)
    decision = await empty.open(inbound(_body(model="x"))).route()
    assert decision.error is not None
    assert observer.total(errors, error_code=decision.error.code.value, model_name="x") == 1
    assert observer.total(catalogue.REQUEST_TOTAL) == 0
    assert observer.gauge_value(catalogue.RUNNING_REQUESTS) is None


async def test_a_model_rewrite_counts_the_rule_and_labels_the_target() -> None:
    objectives = ObjectiveStore()
    objectives.set_rules(
        [
            ModelRewriteRule(
                name="canary", match="public", targets=(ModelRewriteTarget(model="v2", weight=1),)
            )
        ]
    )
    observer = RecordingObserver()
    director = observed_director(observer, objectives=objectives)
    await _complete(director, _body(model="public"))
    assert (
        observer.total(
            catalogue.MODEL_REWRITE_DECISIONS,
            model_rewrite_name="canary",
            model_name="public",
            target_model="v2",
        )
        == 1
    )
    assert observer.total(catalogue.REQUEST_TOTAL, model_name="public", target_model_name="v2") == 1


async def test_scheduling_reports_plugin_durations_e2e_and_the_chosen_pod() -> None:
    observer = RecordingObserver()
    director = observed_director(observer)
    exchange = director.open(inbound(_body()))
    decision = await exchange.route()
    chosen = decision.endpoints[0]
    assert exchange.target is not None
    (e2e,) = observer.observations(catalogue.SCHEDULER_E2E_DURATION)
    assert 0 <= e2e < 1
    attempts = [r for r in observer.counters if r.metric is catalogue.SCHEDULER_ATTEMPTS]
    assert [r.labels for r in attempts] == [
        {
            "status": "success",
            "target_model_name": "m",
            "pod_name": exchange.target.pod_name,
            "namespace": "ns",
            "port": str(chosen.port),
        }
    ]
    points = {
        (r.labels["extension_point"], r.labels["plugin_type"])
        for r in observer.histograms
        if r.metric is catalogue.PLUGIN_DURATION
    }
    # the default config: the affinity filter, the token-load scorer, the max-score picker,
    # the single profile handler
    assert {
        ("Filter", "prefix-cache-affinity-filter"),
        ("Scorer", "token-load-scorer"),
        ("Picker", "max-score-picker"),
        ("ProfilePicker", "single-profile-handler"),
        ("ProcessProfilesResults", "single-profile-handler"),
    } <= points


async def test_a_failed_scheduling_attempt_counts_as_failure() -> None:
    observer = RecordingObserver()
    config = """
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: header-based-testing-filter
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: header-based-testing-filter
  - pluginRef: max-score-picker
"""
    director = observed_director(observer, config_text=config)
    decision = await director.open(
        inbound(_body(), headers={"test-epp-endpoint-selection": "10.9.9.9:1"})
    ).route()
    assert decision.error is not None
    assert observer.total(catalogue.SCHEDULER_ATTEMPTS, status="failure", pod_name="") == 1


async def test_the_prefix_producer_reports_hit_ratio_and_bytes() -> None:
    observer = RecordingObserver()
    director = observed_director(observer)
    await _complete(director, _body())
    await _complete(director, _body())  # same prompt: now indexed for the chosen endpoint
    ratios = observer.observations(catalogue.PREFIX_INDEXER_HIT_RATIO)
    hit_bytes = observer.observations(catalogue.PREFIX_INDEXER_HIT_BYTES)
    assert ratios == [0.0, 1.0]
    assert hit_bytes[0] == 0
    assert hit_bytes[1] >= 64


async def test_routing_is_a_span_tree_under_the_gateway_span_and_goes_upstream() -> None:
    observer = RecordingObserver()
    director = observed_director(observer)
    gateway = observer.start_span(
        "gateway.request",
        carrier={"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
    )
    exchange = director.open(inbound(_body(), span=gateway))
    decision = await exchange.route()
    (orchestration,) = observer.spans_named("gateway.request_orchestration")
    assert orchestration.parent is gateway
    assert orchestration.attributes == {"target_model": "m", "request_prio": 0}
    assert orchestration.ended
    for name in ("gateway.scheduling", "gateway.prepare_data", "gateway.pre_request"):
        spans = observer.spans_named(name)
        assert spans, name
        assert all(orchestration in s.ancestors() and s.ended for s in spans), name
    (profile,) = observer.spans_named("gateway.scheduling.profile")
    assert profile.parent is observer.spans_named("gateway.scheduling")[0]
    assert profile.attributes["profile"] == "default"
    assert exchange.target is not None
    assert profile.attributes["picked"] == exchange.target.name
    plugins = observer.spans_named("gateway.scheduling.plugin")
    assert {s.parent for s in plugins} == {profile}
    assert all(s.ended for s in plugins)
    assert [s.attributes["extension_point"] for s in plugins][-1] == "Picker"
    assert {(s.attributes["extension_point"], s.attributes["plugin.type"]) for s in plugins} >= {
        ("Filter", "prefix-cache-affinity-filter"),
        ("Scorer", "token-load-scorer"),
        ("Picker", "max-score-picker"),
    }
    assert observer.spans_named("gateway.flow_control") == []  # legacy admission: no wait
    headers = dict(decision.headers)
    assert headers["traceparent"] == (
        f"00-0af7651916cd43dd8448eb211c80319c-{orchestration.span_id}-01"
    )


async def test_the_wait_in_flow_control_is_a_span() -> None:
    observer = RecordingObserver()
    pool = {"saturation": 0.0}
    controller = FlowController(FlowControlConfig(), saturation=lambda: pool["saturation"])
    controller.start()
    director = observed_director(
        observer, admission=FlowControlAdmission(controller, observer=observer)
    )
    gateway = observer.start_span("gateway.request")
    await director.open(inbound(_body(), span=gateway)).route()
    (orchestration,) = observer.spans_named("gateway.request_orchestration")
    (admitted,) = observer.spans_named("gateway.flow_control")
    assert admitted.parent is orchestration
    assert admitted.attributes == {"priority": 0, "fairness_id": "default-flow"}
    assert admitted.ended
    assert not admitted.errors

    pool["saturation"] = 1.0  # saturated: the request waits until the controller stops
    headers = {"x-gateway-inference-fairness-id": "tenant-a"}
    slow = director.open(inbound(_body(), request_id="req-2", span=gateway, headers=headers))
    slow_request = asyncio.create_task(slow.route())
    deadline = time.monotonic() + 5
    while controller.stats().queued_requests != 1:
        assert time.monotonic() < deadline, "the request never queued"
        await asyncio.sleep(0)
    assert not observer.spans_named("gateway.flow_control")[1].ended  # still waiting
    await controller.stop()
    decision = await asyncio.wait_for(slow_request, 5)
    assert decision.error is not None
    waited = observer.spans_named("gateway.flow_control")[1]
    assert waited.attributes["fairness_id"] == "tenant-a"
    assert waited.ended
    assert waited.errors


async def test_a_refused_request_marks_its_span_as_an_error() -> None:
    observer = RecordingObserver()
    director = observed_director(observer)
    await director.open(inbound(b"{not json")).route()
    (orchestration,) = observer.spans_named("gateway.request_orchestration")
    assert orchestration.errors
    assert orchestration.ended


async def test_every_reported_metric_is_one_the_exporter_declares() -> None:
    observer = RecordingObserver()
    director = observed_director(observer)
    await _complete(director, _body())
    await director.open(inbound(b"{not json")).route()
    declared = {metric.name for metric in catalogue.CATALOGUE}
    assert observer.reported_names() <= declared
    assert len(observer.reported_names()) >= 14
