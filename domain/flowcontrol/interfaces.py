"""The flow-control policy extension points, and the timer service the controller uses.

Policies are plugins (``typed_name``); one instance may serve several bands, so any
per-band state lives in the object ``FairnessPolicy.new_state`` returns.

- ``OrderingPolicy``: the order of requests within a flow. ``order_key`` is called once
  per request when it is queued; items sort by ``(key[0], key[1], arrival)``. A policy
  whose order is not arrival order sets ``requires_priority_queue`` so its flows get a
  ``MaxMinHeap`` (otherwise a FIFO ``ListQueue``, whose head is simply the oldest item).
- ``FairnessPolicy``: which flow of a band dispatches next, from the band's non-empty
  queues (keyed by fairness id), given as a ``BandView``, or None to dispatch nothing
  from the band now (the controller tries again at its next cycle). (The method is
  ``pick_flow``, not ``pick``: extension points are found structurally, and ``pick``
  would make a fairness policy look like a scheduling Picker.)
- ``UsageLimitPolicy``: the saturation ceiling of each band. ``priorities`` run from the
  highest to the lowest; the result has one ceiling per priority, in the same order. A
  band dispatches only while the pool's saturation is below its ceiling.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from domain.flowcontrol.queues import FlowQueue, QueueItem
from ports.plugins import TypedName

__all__ = [
    "BandView",
    "FairnessPolicy",
    "LoopTimers",
    "OrderingPolicy",
    "TimerHandle",
    "Timers",
    "UsageLimitPolicy",
]


@runtime_checkable
class OrderingPolicy(Protocol):
    @property
    def typed_name(self) -> TypedName: ...

    @property
    def requires_priority_queue(self) -> bool: ...

    def order_key(self, item: QueueItem) -> tuple[float, float]:
        """Smaller sorts first; ties go to the earlier arrival."""
        ...


class BandView(Protocol):
    """What a fairness policy sees of a priority band (read-only)."""

    @property
    def priority(self) -> int: ...

    @property
    def queues(self) -> Mapping[str, FlowQueue]:
        """The band's non-empty flow queues by fairness id (never empty when picking)."""
        ...

    @property
    def oldest(self) -> QueueItem | None:
        """The band's earliest-arrived queued request."""
        ...

    @property
    def arrival_ordered(self) -> bool:
        """True when every queue of the band is FIFO (its ordering policy's order is
        arrival order), so ``oldest`` is also the band's best head."""
        ...

    def pool_in_flight(self, flow_id: str) -> int:
        """The requests of flow ``flow_id`` dispatched and not yet done in the whole pool:
        this process's count plus the other processes' (``domain.flowcontrol.pool``; this
        process's alone when it shares nothing)."""
        ...

    def waiting_elsewhere(self) -> Iterator[tuple[str, int]]:
        """The flows of this band with requests waiting at other processes and none here:
        each flow's shared key and its in-flight count over the pool. Nothing when this
        process shares nothing."""
        ...


@runtime_checkable
class FairnessPolicy(Protocol):
    @property
    def typed_name(self) -> TypedName: ...

    def new_state(self) -> Any:
        """Fresh per-band state, passed back to ``pick_flow`` for that band."""
        ...

    def pick_flow(self, state: Any, band: BandView) -> FlowQueue | None:
        """One of ``band.queues``, or None to dispatch nothing from this band now."""
        ...


@runtime_checkable
class UsageLimitPolicy(Protocol):
    @property
    def typed_name(self) -> TypedName: ...

    def compute_limit(self, saturation: float, priorities: Sequence[int]) -> Sequence[float]:
        """One saturation ceiling per priority (highest first)."""
        ...


class TimerHandle(Protocol):
    def cancel(self) -> None: ...


class Timers(Protocol):
    """Schedules the controller's callbacks. ``when`` is on the controller's clock."""

    def call_at(self, when: float, callback: Callable[[], None]) -> TimerHandle: ...

    def call_soon(self, callback: Callable[[], None]) -> TimerHandle: ...


class LoopTimers:
    """``Timers`` on the running asyncio loop (must be used from the loop's thread).

    ``call_at`` converts the controller's clock to a delay, so the clock need not be the
    loop's own (uvloop's loop clock has millisecond resolution).
    """

    __slots__ = ("_clock",)

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock

    def call_at(self, when: float, callback: Callable[[], None]) -> TimerHandle:
        delay = when - self._clock()
        return asyncio.get_running_loop().call_later(delay if delay > 0 else 0.0, callback)

    def call_soon(self, callback: Callable[[], None]) -> TimerHandle:
        return asyncio.get_running_loop().call_soon(callback)
