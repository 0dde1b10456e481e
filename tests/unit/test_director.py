"""The Director on its own: candidates, model rewrite, response handling (domain only)."""

from __future__ import annotations

import random

import pytest

from domain.datastore.store import Datastore
from domain.requestcontrol.candidates import locate
from domain.requestcontrol.director import Director
from domain.requesthandling.jsoncodec import StdlibJsonCodec
from ports.endpoints import EndpointAddress, EndpointEvent, EndpointEventKind, EndpointInfo
from ports.errors import ErrorCode
from ports.requests import InboundRequest

CODEC = StdlibJsonCodec()


def _endpoint(ip: str, port: int = 8000) -> EndpointInfo:
    address = EndpointAddress(ip=ip, port=port)
    return EndpointInfo(name=address.host_port(), address=address)


ENDPOINTS = (_endpoint("10.0.0.1"), _endpoint("10.0.0.2"), _endpoint("fd00::3"))


def _director(endpoints: tuple[EndpointInfo, ...] = ENDPOINTS) -> tuple[Director, Datastore]:
    store = Datastore()
    for e in endpoints:
        store.apply(EndpointEvent(kind=EndpointEventKind.ADD_OR_UPDATE, endpoint=e))
    store.mark_synced()
    return Director(datastore=store, codec=CODEC, rng=random.Random(1)), store


def _request(body: bytes | None, **headers: str) -> InboundRequest:
    all_headers = {":path": "/v1/completions", "x-request-id": "r-1"}
    all_headers.update({k.replace("_", "-"): v for k, v in headers.items()})
    return InboundRequest(request_id="r-1", headers=all_headers, body=body)


@pytest.mark.parametrize(
    ("hint", "expected"),
    [
        (None, ["10.0.0.1", "10.0.0.2", "fd00::3"]),
        (["10.0.0.2:9999"], ["10.0.0.2"]),
        ("10.0.0.1:8000, [fd00::3]:8000", ["10.0.0.1", "fd00::3"]),
        (["10.0.0.1:1", 42, None], ["10.0.0.1"]),
        ([], []),
        ("", []),
        (["10.9.9.9:8000"], []),
    ],
)
def test_subset_hint(hint: object, expected: list[str]) -> None:
    metadata: dict[str, dict[str, object]] = {}
    if hint is not None:
        metadata["envoy.lb.subset_hint"] = {"x-gateway-destination-endpoint-subset": hint}
    found = locate(ENDPOINTS, metadata)
    assert [e.address.ip for e in found] == expected
    assert list(locate(ENDPOINTS, metadata, subset_filter=False)) == list(ENDPOINTS)


def test_other_metadata_namespaces_do_not_filter() -> None:
    metadata = {"envoy.lb": {"x-gateway-destination-endpoint-served": "10.0.0.1:8000"}}
    assert list(locate(ENDPOINTS, metadata)) == list(ENDPOINTS)


async def test_routes_to_a_candidate_and_forwards_the_body_unchanged() -> None:
    director, _ = _director()
    body = b'{"model": "m", "prompt": "hello"}'
    exchange = director.open(_request(body))
    decision = await exchange.route()
    assert decision.error is None
    assert len(decision.endpoints) == 1
    assert decision.endpoints[0] in {e.address for e in ENDPOINTS}
    assert decision.body is body
    await exchange.close()


async def test_picks_are_spread_uniformly() -> None:
    director, _ = _director()
    counts = {e.address: 0 for e in ENDPOINTS}
    for _ in range(3000):
        decision = await director.open(_request(b'{"model":"m","prompt":"p"}')).route()
        counts[decision.endpoints[0]] += 1
    assert all(850 < c < 1150 for c in counts.values()), counts


async def test_model_rewrite_and_back() -> None:
    director, _ = _director()
    exchange = director.open(
        _request(b'{"prompt": "x", "model": "public"}', x_gateway_model_name_rewrite="internal")
    )
    decision = await exchange.route()
    assert decision.body == b'{"model":"internal","prompt":"x"}'
    await exchange.response_headers({":status": "200", "content-type": "application/json"}, {})
    reply = await exchange.response_body(
        b'{"model":"internal","usage":{"prompt_tokens":3,"completion_tokens":2}}', True
    )
    assert reply.body == b'{"model":"public","usage":{"prompt_tokens":3,"completion_tokens":2}}'
    assert exchange.usage is not None
    assert (exchange.usage.prompt_tokens, exchange.usage.completion_tokens) == (3, 2)


async def test_streamed_usage_is_read_from_sse_chunks() -> None:
    director, _ = _director()
    exchange = director.open(_request(b'{"model": "m", "prompt": "x", "stream": true}'))
    await exchange.route()
    reply = await exchange.response_headers(
        {":status": "200", "content-type": "text/event-stream"}, {}
    )
    assert reply.streaming
    stream = (
        b'data: {"object":"text_completion","model":"m","choices":[{"text":"a"}]}\n\n'
        b'data: {"object":"text_completion","model":"m","choices":[],'
        b'"usage":{"prompt_tokens":7,"completion_tokens":1,"total_tokens":8}}\n\ndata: [DONE]\n\n'
    )
    for i in range(0, len(stream), 13):
        chunk = stream[i : i + 13]
        echoed = await exchange.response_body(chunk, i + 13 >= len(stream))
        assert echoed.body == chunk
    assert exchange.usage is not None
    assert exchange.usage.total_tokens == 8
    assert exchange.response_complete


@pytest.mark.parametrize(
    ("body", "code", "message"),
    [
        (b"not json", ErrorCode.BAD_REQUEST, ""),
        (b'{"prompt": "x"}', ErrorCode.BAD_REQUEST, "model not found in request body"),
    ],
)
async def test_bad_bodies(body: bytes, code: ErrorCode, message: str) -> None:
    director, _ = _director()
    decision = await director.open(_request(body)).route()
    assert decision.error is not None
    assert decision.error.code is code
    assert message in decision.error.message
    assert decision.endpoints == ()


async def test_no_candidates_is_service_unavailable() -> None:
    director, _ = _director(())
    decision = await director.open(_request(b'{"model": "m", "prompt": "x"}')).route()
    assert decision.error is not None
    assert decision.error.code is ErrorCode.SERVICE_UNAVAILABLE
    assert decision.error.message == "failed to find endpoint candidates for serving the request"


async def test_headers_only_request() -> None:
    director, store = _director()
    decision = await director.open(_request(None)).route()
    assert decision.endpoints[0] in {e.address for e in ENDPOINTS}
    store.clear()
    decision = await director.open(_request(None)).route()
    assert decision.error is not None
    assert decision.error.code is ErrorCode.INTERNAL
    assert decision.error.message == "no pods available in datastore"


def test_datastore_events_and_readiness() -> None:
    director, store = _director(())
    fresh = Datastore()
    assert not Director(datastore=fresh, codec=CODEC).ready()
    fresh.mark_synced()
    assert Director(datastore=fresh, codec=CODEC).ready()
    e = ENDPOINTS[0]
    store.apply(EndpointEvent(kind=EndpointEventKind.ADD_OR_UPDATE, endpoint=e))
    snapshot = store.endpoints()
    store.apply(EndpointEvent(kind=EndpointEventKind.ADD_OR_UPDATE, endpoint=e))
    assert store.endpoints() is snapshot  # no change, no new snapshot
    store.apply(EndpointEvent(kind=EndpointEventKind.DELETE, endpoint=e))
    assert store.endpoints() == ()
    assert snapshot == (e,)
    assert director.ready()
