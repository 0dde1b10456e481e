"""``edf-ordering-policy``: earliest deadline first within a flow.

The deadline is the request's expiry (received time + effective TTL); a request without
a TTL has no deadline and sorts after every request that has one. Ties: earlier enqueue
time. Its flows use the ``MaxMinHeap``.
"""

from __future__ import annotations

from domain.flowcontrol.queues import QueueItem
from domain.plugins.base import EmptyParameters, PluginRegistry, TypedName, class_factory

__all__ = ["TYPE", "EdfOrderingPolicy", "register"]

TYPE = "edf-ordering-policy"


class EdfOrderingPolicy:
    """Orders by TTL deadline, then enqueue time."""

    __slots__ = ("typed_name",)

    requires_priority_queue = True

    def __init__(self, typed_name: TypedName, parameters: EmptyParameters) -> None:
        self.typed_name = typed_name

    def order_key(self, item: QueueItem) -> tuple[float, float]:
        return (item.expires_at, item.enqueued_at)


def register(registry: PluginRegistry) -> None:
    registry.register(
        TYPE,
        class_factory(TYPE, EdfOrderingPolicy),
        description="flow control: earliest TTL deadline first within a flow",
    )
