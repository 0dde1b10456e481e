"""``slo-deadline-ordering-policy``: earliest time-to-first-token deadline first.

The deadline is the received time + ``x-slo-ttft-ms``; a request without an SLO (no
header, or <= 0) sorts after every request with one. Ties: earlier received time. Its
flows use the ``MaxMinHeap``.
"""

from __future__ import annotations

import math

from domain.flowcontrol.queues import QueueItem
from domain.plugins.base import EmptyParameters, PluginRegistry, TypedName, class_factory

__all__ = ["TYPE", "SloDeadlineOrderingPolicy", "register"]

TYPE = "slo-deadline-ordering-policy"


class SloDeadlineOrderingPolicy:
    """Orders by received time + TTFT SLO, then received time."""

    __slots__ = ("typed_name",)

    requires_priority_queue = True

    def __init__(self, typed_name: TypedName, parameters: EmptyParameters) -> None:
        self.typed_name = typed_name

    def order_key(self, item: QueueItem) -> tuple[float, float]:
        request = item.request
        slo = request.slo_ttft_ms
        received = request.received_at
        if slo is None or not slo > 0:
            return (math.inf, received)
        return (received + slo / 1000.0, received)


def register(registry: PluginRegistry) -> None:
    registry.register(
        TYPE,
        class_factory(TYPE, SloDeadlineOrderingPolicy),
        description="flow control: earliest x-slo-ttft-ms deadline first within a flow",
    )
