"""Admission: whether (and when) a request may go on to scheduling.

Two controllers, as the reference: legacy admission sheds sheddable requests (priority < 0)
when the pool is saturated; with the ``flowControl`` gate the request waits in the flow
controller's queues until it is dispatched, or ends with a rejection or eviction.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
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
from domain.requestcontrol.interfaces import SaturationDetector
from domain.scheduling.types import Candidate, InferenceRequest

__all__ = ["Admission", "FlowControlAdmission", "LegacyAdmission"]

SLO_TTFT_HEADER = "x-slo-ttft-ms"


class Admission(Protocol):
    """Raises an ``EppError`` (with its HTTP-mapped code) when the request may not go.

    ``candidates`` are the request's candidate endpoints. ``done`` is called once for
    every admitted request when it completes (capacity may have freed up).
    """

    #: The request may wait: candidates are looked up again once it is admitted.
    late_binding: bool

    async def admit(self, request: InferenceRequest, candidates: Sequence[Candidate]) -> None: ...

    def done(self) -> None: ...


class LegacyAdmission:
    """Sheddable (priority < 0) requests get 429 when the candidates are saturated."""

    late_binding = False

    def __init__(self, detector: SaturationDetector) -> None:
        self._detector = detector

    async def admit(self, request: InferenceRequest, candidates: Sequence[Candidate]) -> None:
        if request.priority < 0 and self._detector.saturation(candidates) >= 1.0:
            raise ResourceExhaustedError("system saturated, sheddable request dropped")

    def done(self) -> None:
        return None


class FlowControlAdmission:
    """The request waits for the flow controller's verdict (``enqueue_and_wait``).

    Outcomes map to errors as the reference: capacity rejection 429, TTL expiry 503,
    client gone 503, others 500; ours, displacement by higher-priority traffic, is 429.
    """

    late_binding = True

    def __init__(self, controller: FlowController, *, pool_name: str = "") -> None:
        self._controller = controller
        self._pool_name = pool_name

    async def admit(self, request: InferenceRequest, candidates: Sequence[Candidate]) -> None:
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

    def done(self) -> None:
        self._controller.notify()


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
