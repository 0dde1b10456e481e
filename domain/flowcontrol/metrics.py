"""The bound on the request-derived ``fairness_id`` label of the flow-control metrics
(the metrics themselves are ``FLOW_CONTROL_*`` in ``ports.metric_catalogue``)."""

from __future__ import annotations

__all__ = ["OVERFLOW_LABEL", "BoundedLabel"]

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
