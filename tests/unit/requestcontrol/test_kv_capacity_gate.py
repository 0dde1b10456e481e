"""kv-capacity-gate: who goes on at once, who waits, in which order they are let in, and
that every way out (release, deadline, client gone, endpoint deleted) gives the room back."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import pytest

from domain.datalayer.attributes import PREFIX_CACHE_MATCH_INFO, PrefixCacheMatchInfo
from domain.datastore.endpoint import EndpointMetrics
from domain.plugins.base import PluginRegistry
from domain.plugins.handle import Handle
from domain.requestcontrol.interfaces import PreRequest, ResponseBodyProcessor, ResponseInfo
from domain.requestcontrol.plugins import kv_capacity_gate
from domain.requestcontrol.plugins.kv_capacity_gate import KVCapacityGate
from domain.scheduling.load import PREFIX_BLOCKS, PREFIX_BLOCKS_OWNER, PrefixBlocks
from domain.scheduling.types import (
    Candidate,
    InferenceRequest,
    ProfileRunResult,
    SchedulingResult,
)
from domain.sharedstate.load import LoadBoard
from ports.endpoints import EndpointAddress, EndpointEvent, EndpointEventKind, EndpointInfo
from ports.metric_catalogue import KV_GATE_HELD, KV_GATE_WAIT, GaugeMetric, HistogramMetric
from ports.observer import NoopObserver
from ports.shared_state import EndpointLoad
from tests.support.scheduling import inference_request
from tests.unit.requestcontrol import make_handle

#: A cache of 100 blocks of 16 tokens; each request below is 16 tokens a block.
BLOCKS = 100


def _candidate(handle: Handle, name: str = "pod-a", *, blocks: int = BLOCKS) -> Candidate:
    info = EndpointInfo(name=name, address=EndpointAddress(ip="10.0.0.1", port=8000))
    handle.datastore.apply(EndpointEvent(kind=EndpointEventKind.ADD_OR_UPDATE, endpoint=info))
    live = handle.datastore.get(name)
    assert live is not None
    live.metrics = EndpointMetrics(cache_block_size=16, cache_num_blocks=blocks)
    return Candidate(live)


def _request(rid: str, prefix: str, blocks: int) -> InferenceRequest:
    """A request whose prompt is ``blocks`` prefix blocks of group ``prefix`` (hashes that
    name the group and the block): ``blocks`` shared blocks and one of its own."""
    request = inference_request({"model": "m", "prompt": "x"}, request_id=rid)
    request.request_size_bytes = blocks * 16 * 4
    hashes = [hash((prefix, i)) for i in range(blocks)]
    request.state.put(PREFIX_BLOCKS_OWNER, PREFIX_BLOCKS, PrefixBlocks(hashes, 16))
    return request


def _result(target: Candidate, matched: int = 1) -> SchedulingResult:
    scheduled = Candidate(target.endpoint)
    scheduled.attributes[PREFIX_CACHE_MATCH_INFO] = PrefixCacheMatchInfo(matched, 60, 16)
    return SchedulingResult(
        profile_results={"default": ProfileRunResult((scheduled,))},
        primary_profile_name="default",
    )


def _end(request: InferenceRequest) -> ResponseInfo:
    return ResponseInfo(request_id=request.request_id, end_of_stream=True)


def _gate(handle: Handle, max_hold_ms: float = 10_000.0) -> KVCapacityGate:
    registry = PluginRegistry()
    kv_capacity_gate.register(registry)
    parameters = kv_capacity_gate.KVCapacityGateParameters(max_hold_ms=max_hold_ms)
    plugin = registry.create("kv-capacity-gate", "kv-capacity-gate", parameters, handle)
    assert isinstance(plugin, KVCapacityGate)
    return plugin


async def _warm(gate: KVCapacityGate, pod: Candidate, matched: int = 1, count: int = 8) -> None:
    """Pass ``count`` small requests with ``matched`` blocks cached through the gate and end
    them: the endpoint's recent hit share is then what they make it."""
    for i in range(count):
        request = _request(f"warm-{matched}-{i}", f"warm-{i}", 1)
        await asyncio.wait_for(gate.pre_request(request, _result(pod, matched)), 1)
        await gate.response_body(request, _end(request), pod.info)


