"""``round-robin-fairness-policy``: flows of a band take turns.

The non-empty flows are taken in fairness-id order, starting after the flow picked last
in this band (wrapping around), so each waiting flow dispatches once per round whatever
its backlog.
"""

from __future__ import annotations

import bisect
from typing import Any

from domain.flowcontrol.interfaces import BandView
from domain.flowcontrol.queues import FlowQueue
from domain.plugins.base import EmptyParameters, PluginRegistry, TypedName, class_factory

__all__ = ["TYPE", "RoundRobinFairnessPolicy", "RoundRobinState", "register"]

TYPE = "round-robin-fairness-policy"


class RoundRobinState:
    """Per band: the fairness id picked last."""

    __slots__ = ("last",)

    def __init__(self) -> None:
        self.last: str | None = None


class RoundRobinFairnessPolicy:
    """Picks the next non-empty flow after the last one, in id order."""

    __slots__ = ("typed_name",)

    def __init__(self, typed_name: TypedName, parameters: EmptyParameters) -> None:
        self.typed_name = typed_name

    def new_state(self) -> Any:
        return RoundRobinState()

    def pick_flow(self, state: Any, band: BandView) -> FlowQueue | None:
        queues = band.queues
        if not queues:
            return None
        ids = sorted(queues)
        last = state.last
        position = 0 if last is None else bisect.bisect_right(ids, last)
        if position >= len(ids):
            position = 0
        chosen = ids[position]
        state.last = chosen
        return queues[chosen]


def register(registry: PluginRegistry) -> None:
    registry.register(
        TYPE,
        class_factory(TYPE, RoundRobinFairnessPolicy),
        description="flow control: flows of a band take turns (round robin by fairness id)",
    )
