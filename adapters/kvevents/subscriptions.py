"""One KV-event subscriber per endpoint of the pool, following the endpoint events."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import zmq.asyncio

from adapters.kvevents.subscriber import KVEventSubscriber, SubscriberConfig
from ports.endpoints import EndpointEvent, EndpointEventKind, EndpointInfo
from ports.kv_events import KVEventSink
from ports.observer import Observer

__all__ = ["KVEventSubscriptions"]

_log = logging.getLogger(__name__)


class KVEventSubscriptions:
    """Subscribes to ``tcp://<endpoint ip>:<port>`` for every endpoint that joins.

    ``replay_port`` (``None``: no replay) names the publisher's replay socket. A leaving
    endpoint's subscriber stops and the sink forgets the endpoint (so does one whose
    address changed; a joining one is not forgotten first: the shared copy of its blocks
    is what a new process loads). ``on_endpoint_event``
    is a datastore listener (called on the event loop); ``close`` stops everything.
    """

    def __init__(
        self,
        *,
        sink: KVEventSink,
        port: int = 5557,
        replay_port: int | None = None,
        config: SubscriberConfig | None = None,
        observer: Observer | None = None,
    ) -> None:
        self._sink = sink
        self._port = port
        self._replay_port = replay_port
        self._config = config
        self._observer = observer
        self._ctx = zmq.asyncio.Context()
        self._tasks: dict[str, tuple[KVEventSubscriber, asyncio.Task[None]]] = {}
        # endpoints added while no event loop ran: started by ``start_pending``
        self._pending: dict[str, tuple[str, str | None]] = {}

    def subscriber(self, endpoint: str) -> KVEventSubscriber | None:
        entry = self._tasks.get(endpoint)
        return entry[0] if entry is not None else None

    def on_endpoint_event(self, event: EndpointEvent, _endpoint: object = None) -> None:
        if event.kind is EndpointEventKind.DELETE:
            self.remove(event.endpoint.name)
        else:
            self.add(event.endpoint)

    def add(self, info: EndpointInfo) -> None:
        host = f"[{info.address.ip}]" if ":" in info.address.ip else info.address.ip
        address = f"tcp://{host}:{self._port}"
        current = self._tasks.get(info.name)
        if current is not None:
            if current[0].address == address:
                return
            # the same name at a new address: another server, its cache starts empty
            self.remove(info.name)
        replay = f"tcp://{host}:{self._replay_port}" if self._replay_port is not None else None
        self.add_address(info.name, address, replay)

    def add_address(self, endpoint: str, address: str, replay_address: str | None) -> None:
        """Follow ``address`` (and its replay socket) for ``endpoint``."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._pending[endpoint] = (address, replay_address)
            return
        subscriber = KVEventSubscriber(
            endpoint,
            address,
            sink=self._sink,
            context=self._ctx,
            replay_address=replay_address,
            config=self._config,
            observer=self._observer,
        )
        task = loop.create_task(self._run(subscriber), name=f"kv-events {endpoint}")
        self._tasks[endpoint] = (subscriber, task)

    def start_pending(self) -> None:
        """Start the subscribers of endpoints added while no event loop ran (call on it)."""
        pending, self._pending = self._pending, {}
        for endpoint, (address, replay) in pending.items():
            self.add_address(endpoint, address, replay)

    def remove(self, endpoint: str) -> None:
        self._pending.pop(endpoint, None)
        entry = self._tasks.pop(endpoint, None)
        if entry is not None:
            entry[1].cancel()
        self._sink.forget(endpoint)

    async def close(self) -> None:
        tasks = [task for _, task in self._tasks.values()]
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._ctx.term()

    @staticmethod
    async def _run(subscriber: KVEventSubscriber) -> None:
        try:
            await subscriber.run()
        except asyncio.CancelledError:
            raise
        except Exception:
            _log.exception("%s: KV-event subscriber failed", subscriber.endpoint)