async def _warmed(
    handle: Handle, max_hold_ms: float = 10_000.0
) -> tuple[KVCapacityGate, Candidate]:
    """A gate and its endpoint ``pod-a``, after requests that hit a cached prefix there (the
    gate holds only for servers that recently served cache hits)."""
    gate = _gate(handle, max_hold_ms)
    pod = _candidate(handle)
    await _warm(gate, pod)
    return gate, pod


async def _started(
    gate: KVCapacityGate, request: InferenceRequest, target: Candidate, matched: int = 1
) -> asyncio.Task[None]:
    """Start ``pre_request`` and let it run until it waits or returns."""
    task = asyncio.create_task(gate.pre_request(request, _result(target, matched)))
    for _ in range(5):
        await asyncio.sleep(0)
    return task


@pytest.fixture
def handle() -> Handle:
    return make_handle()


def test_a_pre_request_and_response_body_plugin_with_checked_parameters(handle: Handle) -> None:
    gate = _gate(handle)
    assert isinstance(gate, PreRequest)
    assert isinstance(gate, ResponseBodyProcessor)
    with pytest.raises(ValueError, match="maxHoldMs"):
        kv_capacity_gate.KVCapacityGateParameters(max_hold_ms=-1)
    with pytest.raises(ValueError, match="maxHoldMs"):
        kv_capacity_gate.KVCapacityGateParameters(max_hold_ms=float("inf"))


async def test_requests_that_fit_go_on_and_one_that_does_not_waits_for_room(
    handle: Handle,
) -> None:
    gate, pod = await _warmed(handle)
    # Group A: 60 prefix blocks + 1 own block each; the second shares the 60.
    first = _request("a1", "A", 60)
    second = _request("a2", "A", 60)
    await asyncio.wait_for(gate.pre_request(first, _result(pod)), 1)
    await asyncio.wait_for(gate.pre_request(second, _result(pod, 60)), 1)
    # Group B needs 61 new blocks: 62 + 61 > 100.
    other = _request("b1", "B", 60)
    task = await _started(gate, other, pod)
    assert not task.done()
    assert gate.held("pod-a") == 1

    await gate.response_body(first, _end(first), pod.info)
    assert not task.done(), "a2 still holds group A's 60 blocks"
    await gate.response_body(second, _end(second), pod.info)
    await asyncio.wait_for(task, 1)
    assert gate.held("pod-a") == 0


async def test_held_requests_are_let_in_longest_match_first_then_in_arrival_order(
    handle: Handle,
) -> None:
    gate, pod = await _warmed(handle)
    running = _request("b0", "B", 90)
    await gate.pre_request(running, _result(pod))
    order: list[str] = []

    async def wait(request: InferenceRequest, matched: int) -> None:
        await gate.pre_request(request, _result(pod, matched))
        order.append(request.request_id)

    cold_1 = _request("cold-1", "C", 40)
    warm = _request("warm", "D", 40)
    cold_2 = _request("cold-2", "E", 40)
    tasks = [
        asyncio.create_task(wait(cold_1, 0)),
        asyncio.create_task(wait(warm, 30)),
        asyncio.create_task(wait(cold_2, 0)),
    ]
    for _ in range(5):
        await asyncio.sleep(0)
    assert gate.held("pod-a") == 3
    # Room for two of the three (41 blocks each).
    await gate.response_body(running, _end(running), pod.info)
    await asyncio.wait_for(asyncio.gather(tasks[1], tasks[0]), 1)
    assert order == ["warm", "cold-1"]
    assert not tasks[2].done()
    await gate.response_body(warm, _end(warm), pod.info)
    await asyncio.wait_for(tasks[2], 1)
    assert order == ["warm", "cold-1", "cold-2"]


