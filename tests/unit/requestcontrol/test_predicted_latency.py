"""The predicted-latency pipeline: the llm-d chart's config as it ships, SLO headers, the
admitter, the receipts, learning, and sharing the learnt models."""

from __future__ import annotations

import dataclasses
import time

import pytest

from app.config import ConfigError
from domain.datastore.endpoint import EndpointMetrics
from domain.datastore.objectives import ObjectiveStore
from domain.datastore.store import Datastore
from domain.requestcontrol.director import Director
from domain.requestcontrol.latency_model import (
    SOURCE_ENDPOINT,
    SOURCE_HEURISTIC,
    SOURCE_POOL,
    LatencyModel,
    ModelParameters,
)
from domain.requestcontrol.plugins.predicted_latency_producer import PredictedLatencyProducer
from ports.endpoints import EndpointAddress, EndpointEvent, EndpointEventKind, EndpointInfo
from ports.errors import ErrorCode
from ports.metric_catalogue import LATENCY_PREDICTION_ERROR, REQUEST_TTFT
from ports.requests import InboundRequest
from tests.fakes.observer import RecordingObserver
from tests.support.charts import LLMD_LATENCY_PREDICTOR_PLUGINS
from tests.support.director import configured_director

PRIOR = (30.0, 250.0, 250.0, 0.0, 0.0, 0.0, 0.0)


def _datastore(*metrics: EndpointMetrics) -> Datastore:
    datastore = Datastore()
    for index, snapshot in enumerate(metrics):
        info = EndpointInfo(
            name=f"pod-{index}", address=EndpointAddress(ip=f"10.0.0.{index + 1}", port=8000)
        )
        datastore.apply(EndpointEvent(kind=EndpointEventKind.ADD_OR_UPDATE, endpoint=info))
        endpoint = datastore.get(info.name)
        assert endpoint is not None
        endpoint.metrics = dataclasses.replace(snapshot, update_time=time.monotonic())
    datastore.mark_synced()
    return datastore


def _request(number: int, headers: dict[str, str] | None = None) -> InboundRequest:
    return InboundRequest(
        request_id=f"r-{number}",
        headers={":path": "/v1/completions", "x-request-id": f"r-{number}", **(headers or {})},
        body=b'{"model": "m", "prompt": "%s", "stream": true}' % (b"x" * 400),
        metadata={},
    )


def _producer(director: Director) -> PredictedLatencyProducer:
    found = [p for p in director.control.data_producers if isinstance(p, PredictedLatencyProducer)]
    assert len(found) == 1
    return found[0]


IDLE = EndpointMetrics(waiting_queue_size=0, running_requests_size=1, kv_cache_usage_percent=0.1)
LOADED = EndpointMetrics(
    waiting_queue_size=20, running_requests_size=30, kv_cache_usage_percent=0.97
)


def _teach(producer: PredictedLatencyProducer, samples: int = 40) -> None:
    """What the producer would learn from responses: a queue of 20 waiting adds 4 s."""
    for i in range(samples):
        for name, waiting in (("pod-0", 0), ("pod-1", 20)):
            x = (1.0, 0.1, 0.0, 0.1, waiting * 0.1, 0.1 + i % 3 * 0.1, 0.1 + waiting * 0.04)
            producer.ttft.observe(name, x, 60.0 + waiting * 200.0 + i % 5)


async def test_the_llm_d_charts_latency_predictor_config_loads_and_routes_as_it_ships() -> None:
    # tests/support/charts.py: config/charts/routerlib/templates/_config.yaml of
    # llm-d/llm-d-router at ebab6879 with router.latencyPredictor.enabled, verbatim.
    datastore = _datastore(IDLE, LOADED)
    director = configured_director(datastore, LLMD_LATENCY_PREDICTOR_PLUGINS)
    profile = director.control.scheduler.profiles["default"]
    assert [f.typed_name.name for f in profile.filters] == [
        "strict-affinity-filter",
        "slo-headroom-tier-filter",
        "loose-affinity-filter",
    ]
    assert [w.scorer.typed_name.name for w in profile.scorers] == ["latency-scorer"]
    assert profile.picker.typed_name.type == "weighted-random-picker"
    assert "latency-slo-admitter" in [a.typed_name.type for a in director.control.admitters]
    _teach(_producer(director))
    chosen = []
    for number in range(20):
        decision = await director.open(_request(number)).route()
        assert decision.error is None, decision.error
        chosen.append(decision.endpoints[0].ip)
    # The server reporting a deep queue and a full cache gets (almost) nothing new: the
    # weighted picker gives it at most 1/101 of the other's weight.
    assert chosen.count("10.0.0.2") <= 2, chosen


