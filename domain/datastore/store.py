"""The endpoint store: the pool's endpoints, fed by ``EndpointEvent``s."""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection

from domain.datastore.endpoint import Endpoint
from ports.endpoints import EndpointEvent, EndpointEventKind

__all__ = ["Datastore", "EndpointListener"]

logger = logging.getLogger(__name__)

#: Called with the event and the live endpoint after each change of the endpoint set.
EndpointListener = Callable[[EndpointEvent, Endpoint], None]


class Datastore:
    """Holds the pool's endpoints. Mutated and read on the event loop thread only.

    ``endpoints()`` returns an immutable tuple rebuilt once per change, so the request path
    never copies per request. Listeners (collectors, plugins that prune per-endpoint
    state) hear of every add, update and delete.
    """

    def __init__(self) -> None:
        self._by_name: dict[str, Endpoint] = {}
        self._snapshot: tuple[Endpoint, ...] = ()
        self._synced = False
        self._listeners: list[EndpointListener] = []

    def subscribe(self, listener: EndpointListener) -> None:
        self._listeners.append(listener)

    @property
    def listener_count(self) -> int:
        return len(self._listeners)

    def unsubscribe_owned_by(self, owners: Collection[object]) -> int:
        """Drops the listeners that are bound methods of ``owners`` (the plugins of a config
        that was replaced); returns how many."""
        kept = [
            listener
            for listener in self._listeners
            if not any(getattr(listener, "__self__", None) is owner for owner in owners)
        ]
        dropped = len(self._listeners) - len(kept)
        self._listeners = kept
        return dropped

    # EndpointSink
    def apply(self, event: EndpointEvent) -> None:
        name = event.endpoint.name
        existing = self._by_name.get(name)
        if event.kind is EndpointEventKind.DELETE:
            if existing is None:
                return
            del self._by_name[name]
            logger.info("endpoint removed: %s", name)
            endpoint = existing
        elif existing is None:
            endpoint = Endpoint(info=event.endpoint)
            self._by_name[name] = endpoint
            logger.info("endpoint added: %s (%s)", name, event.endpoint.address.host_port())
        elif existing.info == event.endpoint:
            return
        else:
            existing.info = event.endpoint
            endpoint = existing
            logger.info("endpoint updated: %s", name)
        self._snapshot = tuple(self._by_name.values())
        for listener in self._listeners:
            listener(event, endpoint)

    def mark_synced(self) -> None:
        if not self._synced:
            logger.info("endpoint set synced: %d endpoint(s)", len(self._by_name))
        self._synced = True

    def mark_unsynced(self) -> None:
        if self._synced:
            logger.warning("endpoint set no longer known: not ready until it is synced again")
        self._synced = False

    @property
    def synced(self) -> bool:
        return self._synced

    def endpoints(self) -> tuple[Endpoint, ...]:
        """An immutable tuple of the current endpoints."""
        return self._snapshot

    def get(self, name: str) -> Endpoint | None:
        return self._by_name.get(name)
