"""One endpoint's KV-event stream: a ZMQ SUB socket, sequence checks, replay, reconnects.

The stream's order is what makes the index trustworthy: a missed ``BlockRemoved`` would
leave a block the server no longer holds. So:

- every message carries a sequence number; the next expected one is tracked;
- a gap (a higher number) reports ``lost`` to the sink, then asks the publisher's replay
  socket for the missing batches; if they all come back in time they are applied in
  order and the endpoint is ``resynced``; otherwise the endpoint's entries are dropped (an
  ``AllBlocksCleared`` applied locally) and the stream is trusted again from here: what
  is then known is a subset of what the server holds, never more;
- a lower number means the publisher restarted (its engine's cache is empty): the
  endpoint's entries are dropped and the stream followed from there;
- a lost connection (ZMQ's socket monitor) reports ``lost`` at once; ZMQ reconnects by
  itself, and the first message after that drops the endpoint's entries and follows the
  stream from there, whatever its number: the publisher may have restarted (its engine's
  cache empty), and its first batches, sent while this socket reconnected, may be lost, so
  its numbering can happen to continue the old one's (a replay would answer with the new
  stream's batches too);
- the first message ever is trusted as is: nothing was known before it.

Hostile or broken publishers: messages larger than ``max_message_bytes`` make ZMQ drop
the connection; at most ``receive_hwm`` messages queue; malformed payloads and events
are counted and logged once per endpoint; the loop yields every ``yield_every`` messages
so a flood cannot starve the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from adapters.kvevents.decode import KVEventDecodeError, decode_batch
from ports.kv_events import AllBlocksCleared, KVEventSink
from ports.metric_catalogue import (
    KV_EVENTS,
    KV_EVENTS_ERRORS,
    KV_EVENTS_GAPS,
    KV_EVENTS_LAG,
    KV_EVENTS_TRUSTED,
)
from ports.observer import NoopObserver, Observer

__all__ = ["KVEventSubscriber", "SubscriberConfig"]

_log = logging.getLogger(__name__)
_END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


@dataclass(frozen=True, slots=True, kw_only=True)
class SubscriberConfig:
    topic_filter: bytes = b""
    """Subscribe to topics starting with this (``b""``: all)."""
    replay_timeout: float = 1.0
    """Seconds to wait for a replay to complete before dropping the endpoint's entries."""
    reconnect_interval: float = 0.1
    reconnect_interval_max: float = 5.0
    max_message_bytes: int = 16 * 1024 * 1024
    receive_hwm: int = 10_000
    yield_every: int = 64