@pytest.mark.parametrize(
    ("header", "value"),
    [
        ("x-slo-ttft-ms", "-5"),
        ("x-slo-ttft-ms", "0"),
        ("x-slo-ttft-ms", "fast"),
        ("x-slo-tpot-ms", "1000000000000"),
        ("x-slo-tpot-ms", "nan"),
        ("x-llm-d-slo-ttft-ms", "1e3"),
    ],
)
async def test_an_absurd_slo_header_is_a_400_naming_it(header: str, value: str) -> None:
    director = configured_director(_datastore(IDLE, IDLE), LLMD_LATENCY_PREDICTOR_PLUGINS)
    decision = await director.open(_request(1, {header: value})).route()
    assert decision.error is not None
    assert decision.error.code is ErrorCode.BAD_REQUEST
    assert decision.error.message.startswith(f"{header}: must be a number of milliseconds")


async def test_a_sheddable_request_no_endpoint_can_serve_in_time_is_a_429_with_the_reason() -> None:
    objectives = ObjectiveStore()
    objectives.set_objectives({"batch": -1})
    # busy, not saturated (the saturation detector would shed it first)
    busy = EndpointMetrics(
        waiting_queue_size=2, running_requests_size=6, kv_cache_usage_percent=0.5
    )
    director = configured_director(
        _datastore(busy, busy), LLMD_LATENCY_PREDICTOR_PLUGINS, objectives=objectives
    )
    _teach_both_busy(_producer(director))
    slo = {"x-slo-ttft-ms": "500"}
    refused = await director.open(
        _request(1, {**slo, "x-gateway-inference-objective": "batch"})
    ).route()
    assert refused.error is not None
    assert refused.error.code is ErrorCode.RESOURCE_EXHAUSTED
    assert "no endpoint is predicted to meet the request's SLO (ttft 500 ms" in (
        refused.error.message
    )
    # Not sheddable: it goes, to the endpoint predicted fastest.
    served = await director.open(_request(2, slo)).route()
    assert served.error is None


def _teach_both_busy(producer: PredictedLatencyProducer) -> None:
    for i in range(40):
        for name in ("pod-0", "pod-1"):
            x = (1.0, 0.1, 0.0, 0.1, 0.2, 0.6, 0.5)
            producer.ttft.observe(name, x, 4000.0 + i % 5)


async def test_a_streamed_response_leaves_a_receipt_and_teaches_the_model() -> None:
    observer = RecordingObserver()
    datastore = _datastore(IDLE, IDLE)
    director = configured_director(datastore, LLMD_LATENCY_PREDICTOR_PLUGINS, observer=observer)
    producer = _producer(director)
    for number in range(3):
        exchange = director.open(_request(number))
        decision = await exchange.route()
        assert decision.error is None
        await exchange.response_headers({":status": "200", "content-type": "text/event-stream"}, {})
        await exchange.response_body(b'data: {"choices": [{"text": "a"}]}\n\n', False)
        await exchange.response_body(b'data: {"choices": [{"text": "b"}]}\n\n', False)
        await exchange.response_body(b"data: [DONE]\n\n", True)
        await exchange.close()
    assert producer.ttft.samples == 3
    assert producer.tpot.samples == 3
    endpoints = {
        r.labels["endpoint"] for r in observer.histograms if r.metric is LATENCY_PREDICTION_ERROR
    }
    assert endpoints
    assert endpoints <= {"pod-0", "pod-1"}
    assert len(observer.observations(REQUEST_TTFT)) == 3
    assert len(observer.observations(LATENCY_PREDICTION_ERROR, kind="tpot")) == 3


# -- the model -------------------------------------------------------------------------


def test_a_new_endpoint_starts_from_the_pool_and_a_slow_one_learns_its_own_speed() -> None:
    model = LatencyModel(ModelParameters(prior=PRIOR, min_samples=16))
    x = (1.0, 2.0, 4.0, 0.2, 0.0, 0.2, 0.3)
    assert model.predict("a", x).source == SOURCE_HEURISTIC
    assert model.predict("a", x).value == pytest.approx(30 + 250 * 6)
    for i in range(200):
        xi = (1.0, 0.5 + i % 7 * 0.3, i % 11 * 0.5, 0.1, 0.0, 0.1, 0.2)
        fast = 20.0 + 200.0 * xi[1] + 200.0 * xi[2]
        model.observe("fast", xi, fast)
        model.observe("slow", xi, 2 * fast)
    assert model.predict("new", x).source == SOURCE_POOL
    fast_prediction = model.predict("fast", x)
    slow_prediction = model.predict("slow", x)
    assert fast_prediction.source == slow_prediction.source == SOURCE_ENDPOINT
    truth = 20.0 + 200.0 * 2.0 + 200.0 * 4.0
    assert fast_prediction.value == pytest.approx(truth, rel=0.1)
    assert slow_prediction.value == pytest.approx(2 * truth, rel=0.1)


def test_absurd_samples_cannot_poison_the_model() -> None:
    model = LatencyModel(ModelParameters(prior=PRIOR, min_samples=8))
    x = (1.0, 1.0, 1.0, 0.1, 0.0, 0.1, 0.2)
    for _ in range(50):
        assert model.observe("a", x, 500.0)
    before = model.predict("a", x).value
    # an hour, a negative time (a clock that jumped), NaN: refused
    for absurd in (3_600_000.0, -20.0, 0.0, float("nan"), float("inf")):
        assert not model.observe("a", x, absurd)
    # ten minutes, ten times: learnt, each with its influence bounded
    for _ in range(10):
        assert model.observe("a", x, 600_000.0)
    after = model.predict("a", x).value
    assert before == pytest.approx(500.0, rel=0.05)
    assert after < 5 * before
    assert model.clipped >= 10


