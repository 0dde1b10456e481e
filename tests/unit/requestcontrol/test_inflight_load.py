"""inflight-load-producer: token estimates, accounting across the request's life, pruning."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from domain.datalayer.attributes import IN_FLIGHT_LOAD, InFlightLoad
from domain.datastore.endpoint import Endpoint
from domain.plugins.base import PluginRegistry
from domain.plugins.handle import Handle
from domain.requestcontrol.interfaces import (
    DataProducer,
    PreRequest,
    ResponseBodyProcessor,
    ResponseInfo,
    ResponseOutcome,
)
from domain.requestcontrol.plugins import inflight_load
from domain.requestcontrol.plugins.inflight_load import InFlightLoadProducer, estimate_tokens
from domain.requesthandling.jsoncodec import StdlibJsonCodec
from domain.scheduling.types import (
    Candidate,
    InferenceRequest,
    ProfileRunResult,
    SchedulingResult,
)
from ports.endpoints import EndpointAddress, EndpointEvent, EndpointEventKind, EndpointInfo
from tests.support.scheduling import inference_request
from tests.unit.requestcontrol import make_handle

CODEC = StdlibJsonCodec()
IDLE = InFlightLoad(0, 0)


def _info(name: str) -> EndpointInfo:
    return EndpointInfo(name=name, address=EndpointAddress(ip=f"10.1.0.{len(name)}", port=8000))


def _add(handle: Handle, *names: str) -> list[Candidate]:
    """Add endpoints to the handle's datastore; return candidates of the live entries."""
    candidates = []
    for name in names:
        handle.datastore.apply(
            EndpointEvent(kind=EndpointEventKind.ADD_OR_UPDATE, endpoint=_info(name))
        )
        live = handle.datastore.get(name)
        assert live is not None
        candidates.append(Candidate(live))
    return candidates


async def _load(producer: InFlightLoadProducer, name: str) -> InFlightLoad:
    """The load a scorer sees for endpoint ``name`` (what PrepareData writes)."""
    seen = Candidate(Endpoint(info=_info(name)))
    await producer.prepare_request_data(_request(request_id="probe"), [seen])
    load = seen.attributes[IN_FLIGHT_LOAD]
    assert isinstance(load, InFlightLoad)
    return load


def _delete(handle: Handle, name: str) -> None:
    handle.datastore.apply(EndpointEvent(kind=EndpointEventKind.DELETE, endpoint=_info(name)))


def _result(primary: str = "default", **profiles: Sequence[Candidate] | None) -> SchedulingResult:
    return SchedulingResult(
        profile_results={
            name: None if targets is None else ProfileRunResult(tuple(targets))
            for name, targets in profiles.items()
        },
        primary_profile_name=primary,
    )


def _request(size: int = 400, request_id: str = "req-1", **body: Any) -> InferenceRequest:
    request = inference_request(body or {"model": "m", "prompt": "hello"}, request_id=request_id)
    request.request_size_bytes = size
    return request


def _chunk(*, start: bool = False, end: bool = False, **kwargs: Any) -> ResponseInfo:
    return ResponseInfo(request_id="req", start_of_stream=start, end_of_stream=end, **kwargs)


@pytest.fixture
def handle() -> Handle:
    return make_handle()


@pytest.fixture
def producer(handle: Handle) -> InFlightLoadProducer:
    registry = PluginRegistry()
    inflight_load.register(registry)
    plugin = registry.create("inflight-load-producer", "inflight-load-producer", None, handle)
    assert isinstance(plugin, InFlightLoadProducer)
    return plugin


# --- registration -------------------------------------------------------------------------


def test_registered_as_default_producer_of_in_flight_load() -> None:
    registry = PluginRegistry()
    inflight_load.register(registry)
    assert registry.default_producer_for(IN_FLIGHT_LOAD) == "inflight-load-producer"


def test_fills_data_producer_pre_request_and_response_body_slots(
    producer: InFlightLoadProducer,
) -> None:
    assert isinstance(producer, DataProducer)
    assert isinstance(producer, PreRequest)
    assert isinstance(producer, ResponseBodyProcessor)
    assert list(producer.produces()) == [IN_FLIGHT_LOAD]
    assert list(producer.consumes()) == []


# --- token estimate -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("size", "expected"),
    [
        (100, 25 + 38),  # input 100/4 = 25, output round(37.5) = 38
        (103, 25 + 38),  # integer division
        (3, 1 + 2),  # at least 1 input token; output round(1.5) = 2
        (12, 3 + 5),  # output round(4.5) = 5: half away from zero
    ],
)
def test_estimate_from_request_size(size: int, expected: int) -> None:
    assert estimate_tokens(_request(size), CODEC) == expected


