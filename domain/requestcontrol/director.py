"""The Director: one request's way from parsed body to routing decision, and back.

Routing runs in named steps (as the reference orders them):

1. ``_parse_and_rewrite``: parse the body with the parser plugin, apply the model rewrite
   (header or InferenceModelRewrite);
2. ``_build_request``: the ``InferenceRequest`` plugins see (objective, priority, fairness);
3. ``_admit``: admission (legacy shedding, or flow control's queues) returns the
   candidates to schedule on (after the gateway's subset hint);
4. ``_schedule``: PrepareData producers, admitters, then the scheduler's profiles;
5. ``_decide``: PreRequest hooks, then the ``RoutingDecision`` (endpoints, body, headers).

On the response path: ResponseHeader hooks, then ResponseBody hooks per chunk in order, the
end-of-stream call last, always made once (``close`` makes it for a client that went
away). Request metrics are recorded by ``RequestMetrics``. Routing is the span
``gateway.request_orchestration`` (child of the gateway's span), with children for flow
control's wait, the data producers, scheduling and the PreRequest hooks; its trace context
goes upstream in the request headers (``traceparent``, ``tracestate``, ``baggage``).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from domain.datastore.objectives import ObjectiveStore
from domain.datastore.store import Datastore
from domain.errors import (
    BadRequestError,
    EppError,
    InternalError,
    ResourceExhaustedError,
    ServiceUnavailableError,
)
from domain.plugins.state import RequestStates
from domain.requestcontrol.admission import Admission, LegacyAdmission
from domain.requestcontrol.candidates import locate
from domain.requestcontrol.interfaces import (
    Admitter,
    DataProducer,
    Parser,
    PlacementClaimer,
    PreRequest,
    ResponseBodyProcessor,
    ResponseHeaderProcessor,
    ResponseInfo,
    ResponseOutcome,
    SaturationDetector,
)
from domain.requestcontrol.metrics import RequestMetrics
from domain.requesthandling.openai import ParsedRequest, rewrite_model
from domain.requesthandling.usage import SseUsageScanner, rewrite_model_back, usage_from_body
from domain.scheduling.scheduler import Scheduler
from domain.scheduling.types import (
    Candidate,
    InferenceRequest,
    ProfileRunResult,
    SchedulingResult,
)
from ports.codec import JsonCodec
from ports.endpoints import EndpointInfo
from ports.errors import ErrorCode
from ports.observer import NoopObserver, NoopSpan, Observer, Span
from ports.requests import (
    InboundRequest,
    Metadata,
    ResponseBodyReply,
    ResponseHeadersReply,
    RoutingDecision,
)

__all__ = ["Director", "RequestControl", "RequestExchangeState"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

MODEL_REWRITE_HEADER = "x-gateway-model-name-rewrite"
OBJECTIVE_HEADER = "x-gateway-inference-objective"
FAIRNESS_HEADER = "x-gateway-inference-fairness-id"
PREFILLER_HEADER = "x-prefiller-host-port"
PREFILL_PROFILE = "prefill"
DEFAULT_FAIRNESS_ID = "default-flow"
DECISION_HEADER = "x-epp-decision"
#: The ``envoy.lb`` key of the per-endpoint scores (``--emit-endpoint-scores``).
ENDPOINT_SCORES_KEY = "x-gateway-destination-endpoint-scores"
LB_METADATA_NAMESPACE = "envoy.lb"

ORCHESTRATION_SPAN = "gateway.request_orchestration"
PREPARE_DATA_SPAN = "gateway.prepare_data"
PRE_REQUEST_SPAN = "gateway.pre_request"
_NO_MODEL = {
    "model_name": "",
    "target_model_name": "",
    "fairness_id": DEFAULT_FAIRNESS_ID,
    "priority": "0",
}


@dataclass(slots=True, kw_only=True)
class RequestControl:
    """The plugins the Director runs, by extension point, in order."""

    parser: Parser
    scheduler: Scheduler
    saturation_detector: SaturationDetector
    data_producers: Sequence[DataProducer] = ()
    admitters: Sequence[Admitter] = ()
    placement_claimers: Sequence[PlacementClaimer] = ()
    pre_request: Sequence[PreRequest] = ()
    response_header: Sequence[ResponseHeaderProcessor] = ()
    response_body: Sequence[ResponseBodyProcessor] = ()
    prepare_data_timeout: float = 0.4
    subset_filter: bool = True
    explain_decisions: bool = False
    #: Put the primary profile's scores in ``envoy.lb`` (``ENDPOINT_SCORES_KEY``).
    emit_endpoint_scores: bool = False
    #: Legacy admission (shed sheddable requests when saturated) unless flow control is on.
    admission: Admission | None = None
    #: The ``response_body`` hooks called with every chunk; the others (which declare
    #: ``reads_response_chunks = False``) get a response's first chunk and its end only.
    chunk_readers: Sequence[ResponseBodyProcessor] = field(init=False, default=())

    def __post_init__(self) -> None:
        if self.admission is None:
            self.admission = LegacyAdmission(self.saturation_detector)
        self.chunk_readers = tuple(
            hook for hook in self.response_body if getattr(hook, "reads_response_chunks", True)
        )


class Director:
    """The ``RequestProcessor``: opens one ``RequestExchangeState`` per gateway stream."""

    def __init__(
        self,
        *,
        datastore: Datastore,
        codec: JsonCodec,
        control: RequestControl,
        objectives: ObjectiveStore | None = None,
        states: RequestStates | None = None,
        rng: random.Random | None = None,
        observer: Observer | None = None,
    ) -> None:
        self.datastore = datastore
        self.codec = codec
        self.control = control
        self.objectives = objectives if objectives is not None else ObjectiveStore()
        self.states = states if states is not None else RequestStates()
        self.rng = rng if rng is not None else random.Random()
        self.observer: Observer = observer if observer is not None else NoopObserver()
        self.metrics = RequestMetrics(self.observer)
        #: Start-up readiness gates besides the endpoint set (``BackgroundPlugin.ready``):
        #: once they all passed with the set synced, they are dropped (readiness never
        #: waits for them again, e.g. after a config reload).
        self.startup_gates: list[Callable[[], bool]] = []

    def open(self, request: InboundRequest) -> RequestExchangeState:
        return RequestExchangeState(self, request)

    def ready(self) -> bool:
        if not self.datastore.synced:
            return False
        if self.startup_gates:
            if not all(gate() for gate in self.startup_gates):
                return False
            self.startup_gates = []
        return True

    def running(self, model: str) -> int:
        """Requests for ``model`` (as the client named it) routed and not yet closed."""
        return self.metrics.running(model)


class RequestExchangeState:
    """The domain's state for one request/response exchange (a ``RequestExchange``)."""

    __slots__ = (
        "_admitted",
        "_closed",
        "_control",
        "_director",
        "_final_done",
        "_labels",
        "_received_at",
        "_response",
        "_response_bytes",
        "_running",
        "_scanner",
        "_started",
        "inbound",
        "parsed",
        "request",
        "streaming",
        "target",
    )

    def __init__(self, director: Director, inbound: InboundRequest) -> None:
        self._director = director
        # The plugins of the config this request started under, whatever a reload swaps in
        # meanwhile (``--watch-config-file``): one request never mixes two configs.
        self._control = director.control
        self.inbound = inbound
        self.parsed: ParsedRequest | None = None
        self.request: InferenceRequest | None = None
        self.target: EndpointInfo | None = None
        self.streaming = False
        self._response: ResponseInfo | None = None
        self._scanner: SseUsageScanner | None = None
        self._started = False
        self._final_done = False
        self._closed = False
        self._labels: dict[str, str] = _NO_MODEL
        self._received_at = 0.0
        self._admitted = False
        self._response_bytes = 0
        self._running = False

    # request path

    async def route(self) -> RoutingDecision:
        self._received_at = time.monotonic()
        span = self._director.observer.start_span(ORCHESTRATION_SPAN, parent=self.inbound.span)
        try:
            return await self._route(span)
        except EppError as exc:
            error = exc.to_request_error()
            span.record_error(error.message)
            self._director.metrics.failed(self._labels, error.code)
            return RoutingDecision(error=error)
        finally:
            span.end()

    async def _route(self, span: Span) -> RoutingDecision:
        received = self.inbound.body
        if received is None:
            return self._route_without_body()
        parsed, body = self._parse_and_rewrite(received)
        request = self._build_request(parsed, len(received), span)
        candidates = await self._admit(request, span)
        result = await self._schedule(request, candidates, span)
        return await self._decide(request, result, body, span)

    def _route_without_body(self) -> RoutingDecision:
        """A request with no body (``GET /v1/models``) goes to a random endpoint."""
        endpoints = self._director.datastore.endpoints()
        if not endpoints:
            raise InternalError("no pods available in datastore")
        chosen = self._director.rng.choice(endpoints)
        self.target = chosen.info
        return RoutingDecision(endpoints=(chosen.info.address,))

    def _parse_and_rewrite(self, body: bytes) -> tuple[ParsedRequest, bytes]:
        """Parses the body and applies the model rewrite; returns the parsed body and the
        bytes to send on."""
        d = self._director
        headers = self.inbound.headers
        parsed = self._control.parser.parse(body, headers)
        self.parsed = parsed
        incoming = target_model = parsed.model
        if not parsed.opaque:
            if not incoming:
                raise BadRequestError("model not found in request body")
            target_model = headers.get(MODEL_REWRITE_HEADER) or incoming
            rewrite = d.objectives.rewrite(incoming, d.rng)
            if rewrite is not None:
                target_model = rewrite[1]
                d.metrics.rewritten(rewrite[0], incoming, target_model)
            if target_model != incoming:
                body = rewrite_model(parsed, target_model, d.codec)
        self._labels = {
            "model_name": incoming,
            "target_model_name": target_model,
            "fairness_id": headers.get(FAIRNESS_HEADER) or DEFAULT_FAIRNESS_ID,
            "priority": "0",
        }
        return parsed, body

    def _build_request(self, parsed: ParsedRequest, size: int, span: Span) -> InferenceRequest:
        d = self._director
        inbound = self.inbound
        headers = inbound.headers
        objective = headers.get(OBJECTIVE_HEADER, "")
        request = InferenceRequest(
            request_id=inbound.request_id,
            target_model=self._labels["target_model_name"],
            incoming_model=parsed.model,
            body=parsed,
            headers=headers,
            priority=d.objectives.priority_of(objective),
            request_size_bytes=size,
            state=d.states.create(inbound.request_id),
            objective=objective,
            fairness_id=self._labels["fairness_id"],
            received_at=self._received_at,
            span=inbound.span,
        )
        self._labels["priority"] = str(request.priority)
        if self._control.explain_decisions:
            request.explanations = {}
        if d.control.emit_endpoint_scores:
            request.profile_scores = {}
        self.request = request
        span.set_attribute("target_model", request.target_model)
        span.set_attribute("request_prio", request.priority)
        return request

    async def _admit(self, request: InferenceRequest, span: Span) -> list[Candidate]:
        """Admission; the candidates it returns are looked up when the request may go."""
        d = self._director
        control = self._control
        metadata = self.inbound.metadata

        def candidates() -> list[Candidate]:
            located = locate(d.datastore.endpoints(), metadata, subset_filter=control.subset_filter)
            return [Candidate(e) for e in located]

        admission = control.admission
        assert admission is not None
        found = await admission.admit(request, candidates, span)
        self._admitted = True
        if not found:
            raise ServiceUnavailableError(
                "failed to find endpoint candidates for serving the request"
            )
        return found

    async def _schedule(
        self, request: InferenceRequest, candidates: list[Candidate], span: Span
    ) -> SchedulingResult:
        """Data producers, admitters, then the scheduler's profiles."""
        control = self._control
        await self._prepare_data(request, candidates, span)
        for admitter in control.admitters:
            reason = await _guarded(
                admitter.typed_name, admitter.admit_request(request, candidates)
            )
            if reason is not None:
                logger.info(
                    "request %s denied by %s: %s", request.request_id, admitter.typed_name, reason
                )
                raise InternalError("request cannot be admitted")
        scheduler = control.scheduler
        started = time.perf_counter()
        result = scheduler.schedule(request, candidates, span=span, record=False)
        took = time.perf_counter() - started
        primary = result.primary
        if primary is None or not primary.target_endpoints:
            scheduler.record_attempt(request, took, result)
            raise ResourceExhaustedError("failed to find target endpoint")
        for claimer in control.placement_claimers:
            chosen = await _guarded(claimer.typed_name, claimer.claim_placement(request, result))
            if chosen is not None:
                result = _put_first(result, chosen)
        # The attempt counts where the request goes, after any claim moved it.
        scheduler.record_attempt(request, took, result)
        request.scheduling_result = result
        return result

    async def _decide(
        self, request: InferenceRequest, result: SchedulingResult, body: bytes, span: Span
    ) -> RoutingDecision:
        """PreRequest hooks, then the decision: endpoints (primary first), body, headers."""
        d = self._director
        for hook in self._control.pre_request:
            hook_span = _plugin_span(d.observer, span, PRE_REQUEST_SPAN, hook.typed_name.name)
            try:
                await _guarded(hook.typed_name, hook.pre_request(request, result))
            finally:
                hook_span.end()

        primary = result.primary
        assert primary is not None
        targets = primary.target_endpoints
        self.target = targets[0].info
        extra_headers: list[tuple[str, str]] = []
        prefill = result.profile_results.get(PREFILL_PROFILE)
        if (
            prefill is not None
            and prefill.target_endpoints
            and result.primary_profile_name != PREFILL_PROFILE
        ):
            extra_headers.append(
                (PREFILLER_HEADER, prefill.target_endpoints[0].info.address.host_port())
            )
        if request.upstream_headers:
            extra_headers.extend(request.upstream_headers)
        carrier: dict[str, str] = {}
        span.inject(carrier)
        if carrier:
            extra_headers.extend(carrier.items())
        d.metrics.routed(self._labels, request.request_size_bytes)
        self._running = True
        logger.debug(
            "request %s model %s -> %s", request.request_id, request.target_model, self.target.name
        )
        metadata: dict[str, dict[str, object]] = {}
        if request.profile_scores is not None:
            scored = request.profile_scores.get(result.primary_profile_name)
            if scored is not None:
                candidates, totals = scored
                metadata[LB_METADATA_NAMESPACE] = {
                    ENDPOINT_SCORES_KEY: {
                        c.info.address.host_port(): total
                        for c, total in zip(candidates, totals, strict=True)
                    }
                }
        return RoutingDecision(
            endpoints=tuple(c.info.address for c in targets),
            body=body,
            headers=tuple(extra_headers),
            dynamic_metadata=metadata,
        )

    async def _prepare_data(
        self, request: InferenceRequest, candidates: list[Candidate], span: Span
    ) -> None:
        producers = self._control.data_producers
        if not producers:
            return
        observer = self._director.observer
        timeout = self._control.prepare_data_timeout
        try:
            async with asyncio.timeout(timeout):
                for producer in producers:
                    producer_span = _plugin_span(
                        observer, span, PREPARE_DATA_SPAN, producer.typed_name.name
                    )
                    try:
                        await producer.prepare_request_data(request, candidates)
                    except Exception as exc:
                        producer_span.record_error(str(exc))
                        logger.exception(
                            "data producer %s failed for %s; skipped",
                            producer.typed_name,
                            request.request_id,
                        )
                    finally:
                        producer_span.end()
        except TimeoutError:
            logger.warning(
                "data producers exceeded %.0f ms for %s; scheduling with what is there",
                timeout * 1000,
                request.request_id,
            )

    # response path

    async def response_headers(
        self, headers: Mapping[str, str], metadata: Metadata
    ) -> ResponseHeadersReply:
        self.streaming = "text/event-stream" in headers.get("content-type", "")
        if self.streaming and self.parsed is not None and not self.parsed.opaque:
            self._scanner = SseUsageScanner(self._director.codec)
        request = self.request
        if request is None:
            return ResponseHeadersReply(streaming=self.streaming)
        try:
            status = int(headers.get(":status", "0"))
        except ValueError:
            status = 0
        response = ResponseInfo(
            request_id=request.request_id,
            headers=headers,
            status=status,
            request_metadata=metadata,
        )
        self._response = response
        for hook in self._control.response_header:
            try:
                await hook.response_header(request, response, self.target)
            except Exception:
                logger.exception("response-header hook %s failed", hook.typed_name)
        reply_headers: tuple[tuple[str, str], ...] = ()
        if request.response_headers:
            reply_headers = tuple(request.response_headers)
        if self._control.explain_decisions and request.scheduling_result:
            reply_headers += ((DECISION_HEADER, _explain(request)),)
        return ResponseHeadersReply(headers=reply_headers, streaming=self.streaming)

    async def response_body(self, chunk: bytes, end_of_stream: bool) -> ResponseBodyReply:
        codec = self._director.codec
        response = self._response
        self._response_bytes += len(chunk)
        if self._scanner is not None:
            self._scanner.feed(chunk)
            if end_of_stream:
                self._scanner.flush()
        usage = None
        if end_of_stream:
            if self._scanner is not None:
                usage = self._scanner.usage
            elif self.parsed is not None and not self.parsed.opaque:
                usage = usage_from_body(chunk, codec)
        metadata = None
        if response is not None and self.request is not None:
            response.chunk = chunk
            response.start_of_stream = not self._started
            response.end_of_stream = end_of_stream
            if usage is not None:
                response.usage = usage
            if end_of_stream:
                response.outcome = (
                    ResponseOutcome.COMPLETED
                    if 200 <= response.status < 300
                    else ResponseOutcome.FAILED
                )
                self._final_done = True
                self._record_completion(response)
                await self._run_body_hooks(self.request, response)
            elif self._started:  # a chunk in the middle: only the hooks that read them all
                if self._control.chunk_readers:
                    await self._run_body_hooks(self.request, response, self._control.chunk_readers)
            else:
                await self._run_body_hooks(self.request, response)
            if end_of_stream and response.dynamic_metadata:
                metadata = response.dynamic_metadata
        self._started = True
        request = self.request
        if request is not None and request.target_model != request.incoming_model:
            chunk = rewrite_model_back(chunk, request.target_model, request.incoming_model, codec)
        return ResponseBodyReply(body=chunk, dynamic_metadata=metadata)

    async def response_ended(self) -> None:
        response = self._response
        request = self.request
        if response is None or request is None or self._final_done:
            return
        response.chunk = b""
        response.start_of_stream = not self._started
        response.end_of_stream = True
        response.outcome = (
            ResponseOutcome.COMPLETED if 200 <= response.status < 300 else ResponseOutcome.FAILED
        )
        self._final_done = True
        declared = response.headers.get("content-length", "")
        self._record_completion(response, int(declared) if declared.isdigit() else None)
        await self._run_body_hooks(request, response)

    def _record_completion(self, response: ResponseInfo, size: int | None = -1) -> None:
        """``size``: the response's bytes (-1: those passed through; None: unknown)."""
        metrics = self._director.metrics
        if response.outcome is not ResponseOutcome.COMPLETED:
            metrics.failed(self._labels, ErrorCode.MODEL_SERVER_ERROR)
            return
        seconds = time.monotonic() - self._received_at
        if size == -1:
            size = self._response_bytes
        metrics.completed(self._labels, seconds, size, response.usage)

    async def _run_body_hooks(
        self,
        request: InferenceRequest,
        response: ResponseInfo,
        hooks: Sequence[ResponseBodyProcessor] | None = None,
    ) -> None:
        for hook in self._control.response_body if hooks is None else hooks:
            try:
                await hook.response_body(request, response, self.target)
            except Exception:
                logger.exception("response-body hook %s failed", hook.typed_name)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        request = self.request
        try:
            if (
                request is not None
                and request.scheduling_result is not None
                and not self._final_done
            ):
                response = self._response or ResponseInfo(request_id=request.request_id)
                response.start_of_stream = not self._started
                response.end_of_stream = True
                response.chunk = b""
                response.outcome = ResponseOutcome.CLIENT_GONE
                self._final_done = True
                await self._run_body_hooks(request, response)
        finally:
            if request is not None:
                self._director.states.release(request.state)
            if self._running:
                self._running = False
                self._director.metrics.closed(self._labels)
            if self._admitted:
                self._admitted = False
                admission = self._control.admission
                if admission is not None and request is not None:
                    admission.done(request)
            self._scanner = None
            self._response = None


