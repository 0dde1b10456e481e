"""``global-strict-fairness-policy``: the band's best head wins (the default).

Compares the head request of every non-empty flow in the band by the band's ordering
(``QueueItem.order``) and picks the flow whose head sorts first; with FCFS ordering this
is the band-wide oldest request. All flows of a band share the band's ordering policy, so
their orders are always comparable. With FIFO queues (arrival-ordered policies) the best
head is the band's oldest request, found in O(1); with heap queues (EDF, SLO deadline) the
heads of all non-empty flows are compared, O(flows).
"""

from __future__ import annotations

from typing import Any

from domain.flowcontrol.interfaces import BandView
from domain.flowcontrol.queues import FlowQueue
from domain.plugins.base import EmptyParameters, PluginRegistry, TypedName, class_factory

__all__ = ["TYPE", "GlobalStrictFairnessPolicy", "register"]

TYPE = "global-strict-fairness-policy"


class GlobalStrictFairnessPolicy:
    """Picks the queue whose head sorts first; stateless."""

    __slots__ = ("typed_name",)

    def __init__(self, typed_name: TypedName, parameters: EmptyParameters) -> None:
        self.typed_name = typed_name

    def new_state(self) -> Any:
        return None

    def pick_flow(self, state: Any, band: BandView) -> FlowQueue | None:
        queues = band.queues
        if band.arrival_ordered:
            # FIFO queues: the band-wide best head is the band's oldest request.
            oldest = band.oldest
            return None if oldest is None else queues.get(oldest.request.flow_key.id)
        best: FlowQueue | None = None
        best_order: tuple[float, float, int] | None = None
        for queue in queues.values():
            head = queue.peek_head()
            if head is None:
                continue
            if best_order is None or head.order < best_order:
                best = queue
                best_order = head.order
        return best


def register(registry: PluginRegistry) -> None:
    registry.register(
        TYPE,
        class_factory(TYPE, GlobalStrictFairnessPolicy),
        description="flow control: dispatch the band's best head request across flows",
    )
