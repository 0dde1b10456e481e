"""``DegradedGauge``: one ``..._shared_state_degraded`` gauge for every shared component.

Several components of one process use the shared store (the approximate prefix index, the
KV-block index of precise routing) and each knows only its own health. The gauge users
read is the process's: 1 while any of them is degraded, else 0.
"""

from __future__ import annotations

from ports.metric_catalogue import SHARED_STATE_DEGRADED
from ports.observer import Observer

__all__ = ["DegradedGauge"]

_NO_LABELS: dict[str, str] = {}


class DegradedGauge:
    """Each component reports its own state (``set``); the gauge is 1 while any is degraded.
    Event loop only."""

    def __init__(self, observer: Observer) -> None:
        self._observer = observer
        self._degraded: set[str] = set()

    def set(self, component: str, degraded: bool) -> None:
        if degraded:
            self._degraded.add(component)
        else:
            self._degraded.discard(component)
        self._observer.gauge(SHARED_STATE_DEGRADED, _NO_LABELS, 1.0 if self._degraded else 0.0)

    @property
    def degraded(self) -> bool:
        return bool(self._degraded)