async def test_a_small_request_passes_a_held_one_that_does_not_fit(handle: Handle) -> None:
    gate, pod = await _warmed(handle)
    running = _request("a1", "A", 60)
    await gate.pre_request(running, _result(pod))
    big = _request("b1", "B", 60)
    held = await _started(gate, big, pod)
    # A request of group A needs one block of its own: it fits beside a1.
    hit = _request("a2", "A", 60)
    await asyncio.wait_for(gate.pre_request(hit, _result(pod, 60)), 1)
    assert not held.done()
    await gate.response_body(running, _end(running), pod.info)
    await gate.response_body(hit, _end(hit), pod.info)
    await asyncio.wait_for(held, 1)


async def test_a_request_waits_at_most_max_hold_then_goes_on(handle: Handle) -> None:
    gate, pod = await _warmed(handle, max_hold_ms=50)
    running = _request("a1", "A", 90)
    await gate.pre_request(running, _result(pod))
    late = _request("b1", "B", 90)
    loop = asyncio.get_running_loop()
    started = loop.time()
    await asyncio.wait_for(gate.pre_request(late, _result(pod)), 5)
    assert loop.time() - started >= 0.045
    assert gate.held("pod-a") == 0
    # It is counted: a third request waits for both to end.
    third = _request("c1", "C", 5)
    task = await _started(gate, third, pod)
    assert not task.done()
    await gate.response_body(running, _end(running), pod.info)
    assert not task.done()
    await gate.response_body(late, _end(late), pod.info)
    await asyncio.wait_for(task, 1)


async def test_max_hold_zero_never_holds(handle: Handle) -> None:
    gate = _gate(handle, max_hold_ms=0)
    pod = _candidate(handle)
    for i in range(5):
        request = _request(f"r{i}", f"G{i}", 90)
        await asyncio.wait_for(gate.pre_request(request, _result(pod)), 1)
    assert gate.held("pod-a") == 0


async def test_an_endpoint_without_a_scraped_cache_size_is_never_held_for(
    handle: Handle,
) -> None:
    gate = _gate(handle)
    pod = _candidate(handle, blocks=0)
    for i in range(3):
        request = _request(f"r{i}", f"G{i}", 500)
        await asyncio.wait_for(gate.pre_request(request, _result(pod)), 1)
    assert gate.held("pod-a") == 0


async def test_a_request_larger_than_the_cache_goes_on_alone(handle: Handle) -> None:
    gate, pod = await _warmed(handle)
    huge = _request("huge", "H", 300)
    await asyncio.wait_for(gate.pre_request(huge, _result(pod)), 1)
    small = _request("small", "S", 1)
    task = await _started(gate, small, pod)
    assert not task.done()
    await gate.response_body(huge, _end(huge), pod.info)
    await asyncio.wait_for(task, 1)


async def test_a_held_request_whose_client_leaves_takes_no_room(handle: Handle) -> None:
    gate, pod = await _warmed(handle)
    running = _request("a1", "A", 60)
    await gate.pre_request(running, _result(pod))
    gone = _request("gone", "B", 60)
    gone_task = await _started(gate, gone, pod)
    gone_task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone_task
    assert gate.held("pod-a") == 0
    # The Director still ends the stream: nothing was counted for it.
    await gate.response_body(gone, _end(gone), pod.info)
    await gate.response_body(running, _end(running), pod.info)
    # The endpoint is empty again: a request of the whole cache goes on at once.
    whole = _request("whole", "W", BLOCKS - 1)
    await asyncio.wait_for(gate.pre_request(whole, _result(pod)), 1)


async def test_a_request_let_in_as_its_client_leaves_gives_its_room_back(
    handle: Handle,
) -> None:
    gate, pod = await _warmed(handle)
    running = _request("a1", "A", 60)
    await gate.pre_request(running, _result(pod))
    leaving = _request("leaving", "B", 60)
    leaving_task = await _started(gate, leaving, pod)
    waiting = _request("waiting", "C", 60)
    waiting_task = await _started(gate, waiting, pod)
    # The release lets "leaving" in; its client goes before its task resumes.
    await gate.response_body(running, _end(running), pod.info)
    leaving_task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leaving_task
    await asyncio.wait_for(waiting_task, 1)


