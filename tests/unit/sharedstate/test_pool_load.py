"""inflight-load-producer with several EPP processes sharing a LoadBoard: what each one
shows on candidates and live endpoints, and what the load-reading plugins conclude."""

from __future__ import annotations

import asyncio

import pytest

from domain.datalayer.attributes import IN_FLIGHT_LOAD, InFlightLoad
from domain.plugins.base import TypedName
from domain.plugins.handle import Handle
from domain.requestcontrol.interfaces import ResponseInfo
from domain.requestcontrol.plugins.concurrency_detector import (
    ConcurrencyDetector,
    ConcurrencyDetectorParameters,
)
from domain.requestcontrol.plugins.inflight_load import InFlightLoadProducer
from domain.scheduling.types import Candidate, ProfileRunResult, SchedulingResult
from domain.sharedstate import BoardMember, LoadBoard
from ports.endpoints import EndpointAddress, EndpointEvent, EndpointEventKind, EndpointInfo
from ports.shared_state import EndpointLoad
from tests.support.scheduling import inference_request
from tests.unit.requestcontrol import FakeClock, make_handle
from tests.unit.sharedstate.fakes import until

PODS = ("pod-1", "pod-2")


class Process:
    """One EPP process: its datastore (the same pods), its producer, its board member."""

    def __init__(self, board: LoadBoard, process_id: str) -> None:
        self.handle: Handle = make_handle()
        self.member: BoardMember = board.member(process_id)
        self.handle.shared_load = self.member
        for i, name in enumerate(PODS):
            info = EndpointInfo(name=name, address=EndpointAddress(ip=f"10.0.0.{i}", port=80))
            self.handle.datastore.apply(
                EndpointEvent(kind=EndpointEventKind.ADD_OR_UPDATE, endpoint=info)
            )
        self.producer = InFlightLoadProducer(TypedName("inflight-load-producer", "p"), self.handle)
        self._requests = 0

    def candidates(self) -> list[Candidate]:
        """What admission snapshots: the live endpoints and their attributes."""
        return [Candidate(e) for e in self.handle.datastore.endpoints()]

    def live(self, name: str) -> object:
        endpoint = self.handle.datastore.get(name)
        assert endpoint is not None
        return endpoint.attributes.get(IN_FLIGHT_LOAD)

    async def send(self, name: str, size: int = 400) -> object:
        """Route one request to ``name``; returns the request (to end it later)."""
        self._requests += 1
        request = inference_request({"model": "m", "prompt": "x"}, request_id=f"r{self._requests}")
        request.request_size_bytes = size
        candidates = self.candidates()
        await self.producer.prepare_request_data(request, candidates)
        (target,) = [c for c in candidates if c.name == name]
        result = SchedulingResult(
            profile_results={"default": ProfileRunResult((target,))},
            primary_profile_name="default",
        )
        await self.producer.pre_request(request, result)
        return request

    async def end(self, request: object) -> None:
        await self.producer.response_body(
            request,  # type: ignore[arg-type]
            ResponseInfo(request_id="r", end_of_stream=True),
            None,
        )

    async def shown(self) -> dict[str, object]:
        """What a scorer sees on each candidate after PrepareData."""
        candidates = self.candidates()
        probe = inference_request({"model": "m", "prompt": "x"}, request_id="probe")
        await self.producer.prepare_request_data(probe, candidates)
        return {c.name: c.attributes[IN_FLIGHT_LOAD] for c in candidates}


TOKENS = 100 + 150  # a 400-byte request: 100 input tokens + round(100 * 1.5) output


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def board(clock: FakeClock) -> LoadBoard:
    return LoadBoard(lease=10.0, clock=clock)


async def test_each_process_sees_the_pools_load_on_candidates(board: LoadBoard) -> None:
    a, b = Process(board, "a"), Process(board, "b")
    await a.send("pod-1")
    await a.send("pod-1")
    await b.send("pod-1")
    await b.send("pod-2")
    pool = {"pod-1": InFlightLoad(3, 3 * TOKENS), "pod-2": InFlightLoad(1, TOKENS)}
    assert await a.shown() == pool
    assert await b.shown() == pool
    # Each publishes only its own totals.
    assert b.member.others() == {"pod-1": EndpointLoad(2, 2 * TOKENS)}