_NOOP_SPAN = NoopSpan()


def _plugin_span(observer: Observer, parent: Span, name: str, plugin: str) -> Span:
    """A child span for one plugin call, or a no-op one when ``parent``'s trace is not
    kept (an unsampled request pays no span calls)."""
    if not parent.recording:
        return _NOOP_SPAN
    return observer.start_span(name, parent=parent, attributes={"plugin": plugin})


def _put_first(result: SchedulingResult, chosen: Candidate) -> SchedulingResult:
    """``result`` with ``chosen`` first among the primary profile's targets, the others
    after it in their order, as many as the picker chose (its ``maxNumOfEndpoints``)."""
    primary = result.primary
    assert primary is not None
    targets = primary.target_endpoints
    if targets[0] is chosen:
        return result
    rest = tuple(c for c in targets if c.info.name != chosen.info.name)
    moved = (chosen, *rest)[: len(targets)]
    others = (*primary.alternates, *rest[len(moved) - 1 :])
    runs = dict(result.profile_results)
    runs[result.primary_profile_name] = ProfileRunResult(
        target_endpoints=moved, alternates=tuple(c for c in others if c is not chosen)
    )
    return SchedulingResult(profile_results=runs, primary_profile_name=result.primary_profile_name)


async def _guarded(name: object, call: Awaitable[T]) -> T:
    """Await a plugin call; anything it raises but an ``EppError`` fails the request (500)."""
    try:
        return await call
    except EppError:
        raise
    except Exception as exc:
        logger.exception("plugin %s failed", name)
        raise InternalError(f"plugin {name} failed: {exc}") from exc


def _explain(request: InferenceRequest) -> str:
    """``profile: picked a,b; a=4.10 (queue=1.00 kv=0.55 ...), b=...`` for every profile."""
    result = request.scheduling_result
    assert result is not None
    explanations = request.explanations or {}
    parts = []
    for name, run in result.profile_results.items():
        if run is None:
            parts.append(f"{name}: failed")
            continue
        text = f"{name}: picked " + ",".join(c.info.name for c in run.target_endpoints)
        recorded = explanations.get(name)
        if recorded is not None:
            scored = sorted(
                zip(recorded.totals, recorded.candidates, recorded.scores, strict=True),
                key=lambda t: -t[0],
            )
            text += "; " + ", ".join(
                f"{c.info.name}={total:.2f} ({' '.join(detail)})" for total, c, detail in scored
            )
        parts.append(text)
    return " | ".join(parts)
