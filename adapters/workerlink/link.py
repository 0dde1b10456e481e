"""The worker's side: the pod's data layer, as relayed by the supervisor, behind the ports.

``WorkerLink`` reads the supervisor's messages and hands them to relayed ports:

- ``endpoint_source(objectives)``: an ``EndpointSource`` applying the relayed endpoint
  events and synced state to the worker's datastore, and the relayed objectives and
  rewrite rules to ``objectives``;
- ``polling_source(name, output_type)``: a ``PollingDataSource`` whose ``poll`` returns the
  next result the supervisor relayed for the endpoint from its source of that name (it
  waits for it: the worker's collector then runs its extractors once per supervisor poll,
  and a model server that fails is counted and logged once, by the supervisor). The result
  is the raw one (a source with custom extractors), or, with ``output_type``
  ``MetricsSnapshot``, the endpoint's metrics as the supervisor's extractors made them;
- ``notification_source(name, gvk, output_type)``: a ``NotificationSource`` delivering the
  relayed changes of the supervisor's watch of that name.

``lost`` is set when the connection ends (the supervisor is gone or dropped this worker):
the worker then stops. ``report(ready, metrics_port)`` tells the supervisor this worker's
readiness and where its own ``/metrics`` is (sent only when it changes).

A frame the worker cannot read (undecodable, or not a message of the link's vocabulary) is
skipped and counted in ``rejected_frames``, and logged when it follows a good one; the link
goes on. Only a frame above the size bound, which leaves the stream's framing in doubt,
ends it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Mapping, Sequence

from adapters.workerlink.frames import (
    MalformedFrameError,
    decode_message,
    read_frame,
    write_frame,
)
from ports.datalayer import NotificationEvent
from ports.endpoints import EndpointEvent, EndpointEventKind, EndpointInfo, EndpointSink
from ports.objectives import ModelRewriteRule, ObjectiveSink
from ports.plugins import TypedName

__all__ = ["WorkerLink"]

logger = logging.getLogger(__name__)


class WorkerLink:
    def __init__(
        self, worker_id: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self.worker_id = worker_id
        self._reader = reader
        self._writer = writer
        self.lost = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._sink: EndpointSink | None = None
        self._pending: list[EndpointEvent | bool] = []
        self._objectives: ObjectiveSink | None = None
        self._priorities: Mapping[str, int | None] | None = None
        self._rules: Sequence[ModelRewriteRule] | None = None
        self._polling: dict[str, _RelayedPolling] = {}
        self._notifying: dict[str, _RelayedNotifications] = {}
        self._reported: tuple[object, ...] | None = None
        self.rejected_frames = 0
        self._rejecting = False

    @classmethod
    async def connect(cls, path: str, worker_id: int) -> WorkerLink:
        """Connect to the supervisor's socket and say hello (raises ``OSError``)."""
        reader, writer = await asyncio.open_unix_connection(path)
        write_frame(writer, ("hello", worker_id, os.getpid()))
        await writer.drain()
        link = cls(worker_id, reader, writer)
        link._task = asyncio.get_running_loop().create_task(link._read(), name="worker-link")
        return link

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._writer.close()

    def report(
        self, ready: bool, metrics_port: int, connections: tuple[int, int, int] | None = None
    ) -> None:
        """Tells the supervisor, when it changed, whether this worker is ready, its metrics
        port and, when the supervisor hands it connections, the connections taken so far,
        those open still taking streams, and the ext_proc calls started so far."""
        status = ("status", ready, metrics_port, *(connections or (0, 0, 0)))
        if status == self._reported or self._writer.is_closing():
            return
        self._reported = status
        write_frame(self._writer, status)

    # --- relayed ports ---

    def endpoint_source(self, objectives: ObjectiveSink) -> _RelayedEndpoints:
        self._objectives = objectives
        if self._priorities is not None:
            objectives.set_objectives(self._priorities)
        if self._rules is not None:
            objectives.set_rules(self._rules)
        return _RelayedEndpoints(self)

    def polling_source(self, typed_name: TypedName, output_type: type) -> _RelayedPolling:
        source = _RelayedPolling(typed_name, output_type)
        self._polling[str(typed_name)] = source
        return source

    def notification_source(
        self, typed_name: TypedName, gvk: str, output_type: type
    ) -> _RelayedNotifications:
        source = _RelayedNotifications(typed_name, gvk, output_type)
        self._notifying[str(typed_name)] = source
        return source

    def _attach(self, sink: EndpointSink) -> None:
        self._sink = sink
        pending, self._pending = self._pending, []
        for item in pending:
            self._apply(item)

    def _apply(self, item: EndpointEvent | bool) -> None:
        sink = self._sink
        if sink is None:
            self._pending.append(item)
        elif isinstance(item, EndpointEvent):
            sink.apply(item)
        elif item:
            sink.mark_synced()
        else:
            sink.mark_unsynced()

    async def _read(self) -> None:
        try:
            while True:
                payload = await read_frame(self._reader)
                try:
                    self._dispatch(decode_message(payload))
                except MalformedFrameError as exc:
                    self.rejected_frames += 1
                    if not self._rejecting:
                        self._rejecting = True
                        logger.warning(
                            "worker %d: skipped a frame from the supervisor it cannot read: %s",
                            self.worker_id,
                            exc,
                        )
                else:
                    self._rejecting = False
        except (asyncio.IncompleteReadError, ConnectionError, ValueError) as exc:
            logger.warning("worker %d: the supervisor link ended (%r)", self.worker_id, exc)
        finally:
            self.lost.set()

    def _dispatch(self, message: object) -> None:
        """Applies one message; ``MalformedFrameError`` if it is not one of the link's."""
        if not isinstance(message, tuple) or not message:
            raise MalformedFrameError(f"not a message: {type(message).__name__}")
        kind, *fields = message
        if kind == "endpoint" and _shaped(fields, EndpointEvent):
            event: EndpointEvent = fields[0]
            self._apply(event)
            if event.kind is EndpointEventKind.DELETE:
                for source in self._polling.values():
                    source.forget(event.endpoint)
        elif kind == "synced" and _shaped(fields, bool):
            self._apply(fields[0])
        elif kind == "poll" and _shaped(fields, str, str, object):
            polled = self._polling.get(fields[0])
            if polled is not None:
                polled.put(fields[1], fields[2])
        elif kind == "notification" and _shaped(fields, str, NotificationEvent):
            notifying = self._notifying.get(fields[0])
            if notifying is not None:
                notifying.put(fields[1])
        elif kind == "objectives" and _shaped(fields, Mapping):
            self._priorities = fields[0]
            if self._objectives is not None:
                self._objectives.set_objectives(fields[0])
        elif kind == "rules" and _shaped(fields, Sequence):
            self._rules = fields[0]
            if self._objectives is not None:
                self._objectives.set_rules(fields[0])
        else:
            raise MalformedFrameError(f"not a message of the link: {kind!r} with {len(fields)}")