def test_estimate_counts_token_ids_when_size_unknown() -> None:
    request = _request(0, prompt=list(range(10)), model="m")
    assert estimate_tokens(request, CODEC) == 10 + 15


def test_estimate_counts_token_ids_of_every_prompt_of_a_batch() -> None:
    request = _request(0, prompt=[[1, 2, 3], [4, 5]], model="m")
    assert estimate_tokens(request, CODEC) == 5 + 8  # output round(7.5) = 8


def test_estimate_from_prompt_characters() -> None:
    request = _request(0, prompt="abcdefghij", model="m")  # 10 characters
    assert estimate_tokens(request, CODEC) == 3 + 5  # round(2.5) = 3, round(4.5) = 5


def test_estimate_counts_characters_not_bytes() -> None:
    request = _request(0, prompt="éééééééé", model="m")  # 8 characters, 16 bytes
    assert estimate_tokens(request, CODEC) == 2 + 3


def test_estimate_of_chat_uses_the_messages_json() -> None:
    request = inference_request(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        path="/v1/chat/completions",
    )
    request.request_size_bytes = 0
    # '[{"content":"hi","role":"user"}]' is 32 characters: input 8, output 12.
    assert estimate_tokens(request, CODEC) == 20


def test_estimate_without_body_or_size_is_zero() -> None:
    request = inference_request(None)
    assert request.request_size_bytes == 0
    assert estimate_tokens(request, CODEC) == 0


# --- accounting ---------------------------------------------------------------------------


async def test_candidates_start_idle(handle: Handle, producer: InFlightLoadProducer) -> None:
    a, b = _add(handle, "a", "b")
    await producer.prepare_request_data(_request(), [a, b])
    assert a.attributes[IN_FLIGHT_LOAD] == IDLE
    assert b.attributes[IN_FLIGHT_LOAD] == IDLE


async def test_pre_request_counts_first_endpoint_of_each_profile(
    handle: Handle, producer: InFlightLoadProducer
) -> None:
    a, b, c, d = _add(handle, "a", "b", "c", "d")
    request = _request(400)  # 100 + 150 tokens
    await producer.pre_request(
        request,
        _result(primary="decode", prefill=[a, d], decode=[b, c], failed=None, empty=[]),
    )

    fresh = [Candidate(e) for e in handle.datastore.endpoints()]
    await producer.prepare_request_data(_request(), fresh)
    loads = {c.name: c.attributes[IN_FLIGHT_LOAD] for c in fresh}
    assert loads == {
        "a": InFlightLoad(1, 250),
        "b": InFlightLoad(1, 250),
        "c": IDLE,
        "d": IDLE,
    }


async def test_loads_add_up_across_requests(handle: Handle, producer: InFlightLoadProducer) -> None:
    (a,) = _add(handle, "a")
    await producer.pre_request(_request(400, "r1"), _result(default=[a]))
    await producer.pre_request(_request(40, "r2"), _result(default=[a]))
    assert await _load(producer, "a") == InFlightLoad(2, 250 + 25)


async def test_same_endpoint_for_prefill_and_decode_counts_twice(
    handle: Handle, producer: InFlightLoadProducer
) -> None:
    (a,) = _add(handle, "a")
    request = _request(400)
    await producer.pre_request(request, _result(primary="decode", prefill=[a], decode=[a]))
    assert await _load(producer, "a") == InFlightLoad(2, 500)

    await producer.response_body(request, _chunk(start=True), None)
    assert await _load(producer, "a") == InFlightLoad(1, 250)

    await producer.response_body(request, _chunk(end=True), None)
    assert await _load(producer, "a") == IDLE


async def test_repeated_pre_request_does_not_count_twice(
    handle: Handle, producer: InFlightLoadProducer
) -> None:
    (a,) = _add(handle, "a")
    request = _request(400)
    await producer.pre_request(request, _result(default=[a]))
    await producer.pre_request(request, _result(default=[a]))
    assert await _load(producer, "a") == InFlightLoad(1, 250)


