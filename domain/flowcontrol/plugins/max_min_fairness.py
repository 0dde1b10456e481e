"""``max-min-fairness-policy``: the flow with the fewest requests in flight goes next.

Max-min fairness on concurrency: each time the band may dispatch, the non-empty flow
with the fewest requests dispatched and not yet done goes first (ties: the head that sorts
first by the band's ordering, so arrival order under FCFS). A flow that asks for less than
an equal share of the pool's concurrency therefore never waits behind one that has more,
and flows that all ask for more end up with equal shares.

Counts are the pool's (``BandView.pool_in_flight``) when the flow controller shares its
flows with the pool's other processes (``domain.flowcontrol.pool``), so a tenant gets its
share of the pool however its requests spread over replicas and workers. Then, when a
flow that waits only at another process has fewer requests in flight over the pool than
the best flow here, this process dispatches nothing from the band: the room goes to that
other process, which sees it within its shared state's staleness. Alone, the counts are
this process's.
"""

from __future__ import annotations

from typing import Any

from domain.flowcontrol.interfaces import BandView
from domain.flowcontrol.queues import FlowQueue
from domain.plugins.base import EmptyParameters, PluginRegistry, TypedName, class_factory

__all__ = ["TYPE", "MaxMinFairnessPolicy", "register"]

TYPE = "max-min-fairness-policy"


class MaxMinFairnessPolicy:
    """Picks the flow with the fewest requests in flight over the pool; stateless."""

    __slots__ = ("typed_name",)

    def __init__(self, typed_name: TypedName, parameters: EmptyParameters) -> None:
        self.typed_name = typed_name

    def new_state(self) -> Any:
        return None

    def pick_flow(self, state: Any, band: BandView) -> FlowQueue | None:
        best: FlowQueue | None = None
        best_count = 0
        best_order: tuple[float, float, int] | None = None
        for queue in band.queues.values():
            head = queue.peek_head()
            if head is None:
                continue
            count = band.pool_in_flight(queue.flow_id)
            if (
                best_order is None
                or count < best_count
                or (count == best_count and head.order < best_order)
            ):
                best, best_count, best_order = queue, count, head.order
        if best is None:
            return None
        for _key, count in band.waiting_elsewhere():
            if count < best_count:
                return None  # a flow further below its share waits at another process
        return best


def register(registry: PluginRegistry) -> None:
    registry.register(
        TYPE,
        class_factory(TYPE, MaxMinFairnessPolicy),
        description=(
            "flow control: the flow with the fewest requests in flight over the pool goes"
            " next (max-min fairness, shared by every replica and worker)"
        ),
    )