async def test_deleting_the_endpoint_lets_its_held_requests_go(handle: Handle) -> None:
    gate, pod = await _warmed(handle)
    running = _request("a1", "A", 90)
    await gate.pre_request(running, _result(pod))
    held = _request("b1", "B", 90)
    task = await _started(gate, held, pod)
    handle.datastore.apply(EndpointEvent(kind=EndpointEventKind.DELETE, endpoint=pod.info))
    await asyncio.wait_for(task, 1)
    await gate.response_body(held, _end(held), pod.info)
    await gate.response_body(running, _end(running), pod.info)


async def test_every_end_releases_once(handle: Handle) -> None:
    gate, pod = await _warmed(handle)
    first = _request("a1", "A", 60)
    await gate.pre_request(first, _result(pod))
    for _ in range(3):  # a repeated end (close() after the last chunk) changes nothing
        await gate.response_body(first, _end(first), pod.info)
    second = _request("b1", "B", 60)
    third = _request("c1", "C", 60)
    await asyncio.wait_for(gate.pre_request(second, _result(pod)), 1)
    task = await _started(gate, third, pod)
    assert not task.done(), "the repeated ends must not have freed second's room"
    await gate.response_body(second, _end(second), pod.info)
    await asyncio.wait_for(task, 1)


async def test_a_request_without_prefix_blocks_counts_its_whole_prompt(handle: Handle) -> None:
    gate, pod = await _warmed(handle)
    plain = inference_request({"model": "m", "prompt": "x"}, request_id="plain")
    plain.request_size_bytes = 60 * 16 * 4  # 60 blocks of tokens, no prefix producer
    await gate.pre_request(plain, _result(pod))
    other = inference_request({"model": "m", "prompt": "y"}, request_id="other")
    other.request_size_bytes = 60 * 16 * 4
    task = await _started(gate, other, pod)
    assert not task.done()
    await gate.response_body(plain, _end(plain), pod.info)
    await asyncio.wait_for(task, 1)


class _Recorder(NoopObserver):
    """Keeps the gauge's last value and the histogram's observations."""

    def __init__(self) -> None:
        self.gauges: dict[str, float] = {}
        self.waits: list[tuple[str, float]] = []

    def gauge(self, metric: GaugeMetric, labels: Mapping[str, str], value: float) -> None:
        self.gauges[metric.name] = value

    def histogram(self, metric: HistogramMetric, labels: Mapping[str, str], value: float) -> None:
        if metric is KV_GATE_WAIT:
            self.waits.append((labels["outcome"], value))


async def test_metrics_show_the_held_requests_and_how_each_wait_ended(handle: Handle) -> None:
    recorder = _Recorder()
    handle.observer = recorder
    gate, pod = await _warmed(handle, max_hold_ms=50)
    running = _request("a1", "A", 90)
    await gate.pre_request(running, _result(pod))
    assert recorder.waits == [], "a request that goes on at once did not wait"
    released = await _started(gate, _request("b1", "B", 90), pod)
    gone = await _started(gate, _request("c1", "C", 90), pod)
    assert recorder.gauges[KV_GATE_HELD.name] == 2
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    await gate.response_body(running, _end(running), pod.info)
    await asyncio.wait_for(released, 1)
    late = await _started(gate, _request("d1", "D", 90), pod)
    await asyncio.wait_for(late, 5)
    assert recorder.gauges[KV_GATE_HELD.name] == 0
    assert [outcome for outcome, _ in recorder.waits] == ["gone", "let_in", "deadline"]
    assert recorder.waits[-1][1] >= 0.045


async def test_traffic_without_cache_hits_is_never_held(handle: Handle) -> None:
    gate = _gate(handle)
    pod = _candidate(handle)
    # Prompts that share nothing: each matches no cached prefix, so holding one would let
    # nothing pass it; the server's own queue serves them in the same order, sooner.
    for i in range(5):
        request = _request(f"r{i}", f"G{i}", 90)
        await asyncio.wait_for(gate.pre_request(request, _result(pod, matched=0)), 1)
    assert gate.held("pod-a") == 0


