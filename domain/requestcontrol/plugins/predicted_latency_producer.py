"""``predicted-latency-producer``: every candidate's TTFT and TPOT predicted in process, and
learnt from what the EPP observes (the llm-d router's type name and parameters).

A DataProducer, Admitter, PreRequest and ResponseBodyProcessor in one plugin, and the default
producer of ``LatencyPredictionInfo`` (the loader creates it for a consumer of that key,
such as ``latency-scorer`` or ``prefix-cache-affinity-filter`` with ``ttftSource:
latencyPredictor``).

- **Predict** (PrepareData): for each candidate, the request's features there (its
  uncached prompt tokens, from ``PrefixCacheMatchInfo``; the tokens and requests in flight
  there, from ``InFlightLoad``, the pool's when shared; the endpoint's scraped waiting and
  running requests and KV-cache usage; see ``latency_model.FEATURES``), then the TTFT and
  TPOT models' predictions and the SLO headroom (``slo.py``: ``x-slo-ttft-ms``,
  ``x-slo-tpot-ms``), written as ``LatencyPredictionInfo`` on the candidate. A TPOT counts
  only with ``streamingMode: true`` (as in the llm-d router): otherwise its headroom is 0
  and it is valid, as for an endpoint whose ``endpointRoleLabel`` label says ``prefill``.
- **Refuse bad SLOs** (Admitter): a request whose SLO header breaks ``slo.py``'s rule gets
  a 400 naming the header.
- **Receipt** (PreRequest, ResponseBody): the chosen endpoint's features and predictions
  are kept; the observed TTFT (the first response body chunk minus the moment this
  plugin's PreRequest ran, right after scheduling: a later hook's wait, such as
  ``kv-capacity-gate``'s hold, is part of what the route costs the client) and TPOT (the
  rest of the stream over the output tokens after the first: ``usage.completion_tokens``,
  else the SSE events counted) are
  learnt by the models and reported: the reference's observed/predicted histograms and SLO
  violations per model, ``..._latency_prediction_error_seconds`` per endpoint, the prefix
  hit predicted against the one the server reports (``usage`` cached tokens), and a
  ``gateway.route_receipt`` span (child of the request's span) carrying both. A 2xx
  response only teaches; a request that ends before its first byte teaches a lower bound
  (its time so far) when that is above the prediction, so a server that hangs does not keep
  looking fast. For a response that is not streamed the first chunk is the whole body: its
  TTFT is the end-to-end latency (the llm-d router's non-streaming training target too),
  and it teaches no TPOT.
- **Share** (``BackgroundPlugin``): with a shared store (``--redis-url``: the Handle's
  ``sessions`` store), every 5 s each model level this process has learnt (at least
  ``minSamples``) is written, and each level it has not is read and adopted, so a new
  replica or worker routes warm.

The model is ``domain.requestcontrol.latency_model.LatencyModel``: ridge regressions per
endpoint shrunk toward a pool model, itself shrunk toward the heuristic (an overhead and
the tokens ahead at ``peakPrefillThroughput``, counting 1,000 prompt tokens for each request
the server reports waiting), each used once it has ``minSamples``.

Parameters (the llm-d router's): ``samplingMean`` and ``maxDecodeTokenSamplesForPrediction``
(deprecated there, accepted and ignored), ``sloBufferFactor`` (1.0, > 0: the TPOT SLO is
multiplied by it), ``contextTTL`` (5m: how long a request's receipt waits for its response),
``streamingMode`` (false), ``endpointRoleLabel`` (""), ``predictInProduce`` (true; its older
name ``predictInPrepareData`` too: false learns without predicting),
``prefixMatchInfoProducerName`` and ``inFlightLoadProducerName`` (accepted; this EPP has one
producer of each key), ``useEncoderCacheFeatures`` (false; true is refused: there is no
multimodal encoder-cache producer here), ``encoderCacheMatchInfoProducerName``. Ours:
``peakPrefillThroughput`` (15928 tokens/s, the heuristic's) and ``minSamples`` (16).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from domain.datalayer.attributes import (
    IN_FLIGHT_LOAD,
    LATENCY_PREDICTION_INFO,
    PREFIX_CACHE_MATCH_INFO,
    InFlightLoad,
    LatencyPredictionInfo,
    PrefixCacheMatchInfo,
)
from domain.datastore.endpoint import Endpoint
from domain.errors import BadRequestError
from domain.plugins.base import Duration, Plugin, PluginRegistry, TypedName
from domain.plugins.handle import Handle
from domain.plugins.hooks import BackgroundPlugin, ConsumerPlugin, ProducerPlugin
from domain.plugins.state import StateKey
from domain.requestcontrol.interfaces import ResponseInfo, ResponseOutcome
from domain.requestcontrol.latency_model import LatencyModel, ModelParameters, dot
from domain.requestcontrol.slo import NO_SLO, RequestSlo, request_slo
from domain.scheduling.load import input_tokens
from domain.scheduling.types import Candidate, InferenceRequest, SchedulingResult
from domain.sharedstate.sessions import InMemorySessionStore
from ports.endpoints import EndpointEvent, EndpointEventKind, EndpointInfo
from ports.metric_catalogue import (
    LATENCY_PREDICTION_ERROR,
    LATENCY_SAMPLES_REFUSED,
    PREFIX_HIT_PREDICTION_ERROR,
    REQUEST_PREDICTED_TPOT,
    REQUEST_PREDICTED_TTFT,
    REQUEST_SLO_VIOLATION,
    REQUEST_TPOT,
    REQUEST_TPOT_PREDICTION_DURATION,
    REQUEST_TTFT,
    REQUEST_TTFT_PREDICTION_DURATION,
)
from ports.observer import Span
from ports.shared_state import SharedStateError

__all__ = [
    "RECEIPT_SPAN",
    "TYPE",
    "PredictedLatencyParameters",
    "PredictedLatencyProducer",
    "register",
    "ttft_prior",
]

logger = logging.getLogger(__name__)

TYPE = "predicted-latency-producer"
RECEIPT_SPAN = "gateway.route_receipt"
#: How often learnt models are written to / read from a shared store (seconds).
SHARE_INTERVAL = 5.0
#: How long a shared model outlives its last write (seconds).
SHARE_TTL = 600.0
#: How long readiness waits for the first read of the shared models at start-up (seconds).
WARM_START_WAIT = 2.0
#: The TTFT heuristic's fixed part (ms) and the TPOT heuristic (ms per token, unknown: 0).
_TTFT_OVERHEAD_MS = 30.0
#: The prompt tokens the heuristic assumes for each request a server reports waiting.
_WAITING_TOKENS = 1000
_CONTEXT_TTL = Duration(300.0)


@dataclass(frozen=True, slots=True, kw_only=True)
class PredictedLatencyParameters:
    """See the module docstring."""

    sampling_mean: float = 1000.0
    max_decode_token_samples_for_prediction: int = 0
    slo_buffer_factor: float = 1.0
    context_TTL: Duration = _CONTEXT_TTL  # noqa: N815 (the key is ``contextTTL``)
    streaming_mode: bool = False
    endpoint_role_label: str = ""
    predict_in_produce: bool = True
    predict_in_prepare_data: bool = True
    prefix_match_info_producer_name: str = ""
    in_flight_load_producer_name: str = ""
    use_encoder_cache_features: bool = False
    encoder_cache_match_info_producer_name: str = ""
    peak_prefill_throughput: float = 15928.0
    min_samples: int = 16

    def __post_init__(self) -> None:
        if not self.slo_buffer_factor > 0:
            raise ValueError("sloBufferFactor: must be > 0")
        if self.use_encoder_cache_features:
            raise ValueError(
                "useEncoderCacheFeatures: this EPP has no multimodal encoder-cache producer"
            )
        if not self.peak_prefill_throughput > 0 or self.peak_prefill_throughput == float("inf"):
            raise ValueError("peakPrefillThroughput: must be a finite number > 0")
        if self.min_samples < 1:
            raise ValueError("minSamples: must be >= 1")


@dataclass(slots=True)
class _Receipt:
    """One request's prediction and what was seen of its response."""

    endpoint: str
    features: tuple[float, ...]
    ttft_ms: float
    tpot_ms: float
    source: str
    slo: RequestSlo
    prompt_tokens: int
    cached_tokens: int
    span: Span | None
    decided_at: float
    first_at: float = 0.0
    events: int = 0


