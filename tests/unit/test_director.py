"""The Director on its own: the request-control order and the response hooks (domain only)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import pytest

from domain.datastore.objectives import ObjectiveStore
from domain.datastore.store import Datastore
from domain.plugins.state import RequestStates
from domain.requestcontrol.candidates import locate
from domain.requestcontrol.director import Director, RequestControl
from domain.requestcontrol.interfaces import ResponseInfo
from domain.requesthandling.jsoncodec import StdlibJsonCodec
from domain.requesthandling.openai import OpenAIParser, ParsedRequest
from domain.scheduling.interfaces import CycleState, ProfileT
from domain.scheduling.profile import SchedulerProfile, WeightedScorer
from domain.scheduling.scheduler import Scheduler
from domain.scheduling.types import (
    Candidate,
    InferenceRequest,
    ProfileRunResult,
    SchedulingResult,
    ScoredCandidate,
)
from ports.endpoints import EndpointAddress, EndpointEvent, EndpointEventKind, EndpointInfo
from ports.errors import ErrorCode
from ports.objectives import ModelRewriteRule, ModelRewriteTarget
from ports.plugins import TypedName
from ports.requests import InboundRequest

CODEC = StdlibJsonCodec()


def _info(ip: str, port: int = 8000) -> EndpointInfo:
    address = EndpointAddress(ip=ip, port=port)
    return EndpointInfo(name=address.host_port(), address=address)


INFOS = (_info("10.0.0.1"), _info("10.0.0.2"), _info("fd00::3"))


class Parser:
    typed_name = TypedName("openai-parser", "openai-parser")

    def __init__(self) -> None:
        self._parser = OpenAIParser(CODEC)

    def parse(self, body: bytes, headers: Mapping[str, str]) -> ParsedRequest:
        return self._parser.parse(body, headers)


class FirstPicker:
    """Picks the best-scored candidates (stable: first on ties)."""

    typed_name = TypedName("first-picker", "first-picker")

    def __init__(self, count: int = 1) -> None:
        self.count = count

    def pick(
        self, cycle: CycleState, request: InferenceRequest, scored: Sequence[ScoredCandidate]
    ) -> ProfileRunResult:
        ordered = sorted(scored, key=lambda s: -s.score)
        return ProfileRunResult(tuple(s.candidate for s in ordered[: self.count]))


class PreferScorer:
    typed_name = TypedName("prefer", "prefer")
    category = "Affinity"

    def __init__(self, ip: str) -> None:
        self.ip = ip

    def score(
        self, cycle: CycleState, request: InferenceRequest, candidates: Sequence[Candidate]
    ) -> Sequence[float]:
        return [1.0 if c.info.address.ip == self.ip else 0.0 for c in candidates]


class SingleHandler:
    typed_name = TypedName("single-profile-handler", "single-profile-handler")

    def pick_profiles(
        self,
        request: InferenceRequest,
        profiles: Mapping[str, ProfileT],
        results: Mapping[str, ProfileRunResult | None],
    ) -> Mapping[str, ProfileT]:
        return {} if results else profiles

    def process_results(
        self, request: InferenceRequest, results: Mapping[str, ProfileRunResult | None]
    ) -> SchedulingResult:
        return SchedulingResult(profile_results=results, primary_profile_name="default")


class Saturation:
    typed_name = TypedName("fixed-saturation", "fixed-saturation")

    def __init__(self, value: float) -> None:
        self.value = value

    def saturation(self, candidates: Sequence[Candidate]) -> float:
        return self.value


@dataclass
class Recorder:
    """A plugin at every request-control extension point, recording what it sees."""

    typed_name: TypedName = field(default_factory=lambda: TypedName("recorder", "recorder"))
    calls: list[str] = field(default_factory=list)
    responses: list[ResponseInfo] = field(default_factory=list)
    deny: str | None = None
    raise_in_producer: bool = False
    block_producer: bool = False
    #: ``claim_placement`` moves the pick to this address's candidate.
    claim_to: str | None = None
    seen: list[Candidate] = field(default_factory=list)

    def produces(self) -> Sequence[str]:
        return ["Seen"]

    def consumes(self) -> Sequence[str]:
        return []

    async def prepare_request_data(
        self, request: InferenceRequest, candidates: Sequence[Candidate]
    ) -> None:
        self.calls.append(f"prepare:{len(candidates)}")
        if self.raise_in_producer:
            raise RuntimeError("producer broke")
        if self.block_producer:
            await asyncio.Event().wait()
        self.seen = list(candidates)
        for c in candidates:
            c.attributes["Seen"] = True

    async def admit_request(
        self, request: InferenceRequest, candidates: Sequence[Candidate]
    ) -> str | None:
        self.calls.append("admit")
        return self.deny

    async def claim_placement(
        self, request: InferenceRequest, result: SchedulingResult
    ) -> Candidate | None:
        assert result.primary is not None
        self.calls.append(f"claim:{result.primary.target_endpoints[0].info.address.ip}")
        return next((c for c in self.seen if c.info.address.ip == self.claim_to), None)

    async def pre_request(self, request: InferenceRequest, result: SchedulingResult) -> None:
        assert result.primary is not None
        self.calls.append(f"pre:{result.primary.target_endpoints[0].info.address.ip}")

    async def response_header(
        self, request: InferenceRequest, response: ResponseInfo, target: EndpointInfo | None
    ) -> None:
        self.calls.append(f"header:{response.status}")

    async def response_body(
        self, request: InferenceRequest, response: ResponseInfo, target: EndpointInfo | None
    ) -> None:
        self.calls.append(
            f"body:{response.start_of_stream}:{response.end_of_stream}:{response.outcome.value}"
        )
        if response.end_of_stream:
            response.dynamic_metadata["envoy.lb"] = {"tokens": 7}


def _director(
    *,
    infos: Sequence[EndpointInfo] = INFOS,
    recorder: Recorder | None = None,
    saturation: float = 0.0,
    prefer: str = "10.0.0.2",
    objectives: ObjectiveStore | None = None,
    picks: int = 1,
    timeout: float = 0.4,
) -> tuple[Director, Datastore, RequestStates]:
    store = Datastore()
    for info in infos:
        store.apply(EndpointEvent(kind=EndpointEventKind.ADD_OR_UPDATE, endpoint=info))
    store.mark_synced()
    profile = SchedulerProfile(
        "default",
        scorers=[_weighted(PreferScorer(prefer))],
        picker=FirstPicker(picks),
    )
    rec = recorder or Recorder()
    states = RequestStates()
    control = RequestControl(
        parser=Parser(),
        scheduler=Scheduler(SingleHandler(), {"default": profile}),
        saturation_detector=Saturation(saturation),
        data_producers=[rec],
        admitters=[rec],
        placement_claimers=[rec],
        pre_request=[rec],
        response_header=[rec],
        response_body=[rec],
        prepare_data_timeout=timeout,
    )
    director = Director(
        datastore=store,
        codec=CODEC,
        control=control,
        objectives=objectives,
        states=states,
        rng=random.Random(1),
    )
    return director, store, states


def _weighted(scorer: PreferScorer) -> WeightedScorer:
    return WeightedScorer(scorer, 1.0)


def _request(
    body: bytes | None, metadata: Mapping[str, Mapping[str, object]] | None = None, **headers: str
) -> InboundRequest:
    all_headers = {":path": "/v1/completions", "x-request-id": "r-1"}
    all_headers.update({k.replace("_", "-"): v for k, v in headers.items()})
    return InboundRequest(request_id="r-1", headers=all_headers, body=body, metadata=metadata or {})


BODY = b'{"model": "m", "prompt": "hello"}'


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
    _, store, _ = _director()
    endpoints = store.endpoints()
    metadata: dict[str, dict[str, object]] = {}
    if hint is not None:
        metadata["envoy.lb.subset_hint"] = {"x-gateway-destination-endpoint-subset": hint}
    assert [e.info.address.ip for e in locate(endpoints, metadata)] == expected
    assert list(locate(endpoints, metadata, subset_filter=False)) == list(endpoints)


async def test_the_request_control_order_and_the_decision() -> None:
    recorder = Recorder()
    director, _, states = _director(recorder=recorder)
    exchange = director.open(_request(BODY))
    decision = await exchange.route()
    assert decision.error is None
    assert [e.ip for e in decision.endpoints] == ["10.0.0.2"]
    assert decision.body is BODY  # not rewritten: forwarded as received
    assert recorder.calls == ["prepare:3", "admit", "claim:10.0.0.2", "pre:10.0.0.2"]
    assert len(states) == 1

    await exchange.response_headers({":status": "200", "content-type": "application/json"}, {})
    reply = await exchange.response_body(b'{"model":"m","usage":{"prompt_tokens":3}}', True)
    assert reply.dynamic_metadata == {"envoy.lb": {"tokens": 7}}
    await exchange.close()
    assert recorder.calls[4:] == ["header:200", "body:True:True:completed"]
    assert len(states) == 0  # request state released with the stream


async def test_fallbacks_come_in_order() -> None:
    director, _, _ = _director(picks=3, prefer="fd00::3")
    decision = await director.open(_request(BODY)).route()
    assert decision.endpoints[0].ip == "fd00::3"
    assert len(decision.endpoints) == 3
    assert len({e.ip for e in decision.endpoints}) == 3


async def test_a_placement_claim_moves_the_pick_first_and_keeps_the_others_as_fallbacks() -> None:
    recorder = Recorder(claim_to="fd00::3")
    director, _, _ = _director(recorder=recorder, picks=2, prefer="10.0.0.2")
    decision = await director.open(_request(BODY)).route()
    assert decision.error is None
    assert [e.ip for e in decision.endpoints][:2] == ["fd00::3", "10.0.0.2"]
    assert len({e.ip for e in decision.endpoints}) == len(decision.endpoints)
    assert recorder.calls[-2:] == ["claim:10.0.0.2", "pre:fd00::3"]  # PreRequest sees the move


async def test_a_denying_admitter_is_a_500() -> None:
    director, _, _ = _director(recorder=Recorder(deny="too big"))
    decision = await director.open(_request(BODY)).route()
    assert decision.error is not None
    assert decision.error.code is ErrorCode.INTERNAL
    assert decision.error.message == "request cannot be admitted"


async def test_a_failing_producer_is_skipped() -> None:
    recorder = Recorder(raise_in_producer=True)
    director, _, _ = _director(recorder=recorder)
    decision = await director.open(_request(BODY)).route()
    assert decision.error is None
    assert "admit" in recorder.calls


async def test_producers_are_cut_off_by_the_timeout() -> None:
    recorder = Recorder(block_producer=True)
    director, _, _ = _director(recorder=recorder, timeout=0.05)
    decision = await asyncio.wait_for(director.open(_request(BODY)).route(), 5)
    assert decision.error is None
    assert recorder.calls[:2] == ["prepare:3", "admit"]


@pytest.mark.parametrize(
    ("priority", "saturation", "refused"), [(-1, 1.0, True), (-1, 0.99, False), (0, 5.0, False)]
)
async def test_legacy_admission_sheds_only_sheddable_requests_on_a_saturated_pool(
    priority: int, saturation: float, refused: bool
) -> None:
    objectives = ObjectiveStore()
    objectives.set_objectives({"batch": priority})
    director, _, _ = _director(saturation=saturation, objectives=objectives)
    decision = await director.open(_request(BODY, x_gateway_inference_objective="batch")).route()
    if refused:
        assert decision.error is not None
        assert decision.error.code is ErrorCode.RESOURCE_EXHAUSTED
        assert decision.error.message == "system saturated, sheddable request dropped"
    else:
        assert decision.error is None


async def test_model_rewrite_by_header_and_back() -> None:
    director, _, _ = _director()
    exchange = director.open(
        _request(b'{"prompt": "x", "model": "public"}', x_gateway_model_name_rewrite="internal")
    )
    decision = await exchange.route()
    assert decision.body == b'{"model":"internal","prompt":"x"}'
    await exchange.response_headers({":status": "200", "content-type": "application/json"}, {})
    reply = await exchange.response_body(b'{"model":"internal","usage":{}}', True)
    assert reply.body == b'{"model":"public","usage":{}}'


async def test_model_rewrite_rules_pick_weighted_targets() -> None:
    objectives = ObjectiveStore()
    objectives.set_rules(
        [
            ModelRewriteRule(
                name="canary",
                match="public",
                targets=(
                    ModelRewriteTarget(model="v1", weight=0),
                    ModelRewriteTarget(model="v2", weight=10),
                ),
            )
        ]
    )
    director, _, _ = _director(objectives=objectives)
    decision = await director.open(_request(b'{"model": "public", "prompt": "x"}')).route()
    assert decision.body == b'{"model":"v2","prompt":"x"}'


async def test_streamed_responses_run_hooks_per_chunk_and_rewrite_back() -> None:
    recorder = Recorder()
    director, _, _ = _director(recorder=recorder)
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
    chunks = [stream[i : i + 40] for i in range(0, len(stream), 40)]
    for i, chunk in enumerate(chunks):
        echoed = await exchange.response_body(chunk, i == len(chunks) - 1)
        assert echoed.body == chunk
    body_calls = [c for c in recorder.calls if c.startswith("body:")]
    assert body_calls[0] == "body:True:False:pending"
    assert body_calls[-1] == "body:False:True:completed"
    assert len(body_calls) == len(chunks)
    await exchange.close()
    assert len([c for c in recorder.calls if c.startswith("body:")]) == len(chunks)


async def test_the_final_hook_hears_a_client_that_went_away() -> None:
    recorder = Recorder()
    director, _, states = _director(recorder=recorder)
    exchange = director.open(_request(BODY))
    await exchange.route()
    await exchange.close()
    await exchange.close()  # idempotent
    assert recorder.calls[-1] == "body:True:True:client-gone"
    assert len(states) == 0


async def test_an_error_status_is_a_failed_outcome() -> None:
    recorder = Recorder()
    director, _, _ = _director(recorder=recorder)
    exchange = director.open(_request(BODY))
    await exchange.route()
    await exchange.response_headers({":status": "500", "content-type": "application/json"}, {})
    await exchange.response_body(b"{}", True)
    assert recorder.calls[-1] == "body:True:True:failed"


@pytest.mark.parametrize(
    ("body", "code", "message"),
    [
        (b"not json", ErrorCode.BAD_REQUEST, ""),
        (b'{"prompt": "x"}', ErrorCode.BAD_REQUEST, "model not found in request body"),
    ],
)
async def test_bad_bodies(body: bytes, code: ErrorCode, message: str) -> None:
    recorder = Recorder()
    director, _, states = _director(recorder=recorder)
    exchange = director.open(_request(body))
    decision = await exchange.route()
    assert decision.error is not None
    assert decision.error.code is code
    assert message in decision.error.message
    assert recorder.calls == []
    await exchange.close()
    assert len(states) == 0


async def test_no_candidates_is_service_unavailable() -> None:
    director, _, _ = _director(infos=())
    decision = await director.open(_request(BODY)).route()
    assert decision.error is not None
    assert decision.error.code is ErrorCode.SERVICE_UNAVAILABLE
    assert decision.error.message == "failed to find endpoint candidates for serving the request"


async def test_headers_only_request() -> None:
    director, store, _ = _director()
    decision = await director.open(_request(None)).route()
    assert decision.endpoints[0] in {i.address for i in INFOS}
    for endpoint in store.endpoints():  # the pool emptied
        store.apply(EndpointEvent(kind=EndpointEventKind.DELETE, endpoint=endpoint.info))
    decision = await director.open(_request(None)).route()
    assert decision.error is not None
    assert decision.error.code is ErrorCode.INTERNAL
    assert decision.error.message == "no pods available in datastore"


def test_datastore_events_snapshots_and_listeners() -> None:
    store = Datastore()
    seen: list[tuple[EndpointEventKind, str]] = []
    store.subscribe(lambda event, endpoint: seen.append((event.kind, endpoint.name)))
    info = INFOS[0]
    store.apply(EndpointEvent(kind=EndpointEventKind.ADD_OR_UPDATE, endpoint=info))
    snapshot = store.endpoints()
    store.apply(EndpointEvent(kind=EndpointEventKind.ADD_OR_UPDATE, endpoint=info))
    assert store.endpoints() is snapshot  # no change, no new snapshot, no event
    store.apply(EndpointEvent(kind=EndpointEventKind.DELETE, endpoint=info))
    assert store.endpoints() == ()
    assert [e.name for e in snapshot] == [info.name]
    assert seen == [
        (EndpointEventKind.ADD_OR_UPDATE, info.name),
        (EndpointEventKind.DELETE, info.name),
    ]
    assert not store.synced
    store.mark_synced()
    assert store.synced


def test_readiness_waits_for_the_start_up_gates_once() -> None:
    director, store, _ = _director()
    warm = [False]
    director.startup_gates = [lambda: warm[0]]
    assert not director.ready()  # synced, but an index still loads its shared copy
    warm[0] = True
    assert director.ready()
    warm[0] = False  # e.g. a new endpoint loading later: readiness no longer waits
    assert director.ready()
    store.mark_unsynced()
    assert not director.ready()


class _EndsOnly(Recorder):
    """A body hook that needs a response's start and end only."""

    reads_response_chunks = False