async def test_live_endpoints_show_others_load_without_a_change_of_their_own(
    board: LoadBoard,
) -> None:
    a, b = Process(board, "a"), Process(board, "b")
    await a.send("pod-2")  # a has seen a request: its refresh runs from now on
    first = await b.send("pod-1")
    await b.send("pod-1")
    # a's own load on pod-1 never changed; its live endpoint shows b's bookings at the next
    # refresh (PrepareData, PreRequest, a response, or the timer).
    await until(lambda: a.live("pod-1") == InFlightLoad(2, 2 * TOKENS))
    await b.end(first)
    await until(lambda: a.live("pod-1") == InFlightLoad(1, TOKENS))
    assert a.live("pod-2") == InFlightLoad(1, TOKENS)
    a.producer.close()
    b.producer.close()


async def test_a_process_that_stops_renewing_drops_out_after_its_lease(
    board: LoadBoard, clock: FakeClock
) -> None:
    a, b = Process(board, "a"), Process(board, "b")
    await b.send("pod-1")
    assert (await a.shown())["pod-1"] == InFlightLoad(1, TOKENS)
    clock.now += 5
    a.member.renew()
    assert (await a.shown())["pod-1"] == InFlightLoad(1, TOKENS)
    clock.now += 6  # b last wrote 11 s ago: its 10 s lease lapsed
    assert (await a.shown())["pod-1"] == InFlightLoad(0, 0)
    assert a.live("pod-1") == InFlightLoad(0, 0)
    a.producer.close()


async def test_concurrency_detector_sees_the_pool_wide_count(board: LoadBoard) -> None:
    a, b = Process(board, "a"), Process(board, "b")
    for process in (a, b):
        await process.send("pod-1")
        await process.send("pod-1")
    detector = ConcurrencyDetector(
        TypedName("concurrency-detector", "c"), ConcurrencyDetectorParameters(max_concurrency=3)
    )
    # Admission's snapshot of the live endpoints, before any PrepareData: 4 in flight on
    # pod-1 (2 + 2) against a limit of 3, once each process's refresh timer (20 ms) ran.
    await until(lambda: a.live("pod-1") == InFlightLoad(4, 4 * TOKENS))
    await until(lambda: b.live("pod-1") == InFlightLoad(4, 4 * TOKENS))
    for process in (a, b):
        (pod_1,) = [c for c in process.candidates() if c.name == "pod-1"]
        assert pod_1.attributes[IN_FLIGHT_LOAD] == InFlightLoad(4, 4 * TOKENS)
        assert detector.saturation([pod_1]) >= 1.0
        assert detector.filter(None, None, [pod_1]) == []  # type: ignore[arg-type]
    # Alone, each process's 2 would be below the limit.
    await b.member.stop()
    (pod_1,) = [c for c in a.candidates() if c.name == "pod-1"]
    await a.producer.prepare_request_data(
        inference_request({"model": "m", "prompt": "x"}, request_id="q"), [pod_1]
    )
    assert detector.saturation([pod_1]) < 1.0
    a.producer.close()
    b.producer.close()


async def test_a_deleted_endpoint_is_withdrawn_from_the_pool(board: LoadBoard) -> None:
    a, b = Process(board, "a"), Process(board, "b")
    request = await a.send("pod-1")
    assert b.member.others() == {"pod-1": EndpointLoad(1, TOKENS)}
    info = a.handle.datastore.get("pod-1")
    assert info is not None
    a.handle.datastore.apply(EndpointEvent(kind=EndpointEventKind.DELETE, endpoint=info.info))
    assert b.member.others() == {}
    await a.end(request)  # a late release publishes nothing for the deleted endpoint
    assert b.member.others() == {}
    a.producer.close()


async def test_one_process_alone_pays_no_timer() -> None:
    handle = make_handle()
    producer = InFlightLoadProducer(TypedName("inflight-load-producer", "p"), handle)
    probe = inference_request({"model": "m", "prompt": "x"}, request_id="probe")
    await producer.prepare_request_data(probe, [])
    assert producer._timer is None
    await asyncio.sleep(0)
