"""Admission: whether (and when) a request may go on to scheduling.

Two controllers, as the reference: legacy admission sheds sheddable requests (priority < 0)
when the pool is saturated; with the ``flowControl`` gate the request waits in the flow
controller's queues until it is dispatched, or ends with a rejection or eviction.

Either way admission returns the candidates to schedule on: it asks for them (the
``CandidateLookup``) at the moment it lets the request go, so a request that waited in a
queue is scheduled on the endpoints current when it leaves the queue.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

from domain.errors import (
    EppError,
    InternalError,
    ResourceExhaustedError,
    ServiceUnavailableError,
)
from domain.flowcontrol import (
    FlowController,
    FlowControlReason,
    FlowKey,
    FlowRequest,
    FlowResult,
    QueueOutcome,
)
from domain.requestcontrol.interfaces import CapacityDetector, SaturationDetector
from domain.scheduling.types import Candidate, InferenceRequest
from ports.observer import NoopObserver, Observer, Span

__all__ = [
    "Admission",
    "CandidateLookup",
    "FlowControlAdmission",
    "FlowSaturation",
    "LegacyAdmission",
]

SLO_TTFT_HEADER = "x-slo-ttft-ms"
#: The wait for flow control's verdict (attributes ``priority``, ``fairness_id``).
FLOW_CONTROL_SPAN = "gateway.flow_control"

#: The request's candidate endpoints as of now (after the gateway's subset hint).
CandidateLookup = Callable[[], list[Candidate]]


class Admission(Protocol):
    """Lets a request go and returns the candidates to schedule it on, or raises an
    ``EppError`` (with its HTTP-mapped code) when it may not go.

    ``candidates`` looks the request's candidate endpoints up; ``parent`` is the request's
    orchestration span, for a span of any wait. ``done`` is called once for every admitted
    request when it completes, whatever the outcome (capacity may have freed up).
    """

    async def admit(
        self, request: InferenceRequest, candidates: CandidateLookup, parent: Span
    ) -> list[Candidate]: ...

    def done(self, request: InferenceRequest) -> None: ...


class LegacyAdmission:
    """Sheddable (priority < 0) requests get 429 when the candidates are saturated."""

    def __init__(self, detector: SaturationDetector) -> None:
        self._detector = detector

    async def admit(
        self, request: InferenceRequest, candidates: CandidateLookup, parent: Span
    ) -> list[Candidate]:
        found = candidates()
        if request.priority < 0 and self._detector.saturation(found) >= 1.0:
            raise ResourceExhaustedError("system saturated, sheddable request dropped")
        return found

    def done(self, request: InferenceRequest) -> None:
        return None


class FlowControlAdmission:
    """The request waits for the flow controller's verdict (``enqueue_and_wait``).

    Outcomes map to errors as the reference: capacity rejection 429, TTL expiry 503,
    client gone 503, others 500; ours, displacement by higher-priority traffic, is 429.
    The wait is the span ``gateway.flow_control`` (a child of a recording ``parent`` only),
    marked as an error when the request is refused.
    """

    def __init__(
        self,
        controller: FlowController,
        *,
        pool_name: str = "",
        observer: Observer | None = None,
    ) -> None:
        self._controller = controller
        self._pool_name = pool_name
        self._observer: Observer = observer if observer is not None else NoopObserver()

    async def admit(
        self, request: InferenceRequest, candidates: CandidateLookup, parent: Span
    ) -> list[Candidate]:
        if not parent.recording:
            await self._wait(request)
            return candidates()
        span = self._observer.start_span(
            FLOW_CONTROL_SPAN,
            parent=parent,
            attributes={"priority": request.priority, "fairness_id": request.fairness_id},
        )
        try:
            await self._wait(request)
        except EppError as exc:
            span.record_error(exc.message)
            raise
        finally:
            span.end()
        return candidates()

    async def _wait(self, request: InferenceRequest) -> None:
        slo: int | None = None
        raw_slo = request.headers.get(SLO_TTFT_HEADER)
        if raw_slo and raw_slo.strip().isdigit():
            slo = int(raw_slo)
        result = await self._controller.enqueue_and_wait(
            FlowRequest(
                request_id=request.request_id,
                flow_key=FlowKey(request.fairness_id, request.priority),
                byte_size=request.request_size_bytes,
                received_at=request.received_at or time.monotonic(),
                slo_ttft_ms=slo,
                inference_pool=self._pool_name,
                model_name=request.incoming_model,
                target_model_name=request.target_model,
            )
        )
        if result.outcome is QueueOutcome.DISPATCHED:
            return
        raise _error_of(result)

    def done(self, request: InferenceRequest) -> None:
        """The request no longer counts in flight for its flow (and capacity may have
        freed up: the controller runs a dispatch cycle)."""
        self._controller.release(FlowKey(request.fairness_id, request.priority))


def _error_of(result: FlowResult) -> EppError:
    outcome = result.outcome
    message = str(result.error) if result.error is not None else str(outcome)
    if outcome is QueueOutcome.REJECTED_CAPACITY:
        return ResourceExhaustedError(message)
    if outcome is QueueOutcome.EVICTED_TTL:
        return ServiceUnavailableError(f"request timed out in queue: {message}")
    if outcome is QueueOutcome.EVICTED_CONTEXT_CANCELLED:
        return ServiceUnavailableError(f"client disconnected: {message}")
    if result.error is not None and result.error.reason is FlowControlReason.DISPLACED:
        return ResourceExhaustedError(message)
    return InternalError(message)


class FlowSaturation:
    """The pool's saturation as flow control reads it (``FlowController``'s ``saturation``).

    The detector's saturation over the candidates ``candidates()`` returns; when the
    detector also knows their capacity in requests (``CapacityDetector``), the requests
    the controller has in flight over the pool (``FlowController.pool_in_flight``) divided
    by it, if higher. Set ``controller`` once the controller is built."""

    def __init__(
        self, detector: SaturationDetector, candidates: Callable[[], list[Candidate]]
    ) -> None:
        self._detector = detector
        self._capacity = detector if isinstance(detector, CapacityDetector) else None
        self._candidates = candidates
        self.controller: FlowController | None = None

    def __call__(self) -> float:
        candidates = self._candidates()
        value = self._detector.saturation(candidates)
        if self._capacity is None or self.controller is None:
            return value
        capacity = self._capacity.capacity(candidates)
        if capacity is None:
            return value
        in_flight = self.controller.pool_in_flight()
        if capacity <= 0:
            return max(value, 1.0 if in_flight else 0.0)
        return max(value, in_flight / capacity)