class KVEventSubscriber:
    """Follows the publisher at ``address`` for ``endpoint`` and feeds ``sink``."""

    def __init__(
        self,
        endpoint: str,
        address: str,
        *,
        sink: KVEventSink,
        context: zmq.asyncio.Context,
        replay_address: str | None = None,
        config: SubscriberConfig | None = None,
        observer: Observer | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.address = address
        self.replay_address = replay_address
        self._sink = sink
        self._ctx = context
        self._config = config if config is not None else SubscriberConfig()
        self._observer = observer if observer is not None else NoopObserver()
        self._expected: int | None = None
        self._lost = False
        self._disconnected = False
        self._logged: set[str] = set()
        self.batches = 0
        self.gaps = 0
        self.resets = 0
        self.replays = 0

    @property
    def trusted(self) -> bool:
        return not self._lost

    async def run(self) -> None:
        """Receive until cancelled."""
        config = self._config
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, config.receive_hwm)
        sub.setsockopt(zmq.MAXMSGSIZE, config.max_message_bytes)
        sub.setsockopt(zmq.RECONNECT_IVL, max(1, int(config.reconnect_interval * 1000)))
        sub.setsockopt(zmq.RECONNECT_IVL_MAX, max(1, int(config.reconnect_interval_max * 1000)))
        sub.setsockopt(zmq.SUBSCRIBE, config.topic_filter)
        monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sub.connect(self.address)
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(self._watch(monitor))
                group.create_task(self._receive(sub))
        finally:
            with contextlib.suppress(zmq.ZMQError):
                sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    async def _watch(self, monitor: zmq.asyncio.Socket) -> None:
        while True:
            message = parse_monitor_message(await monitor.recv_multipart())
            if message["event"] == zmq.EVENT_DISCONNECTED:
                self._disconnected = self._expected is not None
                self._mark_lost("disconnected")

    async def _receive(self, sub: zmq.asyncio.Socket) -> None:
        count = 0
        while True:
            frames = await sub.recv_multipart()
            await self._handle(frames)
            count += 1
            if count % self._config.yield_every == 0:
                await asyncio.sleep(0)

    async def _handle(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self._error("malformed", f"a message of {len(frames)} frames")
            return
        seq = int.from_bytes(frames[1], "big")
        expected = self._expected
        if self._disconnected:
            # The first message after a lost connection: the same stream or a restarted one
            # cannot be told apart, so what was known goes.
            self._disconnected = False
            self._reset()
            self._apply(frames[2])
        elif expected is None or seq == expected:
            self._apply(frames[2])
            if self._lost:
                self._set_trusted()
        elif seq > expected:
            self._mark_lost(f"sequence gap: {expected} expected, {seq} received")
            missing = await self._replay(expected, seq)
            if missing is None:
                self._reset()
            else:
                self.replays += 1
                for payload in missing:
                    self._apply(payload)
                self._set_trusted()
            self._apply(frames[2])
        else:
            # the publisher restarted: its numbering and its engine's cache start afresh
            self._reset()
            self._apply(frames[2])
        self._expected = seq + 1

    def _apply(self, payload: bytes) -> None:
        labels_endpoint = self.endpoint
        try:
            batch = decode_batch(payload)
        except KVEventDecodeError as exc:
            self._error("malformed", str(exc))
            # the batch's changes are unknown: what is known may no longer hold
            self._reset()
            return
        self.batches += 1
        observer = self._observer
        if batch.unknown_kinds:
            self._error("unknown_kind", "an unknown event kind", batch.unknown_kinds)
        if batch.malformed_events:
            self._error("malformed", "a malformed event", batch.malformed_events)
        for kind, number in batch.kinds.items():
            observer.counter(KV_EVENTS, {"endpoint": labels_endpoint, "kind": kind}, number)
        observer.histogram(KV_EVENTS_LAG, {}, max(0.0, time.time() - batch.ts))
        if batch.events:
            self._sink.apply(labels_endpoint, batch.events)

    async def _replay(self, start: int, end: int) -> list[bytes] | None:
        """The payloads of sequence numbers ``start .. end - 1``, or ``None``."""
        if self.replay_address is None:
            return None
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.MAXMSGSIZE, self._config.max_message_bytes)
        got: dict[int, bytes] = {}
        try:
            dealer.connect(self.replay_address)
            await dealer.send_multipart((b"", start.to_bytes(8, "big")))
            async with asyncio.timeout(self._config.replay_timeout):
                while True:
                    frames = await dealer.recv_multipart()
                    if len(frames) != 3 or len(frames[1]) != 8:
                        return None
                    if frames[1] == _END_OF_REPLAY:
                        break
                    seq = int.from_bytes(frames[1], "big")
                    if start <= seq < end:
                        got[seq] = frames[2]
                    if len(got) > end - start:
                        return None
        except (TimeoutError, zmq.ZMQError) as exc:
            self._log_once("replay", "%s: replay from %s failed: %s", self.endpoint, start, exc)
            return None
        finally:
            dealer.close(linger=0)
        if len(got) != end - start:
            return None
        return [got[seq] for seq in range(start, end)]

    def _mark_lost(self, why: str) -> None:
        if self._expected is None:
            return  # nothing known yet, nothing to distrust
        self.gaps += 1
        self._observer.counter(KV_EVENTS_GAPS, {"endpoint": self.endpoint})
        self._log_once("gap", "%s: KV-event stream broken (%s)", self.endpoint, why)
        if not self._lost:
            self._lost = True
            self._sink.lost(self.endpoint)
            self._observer.gauge(KV_EVENTS_TRUSTED, {"endpoint": self.endpoint}, 0)

    def _set_trusted(self) -> None:
        self._lost = False
        self._sink.resynced(self.endpoint)
        self._observer.gauge(KV_EVENTS_TRUSTED, {"endpoint": self.endpoint}, 1)

    def _reset(self) -> None:
        """Forget what the endpoint holds and follow its stream from here."""
        self.resets += 1
        self._sink.apply(self.endpoint, (AllBlocksCleared(),))
        self._lost = False
        self._observer.gauge(KV_EVENTS_TRUSTED, {"endpoint": self.endpoint}, 1)

    def _error(self, reason: str, what: str, number: int = 1) -> None:
        self._observer.counter(
            KV_EVENTS_ERRORS, {"endpoint": self.endpoint, "reason": reason}, number
        )
        self._log_once(reason, "%s: dropped %s from the KV-event stream", self.endpoint, what)

    def _log_once(self, key: str, message: str, *args: object) -> None:
        if key not in self._logged:
            self._logged.add(key)
            _log.warning(message, *args)
