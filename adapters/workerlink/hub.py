"""The supervisor's side: tees the pod's data layer into every connected worker.

``SupervisorHub`` wraps the ports the data layer feeds (``sink``, ``objectives``,
``polling``, ``notifications``): each call reaches the wrapped object as before and is
relayed to every worker. It keeps the current state (endpoints, synced, objectives, rewrite
rules, the last poll result per source and endpoint, the live watched objects), so a worker
that connects late, or is restarted, gets the whole picture first and then the changes, in
order. A worker whose unread backlog passes ``max_backlog_bytes`` is disconnected (it stops
and is restarted) rather than growing the supervisor's memory.

A source whose results only the supervisor needs to read (its extractors' output is the
endpoint's metrics snapshot) is not teed: the supervisor relays the snapshot its extractors
made instead (``metrics_snapshot``), so the workers do not parse each scrape again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from adapters.workerlink.frames import (
    MalformedFrameError,
    MetricsSnapshot,
    decode_message,
    encode_frame,
    encode_snapshot_frame,
    read_frame,
)
from ports.datalayer import (
    NotificationEvent,
    NotificationKind,
    NotificationSource,
    PollingDataSource,
)
from ports.endpoints import EndpointEvent, EndpointEventKind, EndpointInfo, EndpointSink
from ports.objectives import ModelRewriteRule, ObjectiveSink
from ports.plugins import TypedName

__all__ = ["HandedConnections", "SupervisorHub", "WorkerStatus"]

logger = logging.getLogger(__name__)

HELLO_TIMEOUT = 5.0


@dataclass(frozen=True, slots=True)
class HandedConnections:
    """What a worker last reported of the connections handed to it (since it started):
    how many it took off its handoff socket, how many of them are open and still take new
    streams, and how many ext_proc calls it started."""

    received: int = 0
    accepting: int = 0
    calls: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerStatus:
    """What a connected worker last reported."""

    worker_id: int
    pid: int
    ready: bool
    metrics_port: int
    connections: HandedConnections = HandedConnections()


@dataclass(slots=True)
class _Peer:
    worker_id: int
    pid: int
    writer: asyncio.StreamWriter
    ready: bool = False
    metrics_port: int = 0
    connections: HandedConnections = HandedConnections()


def _object_key(event: NotificationEvent) -> tuple[str, str]:
    metadata = event.object.get("metadata") if isinstance(event.object, Mapping) else None
    if not isinstance(metadata, Mapping):
        return ("", "")
    return (str(metadata.get("namespace", "")), str(metadata.get("name", "")))


class SupervisorHub:
    """Listens on ``path`` (a unix socket); see the module docstring."""

    def __init__(self, path: str, *, max_backlog_bytes: int = 256 * 1024 * 1024) -> None:
        self.path = path
        self._max_backlog = max_backlog_bytes
        self._server: asyncio.AbstractServer | None = None
        self._peers: dict[int, _Peer] = {}
        self._endpoints: dict[str, EndpointInfo] = {}
        self._synced = False
        self._priorities: Mapping[str, int | None] | None = None
        self._rules: Sequence[ModelRewriteRule] | None = None
        self._polls: dict[tuple[str, str], bytes] = {}  # the last frame of each
        self._watched: dict[str, dict[tuple[str, str], NotificationEvent]] = {}
        self._handlers: set[asyncio.Task[None]] = set()
        self._connections: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._accept, path=self.path)
        os.chmod(self.path, 0o600)

    async def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
        self._peers.clear()
        for writer in list(self._connections):
            writer.close()  # its handler reads the end of the stream and returns
        if self._handlers:
            _, pending = await asyncio.wait(list(self._handlers), timeout=5)
            for task in pending:
                task.cancel()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    # --- what the supervisor reads ---

    def workers(self) -> list[WorkerStatus]:
        return [
            WorkerStatus(
                worker_id=p.worker_id,
                pid=p.pid,
                ready=p.ready,
                metrics_port=p.metrics_port,
                connections=p.connections,
            )
            for p in sorted(self._peers.values(), key=lambda p: p.worker_id)
        ]

    def ready_workers(self) -> int:
        return sum(1 for peer in self._peers.values() if peer.ready)

    def is_ready(self, worker_id: int) -> bool:
        peer = self._peers.get(worker_id)
        return peer is not None and peer.ready

    def connections(self, worker_id: int) -> HandedConnections | None:
        """What ``worker_id`` last reported of its handed connections (None: not connected)."""
        peer = self._peers.get(worker_id)
        return None if peer is None else peer.connections

    def disconnect(self, worker_id: int) -> None:
        peer = self._peers.pop(worker_id, None)
        if peer is not None:
            peer.writer.close()

    # --- tees of the data layer's ports ---

    def sink(self, inner: EndpointSink) -> EndpointSink:
        return _TeeSink(self, inner)

    def objectives(self, inner: ObjectiveSink) -> ObjectiveSink:
        return _TeeObjectives(self, inner)

    def polling(self, inner: PollingDataSource) -> PollingDataSource:
        return _TeePolling(self, inner)

    def notifications(self, inner: NotificationSource) -> NotificationSource:
        return _TeeNotifications(self, inner)

    # --- relaying ---

    def endpoint_event(self, event: EndpointEvent) -> None:
        name = event.endpoint.name
        if event.kind is EndpointEventKind.DELETE:
            self._endpoints.pop(name, None)
            for key in [k for k in self._polls if k[1] == name]:
                del self._polls[key]
        else:
            self._endpoints[name] = event.endpoint
        self._broadcast(encode_frame(("endpoint", event)))

    def synced(self, synced: bool) -> None:
        self._synced = synced
        self._broadcast(encode_frame(("synced", synced)))

    def set_objectives(self, priorities: Mapping[str, int | None]) -> None:
        self._priorities = dict(priorities)
        self._broadcast(encode_frame(("objectives", self._priorities)))

    def set_rules(self, rules: Sequence[ModelRewriteRule]) -> None:
        self._rules = list(rules)
        self._broadcast(encode_frame(("rules", self._rules)))

    def poll_result(self, source: str, endpoint: str, value: object) -> None:
        """A raw poll result of a teed source, for the workers' own extractors."""
        if endpoint not in self._endpoints:
            return
        frame = encode_frame(("poll", source, endpoint, value))
        self._polls[(source, endpoint)] = frame
        self._broadcast(frame)

    def metrics_snapshot(self, source: str, endpoint: str, metrics: MetricsSnapshot) -> None:
        """The endpoint's metrics as the supervisor's extractors of ``source`` left them
        after a poll; a worker's relayed source of that name returns it from ``poll``."""
        if endpoint not in self._endpoints:
            return
        frame = encode_snapshot_frame(source, endpoint, metrics)
        self._polls[(source, endpoint)] = frame
        self._broadcast(frame)

    def notification(self, source: str, event: NotificationEvent) -> None:
        watched = self._watched.setdefault(source, {})
        key = _object_key(event)
        if event.kind is NotificationKind.DELETE:
            watched.pop(key, None)
        else:
            watched[key] = event
        self._broadcast(encode_frame(("notification", source, event)))

    def _snapshot(self) -> list[bytes]:
        """The frames that give a new worker the current state."""
        messages: list[tuple[object, ...]] = [
            ("endpoint", EndpointEvent(kind=EndpointEventKind.ADD_OR_UPDATE, endpoint=info))
            for info in self._endpoints.values()
        ]
        if self._priorities is not None:
            messages.append(("objectives", self._priorities))
        if self._rules is not None:
            messages.append(("rules", self._rules))
        frames = [encode_frame(message) for message in messages]
        frames.extend(self._polls.values())
        for source, watched in self._watched.items():
            frames.extend(
                encode_frame(("notification", source, event)) for event in watched.values()
            )
        if self._synced:
            frames.append(encode_frame(("synced", True)))
        return frames

    def _broadcast(self, frame: bytes) -> None:
        """Sends one frame, encoded once whatever the number of workers, to every one."""
        if not self._peers:
            return
        for peer in list(self._peers.values()):
            self._send(peer, frame)

    def _send(self, peer: _Peer, frame: bytes) -> None:
        if peer.writer.is_closing():
            return
        peer.writer.write(frame)
        if peer.writer.transport.get_write_buffer_size() > self._max_backlog:
            logger.warning(
                "worker %d is %d bytes behind the data layer: disconnected",
                peer.worker_id,
                peer.writer.transport.get_write_buffer_size(),
            )
            self._peers.pop(peer.worker_id, None)
            peer.writer.transport.abort()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
        self._connections.add(writer)
        peer: _Peer | None = None
        try:
            async with asyncio.timeout(HELLO_TIMEOUT):
                hello = decode_message(await read_frame(reader))
            if not (isinstance(hello, tuple) and len(hello) == 3 and hello[0] == "hello"):
                raise ValueError(f"expected hello, got {type(hello).__name__}")
            peer = _Peer(worker_id=int(hello[1]), pid=int(hello[2]), writer=writer)
            old = self._peers.pop(peer.worker_id, None)
            if old is not None:
                old.writer.close()
            for frame in self._snapshot():  # no await in between: nothing is missed
                self._send(peer, frame)
            self._peers[peer.worker_id] = peer
            while True:
                payload = await read_frame(reader)
                try:
                    status = decode_message(payload)
                except MalformedFrameError as exc:  # skipped; the worker stays connected
                    logger.warning("worker %d sent a malformed frame: %s", peer.worker_id, exc)
                    continue
                if (
                    isinstance(status, tuple)
                    and len(status) == 6
                    and status[0] == "status"
                    and all(type(n) is int and n >= 0 for n in status[2:])
                ):
                    peer.ready = bool(status[1])
                    peer.metrics_port = status[2]
                    peer.connections = HandedConnections(*status[3:])
        except (
            asyncio.IncompleteReadError,
            ConnectionError,
            TimeoutError,
            ValueError,
            MalformedFrameError,
        ) as exc:
            if peer is None:
                logger.warning("a worker connection ended before its hello: %r", exc)
        finally:
            if peer is not None and self._peers.get(peer.worker_id) is peer:
                del self._peers[peer.worker_id]
            writer.close()
            self._connections.discard(writer)
            if task is not None:
                self._handlers.discard(task)


