"""What ``endpoint-attribute-filter`` and ``endpoint-attribute-scorer`` read: one numeric
value per endpoint, by name.

The name is looked up first in the candidate's attributes (what data producers and
extractors publish: a number, or an object with a numeric ``value``), then among the
model server's metrics of the endpoint's snapshot under their field names
(``waiting_queue_size``, ``running_requests_size``, ``kv_cache_usage_percent``,
``max_active_models``, ``cache_block_size``, ``cache_num_blocks``). Booleans are not numbers.
"""

from __future__ import annotations

import math

from domain.datastore.endpoint import EndpointMetrics
from domain.scheduling.types import Candidate

__all__ = ["METRIC_FIELDS", "attribute_value"]

#: The snapshot fields readable by name.
METRIC_FIELDS = frozenset(
    {
        "waiting_queue_size",
        "running_requests_size",
        "kv_cache_usage_percent",
        "max_active_models",
        "cache_block_size",
        "cache_num_blocks",
    }
)


def _number(value: object) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        number = float(value)
        return number if math.isfinite(number) else None
    inner = getattr(value, "value", None)
    if inner is not None and inner is not value:
        return _number(inner)
    return None


def attribute_value(candidate: Candidate, name: str) -> float | None:
    """The value of attribute ``name`` on ``candidate``; None when it has none."""
    value = candidate.attributes.get(name)
    if value is not None:
        return _number(value)
    if name in METRIC_FIELDS:
        metrics: EndpointMetrics | None = candidate.metrics
        if metrics is not None:
            return _number(getattr(metrics, name))
    return None
