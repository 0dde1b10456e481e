"""The vocabulary of flow control: flow keys, requests, outcomes and errors.

These are the values a caller of ``FlowController.enqueue_and_wait`` builds and gets back.
Outcome values, their string forms and the error messages are the reference EPP's, so
metric labels and log lines read the same; ``DISPLACED`` is ours (the reference never
displaced queued requests).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, IntEnum
from typing import Any, ClassVar

__all__ = [
    "ERR_EVICTED",
    "ERR_REJECTED",
    "FlowControlError",
    "FlowControlReason",
    "FlowKey",
    "FlowRequest",
    "FlowResult",
    "QueueOutcome",
    "RequestEvictedError",
    "RequestRejectedError",
]


@dataclass(frozen=True, slots=True)
class FlowKey:
    """A flow: the fairness id (``x-gateway-inference-fairness-id``) within a priority.

    Rendered ``"id:priority"``. Keys order higher priority first, then by id.
    """

    id: str
    priority: int

    def __str__(self) -> str:
        return f"{self.id}:{self.priority}"

    def _rank(self) -> tuple[int, str]:
        return (-self.priority, self.id)

    def __lt__(self, other: FlowKey) -> bool:
        return self._rank() < other._rank()

    def __le__(self, other: FlowKey) -> bool:
        return self._rank() <= other._rank()

    def __gt__(self, other: FlowKey) -> bool:
        return self._rank() > other._rank()

    def __ge__(self, other: FlowKey) -> bool:
        return self._rank() >= other._rank()


_OUTCOME_LABELS = (
    "NotYetFinalized",
    "Dispatched",
    "RejectedCapacity",
    "RejectedOther",
    "EvictedTTL",
    "EvictedContextCancelled",
    "EvictedOther",
)


class QueueOutcome(IntEnum):
    """How a request left flow control. ``str()`` is the reference's form (a metric label)."""

    NOT_YET_FINALIZED = 0
    DISPATCHED = 1
    REJECTED_CAPACITY = 2
    REJECTED_OTHER = 3
    EVICTED_TTL = 4
    EVICTED_CONTEXT_CANCELLED = 5
    EVICTED_OTHER = 6

    @property
    def label(self) -> str:
        return _OUTCOME_LABELS[self.value]

    def __str__(self) -> str:
        return _OUTCOME_LABELS[self.value]


#: The family message of requests refused before they were queued.
ERR_REJECTED = "request rejected pre-queue"
#: The family message of requests removed from a queue without being dispatched.
ERR_EVICTED = "request evicted from queue"


class FlowControlReason(Enum):
    """Why a request was rejected or evicted; the value is the message."""

    QUEUE_AT_CAPACITY = "queue at capacity"
    TTL_EXPIRED = "request TTL expired"
    CONTEXT_CANCELLED = "request context cancelled"
    NOT_RUNNING = "flow controller is not running"
    DISPLACED = "request displaced by higher-priority traffic"
    INTERNAL = "flow control internal error"


class FlowControlError(Exception):
    """A request-level flow-control failure, returned in ``FlowResult.error`` (not raised).

    ``str(error)`` is ``"<family>: <reason>"``, e.g. ``"request rejected pre-queue: queue
    at capacity"``; ``reason`` is the machine-readable cause.
    """

    family: ClassVar[str] = "flow control error"

    def __init__(self, reason: FlowControlReason) -> None:
        super().__init__(f"{self.family}: {reason.value}")
        self.reason = reason

    @property
    def message(self) -> str:
        return str(self)


class RequestRejectedError(FlowControlError):
    """Refused before being queued (capacity, controller not running, internal error)."""

    family = ERR_REJECTED


class RequestEvictedError(FlowControlError):
    """Removed from its queue without being dispatched (TTL, cancellation, displacement)."""

    family = ERR_EVICTED


@dataclass(frozen=True, slots=True, kw_only=True)
class FlowRequest:
    """One request submitted to flow control.

    - ``request_id``: the ``x-request-id`` (logs only, never a metric label);
    - ``flow_key``: fairness id and priority;
    - ``byte_size``: the request body size, counted against the byte capacities;
    - ``received_at``: when the gateway received it, on the controller's clock (monotonic
      seconds); its TTL runs from here;
    - ``ttl``: seconds the request may wait; 0 uses the controller's
      ``default_request_ttl``, and when that is 0 too the request waits until dispatched or
      cancelled;
    - ``slo_ttft_ms``: the ``x-slo-ttft-ms`` header (ms), for SLO-deadline ordering; None
      or <= 0 means no SLO;
    - ``inference_pool``, ``model_name``, ``target_model_name``: metric labels;
    - ``payload``: anything the caller wants back with the request (flow control never
      looks at it).
    """

    request_id: str
    flow_key: FlowKey
    byte_size: int = 0
    received_at: float
    ttl: float = 0.0
    slo_ttft_ms: float | None = None
    inference_pool: str = ""
    model_name: str = ""
    target_model_name: str = ""
    payload: Any = None


@dataclass(frozen=True, slots=True, kw_only=True)
class FlowResult:
    """The one final outcome of ``enqueue_and_wait``.

    ``error`` is None exactly when ``outcome`` is ``DISPATCHED``. ``queue_time`` is the
    seconds from the ``enqueue_and_wait`` call to the outcome.
    """

    outcome: QueueOutcome
    error: FlowControlError | None = None
    queue_time: float = 0.0

    @property
    def dispatched(self) -> bool:
        return self.outcome is QueueOutcome.DISPATCHED
