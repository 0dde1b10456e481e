"""``fcfs-ordering-policy``: first come, first served within a flow (the default).

Earlier enqueue time first (ties: arrival order). Arrival order is its order, so its
flows use the FIFO ``ListQueue``.
"""

from __future__ import annotations

from domain.flowcontrol.queues import QueueItem
from domain.plugins.base import EmptyParameters, PluginRegistry, TypedName, class_factory

__all__ = ["TYPE", "FcfsOrderingPolicy", "register"]

TYPE = "fcfs-ordering-policy"


class FcfsOrderingPolicy:
    """Orders by enqueue time."""

    __slots__ = ("typed_name",)

    requires_priority_queue = False

    def __init__(self, typed_name: TypedName, parameters: EmptyParameters) -> None:
        self.typed_name = typed_name

    def order_key(self, item: QueueItem) -> tuple[float, float]:
        return (item.enqueued_at, 0.0)


def register(registry: PluginRegistry) -> None:
    registry.register(
        TYPE,
        class_factory(TYPE, FcfsOrderingPolicy),
        description="flow control: first come, first served within a flow",
    )
