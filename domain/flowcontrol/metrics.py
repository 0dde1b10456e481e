"""The flow-control metric names (the reference's, plus ``displaced_total``) and the
bound on the request-derived ``fairness_id`` label."""

from __future__ import annotations

__all__ = [
    "DISPATCH_CYCLE_DURATION",
    "DISPLACED_TOTAL",
    "ENQUEUE_DURATION",
    "OVERFLOW_LABEL",
    "POOL_SATURATION",
    "QUEUE_BYTES",
    "QUEUE_DURATION",
    "QUEUE_SIZE",
    "BoundedLabel",
]

_PREFIX = "inference_extension_flow_control_"

#: Histogram {fairness_id, priority, outcome, inference_pool, model_name,
#: target_model_name}: seconds from enqueue to the final outcome, every request.
QUEUE_DURATION = _PREFIX + "request_queue_duration_seconds"
#: Histogram {fairness_id, priority, outcome}: seconds spent in the enqueue step (capacity
#: checks, displacement, insertion); ``outcome`` is the state right after it
#: (``NotYetFinalized`` when queued, ``Dispatched`` on the fast path, ``Rejected*``).
ENQUEUE_DURATION = _PREFIX + "request_enqueue_duration_seconds"
#: Gauge {fairness_id, priority, inference_pool, model_name, target_model_name}.
QUEUE_SIZE = _PREFIX + "queue_size"
#: Gauge, same labels: queued bytes.
QUEUE_BYTES = _PREFIX + "queue_bytes"
#: Histogram, no labels: seconds per dispatch cycle.
DISPATCH_CYCLE_DURATION = _PREFIX + "dispatch_cycle_duration_seconds"
#: Gauge {inference_pool}: the saturation last read.
POOL_SATURATION = _PREFIX + "pool_saturation"
#: Counter {priority}: queued requests displaced by higher-priority arrivals (ours).
DISPLACED_TOTAL = _PREFIX + "displaced_total"

#: The label value of every fairness id beyond the bound.
OVERFLOW_LABEL = "__overflow__"


class BoundedLabel:
    """Caps the distinct values of a label: the first ``limit`` values seen pass through,
    later new ones become ``OVERFLOW_LABEL`` (fairness ids come from a client header)."""

    __slots__ = ("_limit", "_seen")

    def __init__(self, limit: int = 1000) -> None:
        self._limit = limit
        self._seen: set[str] = set()

    def __call__(self, value: str) -> str:
        seen = self._seen
        if value in seen:
            return value
        if len(seen) < self._limit:
            seen.add(value)
            return value
        return OVERFLOW_LABEL