@dataclass(slots=True)
class _Request:
    """What PrepareData left for the request's later extension points."""

    slo: RequestSlo
    error: BadRequestError | None
    prompt_tokens: int
    features: dict[str, tuple[float, ...]]
    predictions: dict[str, LatencyPredictionInfo]
    cached: dict[str, int]


_REQUEST: StateKey[_Request] = StateKey("predicted-latency.request")
_RECEIPT: StateKey[_Receipt] = StateKey("predicted-latency.receipt")


def ttft_prior(peak_prefill_throughput: float) -> tuple[float, ...]:
    """The TTFT heuristic as coefficients: an overhead plus the uncached prompt, the tokens
    in flight and ``_WAITING_TOKENS`` per request the server reports waiting (load it may
    not have from this EPP), all at the peak prefill throughput (ms per thousand tokens)."""
    per_ktoken = 1_000_000.0 / peak_prefill_throughput
    per_ten_waiting = 10 * _WAITING_TOKENS / 1000.0 * per_ktoken
    return (_TTFT_OVERHEAD_MS, per_ktoken, per_ktoken, 0.0, per_ten_waiting, 0.0, 0.0)


class PredictedLatencyProducer(ProducerPlugin, ConsumerPlugin, BackgroundPlugin):
    """See the module docstring."""

    def __init__(
        self, typed_name: TypedName, parameters: PredictedLatencyParameters, handle: Handle
    ) -> None:
        self._typed_name = typed_name
        self.parameters = parameters
        self._codec = handle.codec
        self._clock = handle.clock
        self._observer = handle.observer
        self._sessions = handle.sessions
        self._shared = not isinstance(handle.sessions, InMemorySessionStore)
        self._degraded = handle.shared_degraded
        self._predict = parameters.predict_in_produce and parameters.predict_in_prepare_data
        self._streaming = parameters.streaming_mode
        self._role_label = parameters.endpoint_role_label
        self._buffer = parameters.slo_buffer_factor
        self.ttft = LatencyModel(
            ModelParameters(
                prior=ttft_prior(parameters.peak_prefill_throughput),
                min_samples=float(parameters.min_samples),
            )
        )
        self.tpot = LatencyModel(
            ModelParameters(prior=(0.0,) * 7, min_samples=float(parameters.min_samples))
        )
        self._datastore = handle.datastore
        self._task: asyncio.Task[None] | None = None
        self._warm_by = 0.0
        self._warmed = not self._shared
        handle.datastore.subscribe(self._on_endpoint_event)

    @property
    def typed_name(self) -> TypedName:
        return self._typed_name

    def produces(self) -> Sequence[str]:
        return (LATENCY_PREDICTION_INFO,)

    def consumes(self) -> Sequence[str]:
        return (PREFIX_CACHE_MATCH_INFO, IN_FLIGHT_LOAD)

    # PrepareData

    async def prepare_request_data(
        self, request: InferenceRequest, candidates: Sequence[Candidate]
    ) -> None:
        try:
            slo = request_slo(request.headers)
            error = None
        except BadRequestError as exc:
            slo, error = NO_SLO, exc
        prompt = input_tokens(request, self._codec)
        state = _Request(slo, error, prompt, {}, {}, {})
        request.state.put(self._typed_name.name, _REQUEST, state)
        started = time.perf_counter()
        self._predict_all(state, candidates)
        if self._predict:
            took = time.perf_counter() - started
            labels = {
                "model_name": request.incoming_model,
                "target_model_name": request.target_model,
            }
            self._observer.histogram(REQUEST_TTFT_PREDICTION_DURATION, labels, took)
            self._observer.histogram(REQUEST_TPOT_PREDICTION_DURATION, labels, took)

    def _predict_all(self, state: _Request, candidates: Sequence[Candidate]) -> None:
        prompt = state.prompt_tokens
        slo_ttft = state.slo.ttft_ms
        slo_tpot = state.slo.tpot_ms * self._buffer
        streaming = self._streaming
        role = self._role_label
        ttft_model = self.ttft
        tpot_model = self.tpot
        predict = self._predict
        features = state.features
        cached_by = state.cached
        predictions = state.predictions
        for c in candidates:  # inlined: this runs for every candidate of every request
            attributes = c.attributes
            cached = 0
            info = attributes.get(PREFIX_CACHE_MATCH_INFO)
            if info.__class__ is PrefixCacheMatchInfo:
                cached = info.match_blocks * info.block_size_tokens
                if cached > prompt:
                    cached = prompt
            load = attributes.get(IN_FLIGHT_LOAD)
            tokens = requests = 0
            if load.__class__ is InFlightLoad:
                tokens, requests = load.tokens, load.requests
            metrics = c.metrics
            if metrics is not None:
                waiting = metrics.waiting_queue_size
                running = metrics.running_requests_size
                kv = metrics.kv_cache_usage_percent
            else:
                waiting = running = 0
                kv = 0.0
            x = (
                1.0,
                (prompt - cached) * 0.001,
                tokens * 0.001,
                requests * 0.1,
                waiting * 0.1,
                running * 0.1,
                kv,
            )
            name = c.info.name
            features[name] = x
            cached_by[name] = cached
            if not predict:
                continue
            coef, source = ttft_model.coefficients(name)
            ttft = dot(coef, x)
            if ttft < 0.0:
                ttft = 0.0
            tpot = dot(tpot_model.coefficients(name)[0], x)
            if tpot < 0.0:
                tpot = 0.0
            ttft_headroom = slo_ttft - ttft
            if streaming and not (role and c.info.labels.get(role) == "prefill"):
                tpot_headroom = slo_tpot - tpot
                tpot_valid = tpot < slo_tpot
            else:
                tpot_headroom, tpot_valid = 0.0, True
            # In flight there: the pool's own count, or what the server last reported
            # running and waiting when that is more (load this EPP did not send).
            busy = waiting + running
            prediction = LatencyPredictionInfo(
                ttft,
                tpot,
                ttft_headroom,
                tpot_headroom,
                ttft < slo_ttft,
                tpot_valid,
                requests if requests >= busy else busy,
                source,
            )
            predictions[name] = prediction
            attributes[LATENCY_PREDICTION_INFO] = prediction

    # Admitter: a bad SLO header is the client's error

    async def admit_request(
        self, request: InferenceRequest, candidates: Sequence[Candidate]
    ) -> str | None:
        state = request.state.get(self._typed_name.name, _REQUEST)
        if state is not None and state.error is not None:
            raise state.error
        return None

    # PreRequest

    async def pre_request(self, request: InferenceRequest, result: SchedulingResult) -> None:
        owner = self._typed_name.name
        state = request.state.get(owner, _REQUEST)
        primary = result.primary
        if state is None or primary is None or not primary.target_endpoints:
            return
        name = primary.target_endpoints[0].info.name
        x = state.features.get(name)
        if x is None:
            return
        prediction = state.predictions.get(name)
        if prediction is None:  # predictInProduce off: predicted now, for the receipt
            ttft = self.ttft.predict(name, x)
            tpot = self.tpot.predict(name, x)
            ttft_ms, tpot_ms, source = ttft.value, tpot.value, ttft.source
        else:
            ttft_ms, tpot_ms, source = prediction.ttft_ms, prediction.tpot_ms, prediction.source
        cached = state.cached.get(name, 0)
        span = None
        parent = request.span
        if parent is not None and parent.recording:
            span = self._observer.start_span(
                RECEIPT_SPAN,
                parent=parent,
                attributes={
                    "endpoint": name,
                    "predicted_ttft_ms": round(ttft_ms, 3),
                    "predicted_tpot_ms": round(tpot_ms, 3),
                    "prediction_source": source,
                    "prompt_tokens": state.prompt_tokens,
                    "predicted_cached_tokens": cached,
                },
            )
        receipt = _Receipt(
            name,
            x,
            ttft_ms,
            tpot_ms,
            source,
            state.slo,
            state.prompt_tokens,
            cached,
            span,
            self._clock(),
        )
        request.state.put(owner, _RECEIPT, receipt)

    # ResponseBody

    async def response_body(
        self, request: InferenceRequest, response: ResponseInfo, target: EndpointInfo | None
    ) -> None:
        owner = self._typed_name.name
        receipt = request.state.get(owner, _RECEIPT)
        if receipt is None:
            return
        now = self._clock()
        ok = 200 <= response.status < 300
        chunk = response.chunk
        if receipt.first_at == 0.0 and chunk and ok:
            receipt.first_at = now
            self._learn(request, receipt, "ttft", (now - receipt.decided_at) * 1000.0)
        if chunk:
            receipt.events += chunk.count(b"data:")
        if not response.end_of_stream:
            return
        request.state.pop(owner, _RECEIPT)
        self._finish(request, response, receipt, now)

    def _learn(
        self, request: InferenceRequest, receipt: _Receipt, kind: str, observed_ms: float
    ) -> None:
        """One observed TTFT or TPOT (``kind``): taught to its model, and its receipt (the
        observed and predicted histograms, the prediction error, an SLO violation, the
        span's attribute)."""
        if kind == "ttft":
            model, predicted_ms, slo_ms = self.ttft, receipt.ttft_ms, receipt.slo.ttft_ms
            observed, predicted = REQUEST_TTFT, REQUEST_PREDICTED_TTFT
        else:
            model, predicted_ms, slo_ms = self.tpot, receipt.tpot_ms, receipt.slo.tpot_ms
            observed, predicted = REQUEST_TPOT, REQUEST_PREDICTED_TPOT
        if not model.observe(receipt.endpoint, receipt.features, observed_ms):
            self._observer.counter(LATENCY_SAMPLES_REFUSED, {"reason": "out_of_range"})
            return
        labels = {"model_name": request.incoming_model, "target_model_name": request.target_model}
        observer = self._observer
        observer.histogram(observed, labels, observed_ms / 1000.0)
        observer.histogram(predicted, labels, predicted_ms / 1000.0)
        observer.histogram(
            LATENCY_PREDICTION_ERROR,
            {"endpoint": receipt.endpoint, "kind": kind},
            abs(observed_ms - predicted_ms) / 1000.0,
        )
        if slo_ms > 0.0 and observed_ms > slo_ms:
            observer.counter(REQUEST_SLO_VIOLATION, {**labels, "type": kind})
        if receipt.span is not None:
            receipt.span.set_attribute(f"observed_{kind}_ms", round(observed_ms, 3))

    def _finish(
        self, request: InferenceRequest, response: ResponseInfo, receipt: _Receipt, now: float
    ) -> None:
        span = receipt.span
        if receipt.first_at == 0.0:
            # Ended before any byte: the TTFT is at least the time so far.
            waited = (now - receipt.decided_at) * 1000.0
            if response.outcome is ResponseOutcome.CLIENT_GONE and waited > receipt.ttft_ms:
                self.ttft.observe(receipt.endpoint, receipt.features, waited)
        else:
            usage = response.usage
            tokens = usage.completion_tokens if usage is not None else 0
            if tokens <= 0:
                tokens = max(0, receipt.events - 1)  # the [DONE] event is not a token
            streamed = "text/event-stream" in response.headers.get("content-type", "")
            if streamed and tokens >= 2 and response.outcome is ResponseOutcome.COMPLETED:
                self._learn(
                    request, receipt, "tpot", (now - receipt.first_at) * 1000.0 / (tokens - 1)
                )
            if usage is not None and usage.cached_tokens and receipt.prompt_tokens > 0:
                prompt = usage.prompt_tokens or receipt.prompt_tokens
                realised = usage.cached_tokens / prompt
                predicted = receipt.cached_tokens / receipt.prompt_tokens
                self._observer.histogram(
                    PREFIX_HIT_PREDICTION_ERROR,
                    {"endpoint": receipt.endpoint},
                    min(1.0, abs(realised - predicted)),
                )
                if span is not None:
                    span.set_attribute("realised_cached_tokens", usage.cached_tokens)
        if span is not None:
            span.set_attribute("outcome", response.outcome.value)
            span.end()

    # endpoints

    def _on_endpoint_event(self, event: EndpointEvent, endpoint: Endpoint) -> None:
        if event.kind is EndpointEventKind.DELETE:
            self.ttft.forget(endpoint.name)
            self.tpot.forget(endpoint.name)

    # sharing (BackgroundPlugin)

    async def start(self) -> None:
        if not self._shared or self._task is not None:
            return
        self._warm_by = self._clock() + WARM_START_WAIT
        self._task = asyncio.create_task(self._share_loop(), name=f"{TYPE} sharing")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._degraded is not None:  # a replaced plugin no longer counts
            self._degraded.set(f"latency-models:{self._typed_name.name}", False)

    def ready(self) -> bool:
        return self._warmed or self._clock() >= self._warm_by

    async def _share_loop(self) -> None:
        while True:
            failing = True
            try:
                await self.share()
                failing = False
            except SharedStateError as exc:
                logger.debug("%s: shared latency models unavailable: %s", self._typed_name, exc)
            except Exception:
                logger.exception("%s: sharing latency models failed", self._typed_name)
            if self._degraded is not None:
                self._degraded.set(f"latency-models:{self._typed_name.name}", failing)
            self._warmed = True
            await asyncio.sleep(SHARE_INTERVAL)

    async def share(self) -> None:
        """One round: write each level this process learnt from since its last write (and
        that has ``minSamples``), read and adopt each level it has too few samples of."""
        minimum = float(self.parameters.min_samples)
        for kind, model in (("ttft", self.ttft), ("tpot", self.tpot)):
            learnt = model.take_learnt()
            levels: list[str | None] = [None, *(e.name for e in self._datastore.endpoints())]
            for endpoint in levels:
                key = f"latency-model:{self._typed_name.name}:{kind}:{endpoint or '*'}"
                if model.sample_count(endpoint) >= minimum:
                    document = model.export(endpoint)
                    if document is not None and endpoint in learnt:
                        value = self._codec.dumps(document).decode()
                        await self._sessions.put(key, value, SHARE_TTL)
                    continue
                stored = await self._sessions.get(key)
                if stored is None:
                    continue
                try:
                    document = self._codec.loads(stored.encode())
                except ValueError:
                    continue
                if isinstance(document, dict) and model.merge(endpoint, document):
                    logger.info(
                        "%s: adopted the shared %s model of %s",
                        self._typed_name,
                        kind,
                        endpoint or "the pool",
                    )


def _factory(name: str, parameters: PredictedLatencyParameters, handle: Handle) -> Plugin:
    return PredictedLatencyProducer(TypedName(TYPE, name), parameters, handle)


def register(registry: PluginRegistry) -> None:
    registry.register(
        TYPE,
        _factory,
        parameters=PredictedLatencyParameters,
        default_for=(LATENCY_PREDICTION_INFO,),
        description="predicts each candidate's TTFT and TPOT and learns from the responses",
    )