class _TeeSink:
    def __init__(self, hub: SupervisorHub, inner: EndpointSink) -> None:
        self._hub = hub
        self._inner = inner

    def apply(self, event: EndpointEvent) -> None:
        self._inner.apply(event)
        self._hub.endpoint_event(event)

    def mark_synced(self) -> None:
        self._inner.mark_synced()
        self._hub.synced(True)

    def mark_unsynced(self) -> None:
        self._inner.mark_unsynced()
        self._hub.synced(False)


class _TeeObjectives:
    def __init__(self, hub: SupervisorHub, inner: ObjectiveSink) -> None:
        self._hub = hub
        self._inner = inner

    def set_objectives(self, priorities: Mapping[str, int | None]) -> None:
        self._inner.set_objectives(priorities)
        self._hub.set_objectives(priorities)

    def set_rules(self, rules: Sequence[ModelRewriteRule]) -> None:
        self._inner.set_rules(rules)
        self._hub.set_rules(rules)


S = TypeVar("S", bound=PollingDataSource | NotificationSource)


class _TeeSource(Generic[S]):
    """A data source that also hands what it produces to the hub, under its name."""

    def __init__(self, hub: SupervisorHub, inner: S) -> None:
        self._hub = hub
        self._inner: S = inner
        self._name = str(inner.typed_name)

    @property
    def typed_name(self) -> TypedName:
        return self._inner.typed_name

    def output_type(self) -> type:
        return self._inner.output_type()


class _TeePolling(_TeeSource[PollingDataSource]):
    async def poll(self, endpoint: EndpointInfo) -> object:
        value = await self._inner.poll(endpoint)
        self._hub.poll_result(self._name, endpoint.name, value)
        return value

    async def close(self) -> None:
        await self._inner.close()


class _TeeNotifications(_TeeSource[NotificationSource]):
    def gvk(self) -> str:
        return self._inner.gvk()

    async def run(self, deliver: Callable[[NotificationEvent], None]) -> None:
        def tee(event: NotificationEvent) -> None:
            deliver(event)
            self._hub.notification(self._name, event)

        await self._inner.run(tee)