async def test_a_hook_that_reads_no_chunks_gets_the_first_and_the_end() -> None:
    recorder = _EndsOnly()
    director, _, _ = _director(recorder=recorder)
    exchange = director.open(_request(b'{"model": "m", "prompt": "x", "stream": true}'))
    await exchange.route()
    await exchange.response_headers({":status": "200", "content-type": "text/event-stream"}, {})
    for i in range(5):
        await exchange.response_body(b'data: {"choices":[{"text":"a"}]}\n\n', i == 4)
    await exchange.close()
    body_calls = [c for c in recorder.calls if c.startswith("body:")]
    assert body_calls == ["body:True:False:pending", "body:False:True:completed"]


async def test_a_response_that_ended_unseen_completes_without_usage() -> None:
    recorder = Recorder()
    director, _, states = _director(recorder=recorder)
    exchange = director.open(_request(b'{"model": "m", "prompt": "x", "stream": true}'))
    await exchange.route()
    await exchange.response_headers({":status": "200", "content-type": "text/event-stream"}, {})
    await exchange.response_ended()
    await exchange.response_ended()  # once only
    await exchange.close()
    assert recorder.calls[-1] == "body:True:True:completed"
    assert len([c for c in recorder.calls if c.startswith("body:")]) == 1
    assert director.running("m") == 0
    assert len(states) == 0
