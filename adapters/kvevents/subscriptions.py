"""One KV-event subscriber per endpoint of the pool, following the endpoint events."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import zmq.asyncio

from adapters.kvevents.subscriber import KVEventSubscriber, SubscriberConfig
from ports.endpoints import EndpointEvent, EndpointEventKind, EndpointInfo
from ports.kv_events import KVEventSink, rank_key
from ports.observer import Observer

__all__ = ["KVEventSubscriptions"]

_log = logging.getLogger(__name__)


class KVEventSubscriptions:
    """Subscribes to every endpoint that joins, at ``tcp://<endpoint ip>:<port + rank>``.

    Data-parallel engines each publish on the base port plus their rank (vLLM's
    convention, the replay socket likewise), and each has its own KV cache:

    - one engine per endpoint (``data_parallel_size`` 1): endpoint ``<pod>-rank-<i>``
      (target port ``i``) is engine ``i``: its publisher is ``port + i`` and its events
      are the sink's ``endpoint``;
    - ``data_parallel_size`` N > 1 engines behind each endpoint's one port (vLLM's
      internal load balancing): engine ``r`` publishes on ``port + r`` and its events are
      the sink's ``rank_key(endpoint, r)``, one subscriber each.

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
        data_parallel_size: int = 1,
    ) -> None:
        if data_parallel_size < 1:
            raise ValueError("data_parallel_size must be >= 1")
        self._ranks = data_parallel_size
        self._sink = sink
        self._port = port
        self._replay_port = replay_port
        self._config = config
        self._observer = observer
        self._ctx = zmq.asyncio.Context()
        self._tasks: dict[str, tuple[KVEventSubscriber, asyncio.Task[None]]] = {}
        # endpoints added while no event loop ran: started by ``start_pending``
        self._pending: dict[str, tuple[str, str | None]] = {}
        # endpoint -> the sink names of its engines (itself, or one per rank)
        self._keys: dict[str, list[str]] = {}
        # cancelled by ``remove``, not yet ended (their sockets close as they end)
        self._ending: set[asyncio.Task[None]] = set()

    def subscriber(self, endpoint: str) -> KVEventSubscriber | None:
        entry = self._tasks.get(endpoint)
        return entry[0] if entry is not None else None

    def on_endpoint_event(self, event: EndpointEvent, _endpoint: object = None) -> None:
        if event.kind is EndpointEventKind.DELETE:
            self.remove(event.endpoint.name)
        else:
            self.add(event.endpoint)

    def keys(self, endpoint: str) -> list[str]:
        """The sink's names of ``endpoint``'s engines."""
        if self._ranks == 1:
            return [endpoint]
        return [rank_key(endpoint, rank) for rank in range(self._ranks)]

    def add(self, info: EndpointInfo) -> None:
        host = f"[{info.address.ip}]" if ":" in info.address.ip else info.address.ip
        if self._ranks == 1:
            engines = [(info.name, info.rank)]
        else:
            engines = [(rank_key(info.name, r), r) for r in range(self._ranks)]
        first = f"tcp://{host}:{self._port + engines[0][1]}"
        current = self._tasks.get(engines[0][0])
        if current is not None:
            if current[0].address == first:
                return
            # the same name at a new address: another server, its cache starts empty
            self.remove(info.name)
        self._keys[info.name] = [key for key, _ in engines]
        for key, rank in engines:
            replay = None
            if self._replay_port is not None:
                replay = f"tcp://{host}:{self._replay_port + rank}"
            self.add_address(key, f"tcp://{host}:{self._port + rank}", replay)

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
        for key in self._keys.pop(endpoint, None) or self.keys(endpoint):
            self._pending.pop(key, None)
            entry = self._tasks.pop(key, None)
            if entry is not None:
                entry[1].cancel()
                self._ending.add(entry[1])
                entry[1].add_done_callback(self._ending.discard)
                entry[0].forget_metrics()
            self._sink.forget(key)

    async def close(self) -> None:
        # every socket must be closed before the context ends, or ``term`` waits for ever
        tasks = [task for _, task in self._tasks.values()] + list(self._ending)
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._ctx.term()

    async def _run(self, subscriber: KVEventSubscriber) -> None:
        """Runs ``subscriber`` until cancelled, restarting it after each failure."""
        config = self._config if self._config is not None else SubscriberConfig()
        backoff = config.restart_backoff
        while True:
            started = time.monotonic()
            try:
                await subscriber.run()
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if time.monotonic() - started >= config.restart_backoff_max:
                    backoff = config.restart_backoff  # it had run well for a while
                subscriber.failed()
                _log.error(
                    "%s: KV-event subscriber failed (%r); its entries are not used until it "
                    "follows the stream again; restarting in %.2gs",
                    subscriber.endpoint,
                    exc,
                    backoff,
                    exc_info=subscriber.failures == 1,  # the traceback once per endpoint
                )
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, config.restart_backoff_max)
