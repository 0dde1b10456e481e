"""The llm-d router chart's shipped EndpointPickerConfigs, as the chart renders them with its
default values (``fixtures/llm-d-router-chart``): they load, and a Director wired from them
routes requests the way the config says."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.config import ConfigError, load_config
from app.config.notices import NoticeLog
from app.plugins import build_registry
from domain.datastore.endpoint import EndpointMetrics
from domain.datastore.store import Datastore
from domain.requestcontrol.director import Director, RequestExchangeState
from ports.endpoints import EndpointAddress, EndpointEvent, EndpointEventKind, EndpointInfo
from ports.requests import InboundRequest
from tests.support.director import configured_director
from tests.support.scheduling import plugin_handle

CHART = Path(__file__).parent / "fixtures" / "llm-d-router-chart"
DEFAULT_PLUGINS = (CHART / "default-plugins.yaml").read_text()
PAYLOAD_AGNOSTIC = (CHART / "payload-agnostic.yaml").read_text()
LATENCY_PREDICTOR = (CHART / "default-plugins-latency-predictor.yaml").read_text()

IPS = ("10.2.0.1", "10.2.0.2", "10.2.0.3")


def _datastore(metrics: dict[str, EndpointMetrics] | None = None) -> Datastore:
    store = Datastore()
    for ip in IPS:
        address = EndpointAddress(ip=ip, port=8000)
        store.apply(
            EndpointEvent(
                kind=EndpointEventKind.ADD_OR_UPDATE,
                endpoint=EndpointInfo(name=ip, address=address),
            )
        )
    for endpoint in store.endpoints():
        endpoint.metrics = (metrics or {}).get(endpoint.name)
    store.mark_synced()
    return store


def _open(director: Director, n: int, *, path: str, body: bytes) -> RequestExchangeState:
    headers = {":path": path, ":method": "POST", "x-request-id": f"r-{n}"}
    return director.open(InboundRequest(request_id=f"r-{n}", headers=headers, body=body))


async def _route(director: Director, n: int, *, path: str, body: bytes) -> str:
    exchange = _open(director, n, path=path, body=body)
    try:
        decision = await exchange.route()
        assert decision.error is None, decision.error
        return decision.endpoints[0].ip
    finally:
        await exchange.close()


def _load(text: str) -> object:
    return load_config(
        text,
        registry=build_registry(include_entry_points=False),
        handle=plugin_handle(),
        notice_log=NoticeLog(),
    )


# -- default-plugins.yaml --------------------------------------------------------------------


def test_default_plugins_loads_the_reference_blend_with_the_charts_metrics_source() -> None:
    loaded = load_config(
        DEFAULT_PLUGINS,
        registry=build_registry(include_entry_points=False),
        handle=plugin_handle(),
        notice_log=NoticeLog(),
    )
    weights = [(w.scorer.typed_name.type, w.weight) for w in loaded.profiles["default"].scorers]
    assert weights == [
        ("queue-scorer", 2.0),
        ("kv-cache-utilization-scorer", 2.0),
        ("prefix-cache-scorer", 3.0),
    ]
    assert loaded.profiles["default"].picker.typed_name.type == "max-score-picker"
    # no dataLayer section: the chart's configured metrics source feeds the extractor
    assert loaded.data_layer is not None
    [source] = loaded.data_layer.sources
    assert source.source is loaded.plugins["metrics-data-source"]
    assert [e.typed_name.type for e in source.extractors] == ["core-metrics-extractor"]
    assert source.interval is None
    assert loaded.notices == ()  # nothing in it is ignored here


async def test_default_plugins_sends_requests_to_the_least_loaded_endpoint() -> None:
    metrics = {
        "10.2.0.1": EndpointMetrics(waiting_queue_size=9, kv_cache_usage_percent=0.9),
        "10.2.0.2": EndpointMetrics(waiting_queue_size=0, kv_cache_usage_percent=0.1),
        "10.2.0.3": EndpointMetrics(waiting_queue_size=4, kv_cache_usage_percent=0.5),
    }
    director = configured_director(_datastore(metrics), DEFAULT_PLUGINS)
    for n in range(5):
        body = b'{"model": "m", "prompt": "question %d about something else entirely"}' % n
        assert await _route(director, n, path="/v1/completions", body=body) == "10.2.0.2"


# -- payload-agnostic.yaml -------------------------------------------------------------------


def test_payload_agnostic_loads_the_passthrough_parser_and_the_active_request_scorer() -> None:
    loaded = load_config(
        PAYLOAD_AGNOSTIC,
        registry=build_registry(include_entry_points=False),
        handle=plugin_handle(),
        notice_log=NoticeLog(),
    )
    assert loaded.parser.typed_name.type == "passthrough-parser"
    weights = [(w.scorer.typed_name.type, w.weight) for w in loaded.profiles["default"].scorers]
    assert weights == [("active-request-scorer", 1.0), ("session-affinity-scorer", 1.0)]
    # the scorer reads the in-flight load, so its producer is created
    assert "inflight-load-producer" in [p.typed_name.type for p in loaded.data_producers]
    # an llm-d document without dataLayer: the default metrics source, as in the chart's EPP
    assert loaded.data_layer is not None
    assert [s.source.typed_name.type for s in loaded.data_layer.sources] == ["metrics-data-source"]


async def test_payload_agnostic_spreads_requests_in_flight_over_the_idle_endpoints() -> None:
    director = configured_director(_datastore(), PAYLOAD_AGNOSTIC)
    # A body no parser understands, on a path no parser claims: passed through as it is.
    exchanges = [
        _open(director, n, path="/custom/generate", body=b"\x00 not json %d" % n) for n in range(3)
    ]
    try:
        chosen = []
        for exchange in exchanges:  # each stays in flight while the next is routed
            decision = await exchange.route()
            assert decision.error is None, decision.error
            chosen.append(decision.endpoints[0].ip)
        assert sorted(chosen) == sorted(IPS)
    finally:
        for exchange in exchanges:
            await exchange.close()
    # all ended: every endpoint is idle again, any of them may take the next one
    assert await _route(director, 9, path="/custom/generate", body=b"x") in IPS


# -- the latency-predictor variant and bad input ---------------------------------------------


def test_the_latency_predictor_variant_loads_with_the_latency_scorer_in_its_profile() -> None:
    loaded = load_config(
        LATENCY_PREDICTOR,
        registry=build_registry(include_entry_points=False),
        handle=plugin_handle(),
        notice_log=NoticeLog(),
    )
    types = {w.scorer.typed_name.type for p in loaded.profiles.values() for w in p.scorers}
    assert "latency-scorer" in types


async def test_a_director_wired_from_the_latency_predictor_variant_routes() -> None:
    director = configured_director(_datastore(), LATENCY_PREDICTOR)
    body = b'{"model":"m","prompt":"hi"}'
    assert await _route(director, 1, path="/v1/completions", body=body) in IPS


@pytest.mark.parametrize(
    ("added", "message"),
    [
        (
            "dataLayer:\n  sources:\n  - pluginRef: metrics-data-source\n    intervl: 1s\n",
            "dataLayer.sources[0].intervl: unknown field",
        ),
        ("flowControl:\n  enableEvictions: true\n", "flowControl.enableEvictions: unknown field"),
        ("requestHandlers: {}\n", "requestHandlers: unknown field"),
    ],
)
def test_a_misspelt_key_in_the_charts_config_still_fails_naming_its_path(
    added: str, message: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        _load(DEFAULT_PLUGINS + added)
    assert str(caught.value) == message
