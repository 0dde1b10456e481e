"""The Director: one request's way from parsed body to routing decision, and back.

Order (as the reference): parse → model rewrite → objective (priority) → admission →
candidates (subset hint) → snapshot → PrepareData producers → admitters → scheduler →
PreRequest hooks → the decision. On the response path: ResponseHeader hooks, then
ResponseBody hooks per chunk in order, the end-of-stream call last, always made once
(``close`` makes it for a client that went away).

Observability (reference names, spec section 9): a routed request counts in
``inference_objective_request_total`` and ``..._request_sizes`` and is running
(``..._running_requests``) until its exchange closes; a refused one counts in
``..._request_error_total`` with its error code, as does a response with a non-2xx status
(``ModelServerError``). A completed response records the duration, response size, token
counts and normalized time per output token; a model rewrite counts in
``inference_extension_model_rewrite_decisions_total``. Routing is the span
``gateway.request_orchestration`` (child of the gateway's span), with children for the
data producers, scheduling and the PreRequest hooks; its trace context goes upstream in the
request headers (``traceparent``, ``tracestate``, ``baggage``).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Mapping, Sequence
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
from domain.requestcontrol.admission import Admission, LegacyAdmission
from domain.requestcontrol.candidates import locate
from domain.requestcontrol.interfaces import (
    Admitter,
    DataProducer,
    Parser,
    PreRequest,
    ResponseBodyProcessor,
    ResponseHeaderProcessor,
    ResponseInfo,
    ResponseOutcome,
    SaturationDetector,
)
from domain.requestcontrol.state import RequestStates
from domain.requesthandling.openai import ParsedRequest, rewrite_model
from domain.requesthandling.usage import SseUsageScanner, rewrite_model_back, usage_from_body
from domain.scheduling.profile import EXPLAIN_KEY
from domain.scheduling.scheduler import Scheduler
from domain.scheduling.types import Candidate, InferenceRequest
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
#: Response headers plugins ask for go in ``InferenceRequest.extra`` under this key.
RESPONSE_HEADERS_KEY = "response_headers"
DECISION_HEADER = "x-epp-decision"

REQUEST_TOTAL = "inference_objective_request_total"
REQUEST_ERROR_TOTAL = "inference_objective_request_error_total"
REQUEST_DURATION = "inference_objective_request_duration_seconds"
REQUEST_SIZES = "inference_objective_request_sizes"
RESPONSE_SIZES = "inference_objective_response_sizes"
INPUT_TOKENS = "inference_objective_input_tokens"
OUTPUT_TOKENS = "inference_objective_output_tokens"
PROMPT_CACHED_TOKENS = "inference_objective_prompt_cached_tokens"
NORMALIZED_TPOT = "inference_objective_normalized_time_per_output_token_seconds"
RUNNING_REQUESTS = "inference_objective_running_requests"
MODEL_REWRITE_DECISIONS = "inference_extension_model_rewrite_decisions_total"
ORCHESTRATION_SPAN = "gateway.request_orchestration"
PREPARE_DATA_SPAN = "gateway.prepare_data"
PRE_REQUEST_SPAN = "gateway.pre_request"
#: The wait for flow control's verdict (attributes ``priority``, ``fairness_id``).
FLOW_CONTROL_SPAN = "gateway.flow_control"
_NO_MODEL = {"model_name": "", "target_model_name": ""}


@dataclass(slots=True, kw_only=True)
class RequestControl:
    """The plugins the Director runs, by extension point, in order."""

    parser: Parser
    scheduler: Scheduler
    saturation_detector: SaturationDetector
    data_producers: Sequence[DataProducer] = ()
    admitters: Sequence[Admitter] = ()
    pre_request: Sequence[PreRequest] = ()
    response_header: Sequence[ResponseHeaderProcessor] = ()
    response_body: Sequence[ResponseBodyProcessor] = ()
    prepare_data_timeout: float = 0.4
    subset_filter: bool = True
    explain_decisions: bool = False
    #: Legacy admission (shed sheddable requests when saturated) unless flow control is on.
    admission: Admission | None = None
    extra_plugins: Mapping[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.admission is None:
            self.admission = LegacyAdmission(self.saturation_detector)


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
        self._running: dict[str, int] = {}
        self._running_labels: dict[str, dict[str, str]] = {}

    def open(self, request: InboundRequest) -> RequestExchangeState:
        return RequestExchangeState(self, request)

    def ready(self) -> bool:
        return self.datastore.synced

    def running(self, model: str) -> int:
        """Requests for ``model`` (as the client named it) routed and not yet closed."""
        return self._running.get(model, 0)

    def _add_running(self, model: str, delta: int) -> None:
        count = self._running.get(model, 0) + delta
        labels = self._running_labels.get(model)
        if labels is None:
            labels = self._running_labels[model] = {"model_name": model}
        if count:
            self._running[model] = count
        else:  # forget idle models (the gauge keeps its 0)
            self._running.pop(model, None)
            self._running_labels.pop(model, None)
        self.observer.gauge(RUNNING_REQUESTS, labels, count)


class RequestExchangeState:
    """The domain's state for one request/response exchange (a ``RequestExchange``)."""

    __slots__ = (
        "_admitted",
        "_closed",
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
            self._count_error(error.code)
            return RoutingDecision(error=error)
        finally:
            span.end()

    def _count_error(self, code: ErrorCode) -> None:
        labels = {**self._labels, "error_code": code.value}
        self._director.observer.counter(REQUEST_ERROR_TOTAL, labels)

    async def _route(self, span: Span) -> RoutingDecision:
        d = self._director
        observer = d.observer
        inbound = self.inbound
        endpoints = d.datastore.endpoints()
        if inbound.body is None:
            if not endpoints:
                raise InternalError("no pods available in datastore")
            chosen = d.rng.choice(endpoints)
            self.target = chosen.info
            return RoutingDecision(endpoints=(chosen.info.address,))

        control = d.control
        headers = inbound.headers
        parsed = control.parser.parse(inbound.body, headers)
        self.parsed = parsed
        incoming = parsed.model
        target_model = incoming
        body = inbound.body
        if not parsed.opaque:
            if not incoming:
                raise BadRequestError("model not found in request body")
            target_model = headers.get(MODEL_REWRITE_HEADER) or incoming
            rewrite = d.objectives.rewrite(incoming, d.rng)
            if rewrite is not None:
                target_model = rewrite[1]
                observer.counter(
                    MODEL_REWRITE_DECISIONS,
                    {
                        "model_rewrite_name": rewrite[0],
                        "model_name": incoming,
                        "target_model": target_model,
                    },
                )
            if target_model != incoming:
                body = rewrite_model(parsed, target_model, d.codec)
        self._labels = {"model_name": incoming, "target_model_name": target_model}

        objective = headers.get(OBJECTIVE_HEADER, "")
        request = InferenceRequest(
            request_id=inbound.request_id,
            target_model=target_model,
            incoming_model=incoming,
            body=parsed,
            headers=headers,
            priority=d.objectives.priority_of(objective),
            request_size_bytes=len(inbound.body),
            state=d.states.create(inbound.request_id),
            objective=objective,
            fairness_id=headers.get(FAIRNESS_HEADER) or DEFAULT_FAIRNESS_ID,
            received_at=self._received_at,
        )
        if control.explain_decisions:
            request.extra[EXPLAIN_KEY] = {}
        self.request = request
        span.set_attribute("target_model", target_model)
        span.set_attribute("request_prio", request.priority)

        located = locate(endpoints, inbound.metadata, subset_filter=control.subset_filter)
        candidates = [Candidate(e) for e in located]
        admission = control.admission
        assert admission is not None
        if admission.late_binding:  # flow control: the request may wait in a queue
            wait_span: Span = _NOOP_SPAN
            if span.recording:
                wait_span = observer.start_span(
                    FLOW_CONTROL_SPAN,
                    parent=span,
                    attributes={"priority": request.priority, "fairness_id": request.fairness_id},
                )
            try:
                await admission.admit(request, candidates)
            except EppError as exc:
                wait_span.record_error(exc.message)
                raise
            finally:
                wait_span.end()
        else:
            await admission.admit(request, candidates)
        self._admitted = True
        if admission.late_binding:
            # The request may have waited in a queue: schedule on what is current now.
            located = locate(
                d.datastore.endpoints(), inbound.metadata, subset_filter=control.subset_filter
            )
            candidates = [Candidate(e) for e in located]
        if not candidates:
            raise ServiceUnavailableError(
                "failed to find endpoint candidates for serving the request"
            )

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

        result = control.scheduler.schedule(request, candidates, span=span)
        primary = result.primary
        if primary is None or not primary.target_endpoints:
            raise ResourceExhaustedError("failed to find target endpoint")
        request.scheduling_result = result
        for hook in control.pre_request:
            hook_span = _plugin_span(observer, span, PRE_REQUEST_SPAN, hook.typed_name.name)
            try:
                await _guarded(hook.typed_name, hook.pre_request(request, result))
            finally:
                hook_span.end()

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
        carrier: dict[str, str] = {}
        span.inject(carrier)
        if carrier:
            extra_headers.extend(carrier.items())
        labels = self._labels
        observer.counter(
            REQUEST_TOTAL,
            {
                "model_name": incoming,
                "target_model_name": target_model,
                "priority": str(request.priority),
            },
        )
        observer.histogram(REQUEST_SIZES, labels, request.request_size_bytes)
        self._running = True
        d._add_running(incoming, 1)
        logger.debug(
            "request %s model %s -> %s", request.request_id, target_model, self.target.name
        )
        return RoutingDecision(
            endpoints=tuple(c.info.address for c in targets),
            body=body,
            headers=tuple(extra_headers),
        )

    async def _prepare_data(
        self, request: InferenceRequest, candidates: list[Candidate], span: Span
    ) -> None:
        producers = self._director.control.data_producers
        if not producers:
            return
        observer = self._director.observer
        timeout = self._director.control.prepare_data_timeout
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
        for hook in self._director.control.response_header:
            try:
                await hook.response_header(request, response, self.target)
            except Exception:
                logger.exception("response-header hook %s failed", hook.typed_name)
        extra = request.extra.get(RESPONSE_HEADERS_KEY)
        reply_headers: tuple[tuple[str, str], ...] = ()
        if isinstance(extra, list):
            reply_headers = tuple(extra)
        if self._director.control.explain_decisions and request.scheduling_result:
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
            if end_of_stream and response.dynamic_metadata:
                metadata = response.dynamic_metadata
        self._started = True
        request = self.request
        if request is not None and request.target_model != request.incoming_model:
            chunk = rewrite_model_back(chunk, request.target_model, request.incoming_model, codec)
        return ResponseBodyReply(body=chunk, dynamic_metadata=metadata)

    def _record_completion(self, response: ResponseInfo) -> None:
        if response.outcome is not ResponseOutcome.COMPLETED:
            self._count_error(ErrorCode.MODEL_SERVER_ERROR)
            return
        observer = self._director.observer
        labels = self._labels
        seconds = time.monotonic() - self._received_at
        observer.histogram(REQUEST_DURATION, labels, seconds)
        observer.histogram(RESPONSE_SIZES, labels, self._response_bytes)
        usage = response.usage
        if usage is None:
            return
        observer.histogram(INPUT_TOKENS, labels, usage.prompt_tokens)
        observer.histogram(OUTPUT_TOKENS, labels, usage.completion_tokens)
        observer.histogram(PROMPT_CACHED_TOKENS, labels, usage.cached_tokens)
        if usage.completion_tokens > 0:
            observer.histogram(NORMALIZED_TPOT, labels, seconds / usage.completion_tokens)

    async def _run_body_hooks(self, request: InferenceRequest, response: ResponseInfo) -> None:
        for hook in self._director.control.response_body:
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
                self._director._add_running(self._labels["model_name"], -1)
            if self._admitted:
                self._admitted = False
                admission = self._director.control.admission
                if admission is not None:
                    admission.done()
            self._scanner = None
            self._response = None


_NOOP_SPAN = NoopSpan()


def _plugin_span(observer: Observer, parent: Span, name: str, plugin: str) -> Span:
    """A child span for one plugin call, or a no-op one when ``parent``'s trace is not
    kept (an unsampled request pays no span calls)."""
    if not parent.recording:
        return _NOOP_SPAN
    return observer.start_span(name, parent=parent, attributes={"plugin": plugin})


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
    runs = request.extra.get(EXPLAIN_KEY)
    parts = []
    for name, run in result.profile_results.items():
        if run is None:
            parts.append(f"{name}: failed")
            continue
        text = f"{name}: picked " + ",".join(c.info.name for c in run.target_endpoints)
        recorded = runs.get(name) if isinstance(runs, dict) else None
        if recorded is not None:
            candidates, totals, breakdown = recorded
            scored = sorted(zip(totals, candidates, breakdown, strict=True), key=lambda t: -t[0])
            text += "; " + ", ".join(
                f"{c.info.name}={total:.2f} ({' '.join(detail)})" for total, c, detail in scored
            )
        parts.append(text)
    return " | ".join(parts)
