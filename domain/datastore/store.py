"""The endpoint store: the current set of endpoints, fed by ``EndpointEvent``s."""

from __future__ import annotations

import logging

from ports.endpoints import EndpointEvent, EndpointEventKind, EndpointInfo

__all__ = ["Datastore"]

logger = logging.getLogger(__name__)


class Datastore:
    """Holds the pool's endpoints. Mutated and read on the event loop thread only.

    Readers get an immutable tuple snapshot (``endpoints()``), rebuilt once per change,
    so the request path never copies per request.
    """

    def __init__(self) -> None:
        self._by_name: dict[str, EndpointInfo] = {}
        self._snapshot: tuple[EndpointInfo, ...] = ()
        self._synced = False

    # EndpointSink
    def apply(self, event: EndpointEvent) -> None:
        name = event.endpoint.name
        if event.kind is EndpointEventKind.DELETE:
            if self._by_name.pop(name, None) is None:
                return
            logger.info("endpoint removed: %s", name)
        else:
            previous = self._by_name.get(name)
            if previous == event.endpoint:
                return
            self._by_name[name] = event.endpoint
            logger.info("endpoint %s: %s", "updated" if previous else "added", event.endpoint.name)
        self._snapshot = tuple(self._by_name.values())

    def mark_synced(self) -> None:
        if not self._synced:
            logger.info("endpoint set synced: %d endpoint(s)", len(self._by_name))
        self._synced = True

    def clear(self) -> None:
        self._by_name.clear()
        self._snapshot = ()

    @property
    def synced(self) -> bool:
        return self._synced

    def endpoints(self) -> tuple[EndpointInfo, ...]:
        """An immutable snapshot of the current endpoints."""
        return self._snapshot