async def test_prefill_released_on_first_chunk_others_at_end(
    handle: Handle, producer: InFlightLoadProducer
) -> None:
    prefill, decode = _add(handle, "p", "d")
    request = _request(400)
    await producer.pre_request(
        request, _result(primary="decode", prefill=[prefill], decode=[decode])
    )

    await producer.response_body(request, _chunk(start=True), None)
    assert await _load(producer, "p") == IDLE
    assert await _load(producer, "d") == InFlightLoad(1, 250)

    await producer.response_body(request, _chunk(), None)
    assert await _load(producer, "d") == InFlightLoad(1, 250)

    await producer.response_body(request, _chunk(end=True, outcome=ResponseOutcome.COMPLETED), None)
    assert await _load(producer, "d") == IDLE


async def test_single_buffered_body_releases_everything(
    handle: Handle, producer: InFlightLoadProducer
) -> None:
    prefill, decode = _add(handle, "p", "d")
    request = _request(400)
    await producer.pre_request(
        request, _result(primary="decode", prefill=[prefill], decode=[decode])
    )
    await producer.response_body(request, _chunk(start=True, end=True), None)
    assert await _load(producer, "p") == IDLE
    assert await _load(producer, "d") == IDLE


@pytest.mark.parametrize("outcome", [ResponseOutcome.CLIENT_GONE, ResponseOutcome.FAILED])
async def test_released_when_the_response_does_not_complete(
    handle: Handle, producer: InFlightLoadProducer, outcome: ResponseOutcome
) -> None:
    (a,) = _add(handle, "a")
    request = _request(400)
    await producer.pre_request(request, _result(default=[a]))
    await producer.response_body(request, _chunk(end=True, outcome=outcome), None)
    assert await _load(producer, "a") == IDLE


async def test_double_end_of_stream_releases_once(
    handle: Handle, producer: InFlightLoadProducer
) -> None:
    (a,) = _add(handle, "a")
    first, second = _request(400, "r1"), _request(40, "r2")
    await producer.pre_request(first, _result(default=[a]))
    await producer.pre_request(second, _result(default=[a]))

    await producer.response_body(first, _chunk(end=True), None)
    await producer.response_body(first, _chunk(end=True), None)
    await producer.response_body(first, _chunk(start=True, end=True), None)

    assert await _load(producer, "a") == InFlightLoad(1, 25)


async def test_response_without_pre_request_changes_nothing(
    handle: Handle, producer: InFlightLoadProducer
) -> None:
    (a,) = _add(handle, "a")
    await producer.pre_request(_request(400, "r1"), _result(default=[a]))
    await producer.response_body(_request(400, "r2"), _chunk(end=True), None)
    assert await _load(producer, "a") == InFlightLoad(1, 250)


async def test_load_is_kept_on_the_live_endpoint(
    handle: Handle, producer: InFlightLoadProducer
) -> None:
    (a,) = _add(handle, "a")
    request = _request(400)
    await producer.pre_request(request, _result(default=[a]))

    live = handle.datastore.get("a")
    assert live is not None
    # A snapshot taken before PrepareData already carries the load.
    assert Candidate(live).attributes[IN_FLIGHT_LOAD] == InFlightLoad(1, 250)

    await producer.response_body(request, _chunk(end=True), None)
    assert Candidate(live).attributes[IN_FLIGHT_LOAD] == IDLE


# --- endpoint deletion --------------------------------------------------------------------


async def test_deleted_endpoint_counters_are_dropped(
    handle: Handle, producer: InFlightLoadProducer
) -> None:
    a, b = _add(handle, "a", "b")
    request = _request(400)
    await producer.pre_request(request, _result(primary="decode", prefill=[a], decode=[b]))

    _delete(handle, "b")
    assert await _load(producer, "b") == IDLE
    assert await _load(producer, "a") == InFlightLoad(1, 250)

    await producer.response_body(request, _chunk(start=True, end=True), None)
    assert await _load(producer, "a") == IDLE
    assert await _load(producer, "b") == IDLE


async def test_late_release_does_not_touch_a_re_added_endpoint(
    handle: Handle, producer: InFlightLoadProducer
) -> None:
    (old,) = _add(handle, "a")
    before = _request(400, "r1")
    await producer.pre_request(before, _result(default=[old]))

    _delete(handle, "a")
    (new,) = _add(handle, "a")
    after = _request(40, "r2")
    await producer.pre_request(after, _result(default=[new]))
    assert await _load(producer, "a") == InFlightLoad(1, 25)

    await producer.response_body(before, _chunk(end=True), None)
    assert await _load(producer, "a") == InFlightLoad(1, 25)

    await producer.response_body(after, _chunk(end=True), None)
    assert await _load(producer, "a") == IDLE