async def test_held_requests_go_on_once_the_hits_stop(handle: Handle) -> None:
    gate, pod = await _warmed(handle)
    running = _request("a1", "A", 90)
    await gate.pre_request(running, _result(pod))
    held = await _started(gate, _request("b1", "B", 90), pod)
    assert not held.done()
    # Then only misses come: once the recent hit share falls under MIN_HIT_SHARE, the
    # gate stops holding and lets the held request go with them.
    weight = kv_capacity_gate.HIT_SHARE_WEIGHT
    share = 1 - (1 - weight) ** 10  # the warm-up's 8 hits, a1 and b1
    misses = 0
    while share >= kv_capacity_gate.MIN_HIT_SHARE:
        assert not held.done(), f"let in after {misses} misses, before the share fell"
        miss = _request(f"m{misses}", f"M{misses}", 1)
        await asyncio.wait_for(gate.pre_request(miss, _result(pod, matched=0)), 1)
        await gate.response_body(miss, _end(miss), pod.info)
        share -= share * weight
        misses += 1
    await asyncio.wait_for(held, 1)
    assert gate.held("pod-a") == 0


async def test_other_processes_load_counts_and_their_ends_let_held_requests_in(
    handle: Handle,
) -> None:
    board = LoadBoard()
    handle.shared_load = board.member("this")
    other = board.member("other")
    gate, pod = await _warmed(handle)
    # Another EPP process has a request of 90 uncached blocks in flight on the server.
    other.publish("pod-a", EndpointLoad(requests=1, tokens=90 * 16))
    task = await _started(gate, _request("b1", "B", 60), pod)
    assert not task.done(), "nothing of this process's runs there, but the server is full"
    # That request ends; nothing of this process ends, yet the held one goes on.
    other.publish("pod-a", EndpointLoad())
    await asyncio.wait_for(task, 1)
    assert gate.held("pod-a") == 0


def _pooled(board: LoadBoard, name: str) -> Handle:
    """The handle of process ``name`` of a pool that shares its KV blocks on ``board``."""
    handle = make_handle()
    member = board.member(name)
    handle.shared_load = member
    handle.shared_kv_blocks = member
    return handle


async def test_a_prefix_another_process_holds_counts_once() -> None:
    board = LoadBoard()
    here, there = _pooled(board, "this"), _pooled(board, "other")
    gate, pod = await _warmed(here)
    other_gate, other_pod = await _warmed(there)
    # The other process runs a request on prefix A (60 blocks + 1) on the server.
    running = _request("a1", "A", 60)
    await asyncio.wait_for(other_gate.pre_request(running, _result(other_pod)), 1)
    # Another request on A fits beside it: the server holds A's blocks once.
    same = _request("a2", "A", 60)
    await asyncio.wait_for(gate.pre_request(same, _result(pod)), 1)
    # A request on a new prefix of 60 blocks does not fit beside A's 60 + 2.
    new = await _started(gate, _request("b1", "B", 60), pod)
    assert not new.done()
    assert gate.held("pod-a") == 1
    # This process's A request ends; the other's still holds A's 61 blocks: B waits.
    await gate.response_body(same, _end(same), pod.info)
    for _ in range(5):
        await asyncio.sleep(0)
    assert gate.held("pod-a") == 1
    # The other process's ends too: B goes on.
    await other_gate.response_body(running, _end(running), other_pod.info)
    await asyncio.wait_for(new, 1)
    assert gate.held("pod-a") == 0


async def test_the_other_process_ends_let_held_requests_in() -> None:
    board = LoadBoard()
    here, there = _pooled(board, "this"), _pooled(board, "other")
    gate, pod = await _warmed(here)
    other_gate, other_pod = await _warmed(there)
    running = _request("a1", "A", 90)
    await asyncio.wait_for(other_gate.pre_request(running, _result(other_pod)), 1)
    task = await _started(gate, _request("b1", "B", 60), pod)
    assert not task.done(), "nothing of this process runs there, but the server is full"
    await other_gate.response_body(running, _end(running), other_pod.info)
    await asyncio.wait_for(task, 1)  # seen at the gate's next look, without a release here
    assert gate.held("pod-a") == 0