def _shaped(fields: Sequence[object], *types: type) -> bool:
    return len(fields) == len(types) and all(
        isinstance(f, t) for f, t in zip(fields, types, strict=True)
    )


class _RelayedEndpoints:
    """``EndpointSource``: the supervisor's endpoint events, until cancelled."""

    def __init__(self, link: WorkerLink) -> None:
        self._link = link

    async def run(self, sink: EndpointSink) -> None:
        self._link._attach(sink)
        await asyncio.Event().wait()  # the link applies events until this is cancelled


class _RelayedPolling:
    """``PollingDataSource``: ``poll`` waits for the supervisor's next result."""

    def __init__(self, typed_name: TypedName, output_type: type) -> None:
        self._typed_name = typed_name
        self._output_type = output_type
        self._latest: dict[str, object] = {}
        self._fresh: dict[str, asyncio.Event] = {}

    @property
    def typed_name(self) -> TypedName:
        return self._typed_name

    def output_type(self) -> type:
        return self._output_type

    def put(self, endpoint: str, value: object) -> None:
        if not isinstance(value, self._output_type):
            raise MalformedFrameError(
                f"{self._typed_name}: a {type(value).__name__} result, "
                f"not {self._output_type.__name__}"
            )
        self._latest[endpoint] = value
        event = self._fresh.get(endpoint)
        if event is None:
            event = self._fresh[endpoint] = asyncio.Event()
        event.set()

    def forget(self, endpoint: EndpointInfo) -> None:
        self._latest.pop(endpoint.name, None)
        self._fresh.pop(endpoint.name, None)

    async def poll(self, endpoint: EndpointInfo) -> object:
        event = self._fresh.get(endpoint.name)
        if event is None:
            event = self._fresh[endpoint.name] = asyncio.Event()
        await event.wait()
        event.clear()
        return self._latest[endpoint.name]

    async def close(self) -> None:
        return None


class _RelayedNotifications:
    """``NotificationSource``: the supervisor's watch events, in order."""

    def __init__(self, typed_name: TypedName, gvk: str, output_type: type) -> None:
        self._typed_name = typed_name
        self._gvk = gvk
        self._output_type = output_type
        self._queue: asyncio.Queue[NotificationEvent] = asyncio.Queue()

    @property
    def typed_name(self) -> TypedName:
        return self._typed_name

    def gvk(self) -> str:
        return self._gvk

    def output_type(self) -> type:
        return self._output_type

    def put(self, event: NotificationEvent) -> None:
        self._queue.put_nowait(event)

    async def run(self, deliver: Callable[[NotificationEvent], None]) -> None:
        while True:
            deliver(await self._queue.get())