def test_memory_is_bounded_by_the_endpoints_and_forgetting_one_frees_it() -> None:
    model = LatencyModel(ModelParameters(prior=PRIOR))
    x = (1.0, 1.0, 1.0, 0.1, 0.0, 0.1, 0.2)
    for i in range(10_000):
        model.observe(f"e{i % 4}", x, 100.0)
    assert sorted(model.endpoints()) == ["e0", "e1", "e2", "e3"]
    assert model.sample_count("e0") < 1.0 / (1.0 - model.parameters.decay) + 1
    model.forget("e0")
    assert sorted(model.endpoints()) == ["e1", "e2", "e3"]


# -- sharing -------------------------------------------------------------------------------


class _SharedStore:
    """A store shared by two producers, as Redis is with --redis-url."""

    def __init__(self) -> None:
        self.values: dict[str, str] = {}

    async def get(self, key: str) -> str | None:
        return self.values.get(key)

    async def put(self, key: str, endpoint: str, ttl: float) -> None:
        self.values[key] = endpoint


async def test_a_new_replica_adopts_the_models_another_one_learnt() -> None:
    store = _SharedStore()
    datastore = _datastore(IDLE, LOADED)
    first = configured_director(datastore, LLMD_LATENCY_PREDICTOR_PLUGINS)
    second = configured_director(datastore, LLMD_LATENCY_PREDICTOR_PLUGINS)
    learnt, fresh = _producer(first), _producer(second)
    for producer in (learnt, fresh):
        producer._sessions = store  # as the container wires a shared store
        producer._shared = True
    _teach(learnt)
    await learnt.share()
    assert store.values
    x = (1.0, 0.1, 0.0, 0.1, 2.0, 0.2, 0.9)
    assert fresh.ttft.predict("pod-1", x).source == SOURCE_HEURISTIC
    await fresh.share()
    adopted = fresh.ttft.predict("pod-1", x)
    assert adopted.source == SOURCE_ENDPOINT
    assert adopted.value == pytest.approx(learnt.ttft.predict("pod-1", x).value, rel=1e-6)
    # the one that learnt more writes again; the one that only adopted never overwrites it
    _teach(learnt, samples=5)
    await learnt.share()
    written = dict(store.values)
    await fresh.share()
    assert store.values == written
    # a document that is not a model is ignored
    assert not fresh.ttft.merge("pod-0", {"n": "many", "a": [], "b": []})


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ("{sloBufferFactor: 0}", "plugins[0].parameters.sloBufferFactor: must be > 0"),
        (
            "{useEncoderCacheFeatures: true}",
            "plugins[0].parameters.useEncoderCacheFeatures: this EPP has no multimodal",
        ),
        ("{minSamples: 0}", "plugins[0].parameters.minSamples: must be >= 1"),
    ],
)
def test_bad_producer_parameters_stop_start_up_naming_the_key(
    parameters: str, message: str
) -> None:
    text = f"""\
plugins:
- type: predicted-latency-producer
  parameters: {parameters}
- type: latency-scorer
schedulingProfiles:
- name: default
  plugins: [{{pluginRef: latency-scorer}}]
"""
    with pytest.raises(ConfigError) as caught:
        configured_director(_datastore(IDLE), text)
    assert str(caught.value).startswith(message)


async def test_the_llm_d_parameters_are_accepted() -> None:
    text = """\
plugins:
- type: predicted-latency-producer
  parameters:
    samplingMean: 1000
    maxDecodeTokenSamplesForPrediction: 0
    sloBufferFactor: 1.5
    contextTTL: 5m
    streamingMode: true
    endpointRoleLabel: llm-d.ai/role
    predictInProduce: true
- type: latency-scorer
  parameters: {ttftWeight: 0.8, tpotWeight: 0.2, headroomSelectionStrategy: most}
schedulingProfiles:
- name: default
  plugins: [{pluginRef: latency-scorer}]
"""
    director = configured_director(_datastore(IDLE, IDLE), text)
    decision = await director.open(_request(1, {"x-llm-d-slo-tpot-ms": "40"})).route()
    assert decision.error is None


async def test_before_any_sample_a_server_reporting_a_deep_queue_gets_no_new_prompt() -> None:
    # Two servers, one reporting 20 waiting and a full cache, no other traffic: the cold
    # predictor's heuristic counts the queue it reports, the latency scorer prefers the idle.
    director = configured_director(_datastore(IDLE, LOADED), LLMD_LATENCY_PREDICTOR_PLUGINS)
    chosen = []
    for number in range(10):
        decision = await director.open(_request(number)).route()
        assert decision.error is None
        chosen.append(decision.endpoints[0].ip)
    # the chart's weighted-random picker gives the loaded one 1/102 of the chances
    assert chosen.count("10.0.0.2") <= 1, chosen
