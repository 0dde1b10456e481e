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
are counted and logged once per endpoint (a payload that does not decode at all, for any
reason, drops the endpoint's entries: its changes are unknown). A batch is decoded and
applied in steps (``decode.iter_batch``: pieces of at most ``decode.PIECE_HASHES``
hashes, about a millisecond of work each), and the subscriber yields to the event loop
whenever ``slice_seconds`` of work passed since it last did, behind whatever became ready
meanwhile (``_yield_behind``), so neither a flood of small messages nor one message of a
million hashes holds the loop: another task waits for at most about one slice and one
step.

A subscriber whose ``run`` fails is restarted by ``KVEventSubscriptions`` after calling
``failed``: its endpoint is distrusted until the first message after the restart, which
drops what was known (events were missed meanwhile) and follows the stream from there.
Its state (``SubscriptionState``) is on ``/metrics``.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from dataclasses import dataclass

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from adapters.kvevents.decode import DecodedBatch, iter_batch
from ports.kv_events import AllBlocksCleared, KVEventSink
from ports.metric_catalogue import (
    KV_EVENTS,
    KV_EVENTS_ERRORS,
    KV_EVENTS_GAPS,
    KV_EVENTS_LAG,
    KV_EVENTS_SUBSCRIPTION_STATE,
    KV_EVENTS_TRUSTED,
)
from ports.observer import NoopObserver, Observer

__all__ = ["KVEventSubscriber", "SubscriberConfig", "SubscriptionState"]

_log = logging.getLogger(__name__)
_END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
_DONE = DecodedBatch(0.0, (), None)  # the end of a batch's steps


class SubscriptionState(enum.Enum):
    """Where an endpoint's subscription is (``..._kv_events_subscription_state``)."""

    CONNECTING = "connecting"
    """Not connected to the publisher (yet, or since the connection was lost)."""
    FOLLOWING = "following"
    """Connected, the stream unbroken: the endpoint's entries are used."""
    UNTRUSTED = "untrusted"
    """Connected, the stream broken (a gap being replayed): its entries are not used."""
    RESTARTING = "restarting"
    """The subscriber failed and restarts after a backoff: its entries are not used."""


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
    slice_seconds: float = 0.001
    """The most event-loop time taken between two yields (one step of work, about a
    millisecond, may take it past this)."""
    restart_backoff: float = 0.25
    """Seconds before a failed subscriber is restarted, doubled per failure in a row."""
    restart_backoff_max: float = 30.0


async def _yield_behind() -> None:
    """Let the event loop run what is ready and what a timer or I/O wakes meanwhile, then
    resume. ``asyncio.sleep(0)`` resumes on the loop's next turn, ahead of a task that a
    timer or a socket wakes (that takes two turns), so such a task waited for two or three
    slices; this resumes three turns later, behind it."""
    loop = asyncio.get_running_loop()
    resumed = loop.create_future()
    loop.call_soon(loop.call_soon, _resume, resumed)
    await resumed


def _resume(resumed: asyncio.Future[None]) -> None:
    if not resumed.done():  # the subscriber may have been cancelled meanwhile
        resumed.set_result(None)


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
        self._connected = False
        self._state: SubscriptionState | None = None
        self._logged: set[str] = set()
        self._slice_started = 0.0
        self.batches = 0
        self.gaps = 0
        self.resets = 0
        self.replays = 0
        self.failures = 0

    @property
    def trusted(self) -> bool:
        return not self._lost

    @property
    def state(self) -> SubscriptionState | None:
        return self._state

    def failed(self) -> None:
        """``run`` failed and will be restarted: the endpoint is distrusted meanwhile, and
        the first message after the restart drops what was known."""
        self.failures += 1
        self._disconnected = True
        self._connected = False
        if not self._lost:
            self._lost = True
            self._sink.lost(self.endpoint)
            self._observer.gauge(KV_EVENTS_TRUSTED, {"endpoint": self.endpoint}, 0)
        self._set_state(SubscriptionState.RESTARTING)

    def forget_metrics(self) -> None:
        """The endpoint left: its series go from ``/metrics``."""
        labels = {"endpoint": self.endpoint}
        self._observer.gauge(KV_EVENTS_TRUSTED, labels, float("nan"))
        for state in SubscriptionState:
            self._observer.gauge(
                KV_EVENTS_SUBSCRIPTION_STATE, {**labels, "state": state.value}, float("nan")
            )
        self._state = None

    def _set_state(self, state: SubscriptionState) -> None:
        if state is self._state:
            return
        self._state = state
        for each in SubscriptionState:
            self._observer.gauge(
                KV_EVENTS_SUBSCRIPTION_STATE,
                {"endpoint": self.endpoint, "state": each.value},
                1 if each is state else 0,
            )

    def _update_state(self) -> None:
        if not self._connected:
            self._set_state(SubscriptionState.CONNECTING)
        elif self._lost:
            self._set_state(SubscriptionState.UNTRUSTED)
        else:
            self._set_state(SubscriptionState.FOLLOWING)

    async def run(self) -> None:
        """Receive until cancelled."""
        self._connected = False
        self._update_state()
        if not self._lost:
            self._observer.gauge(KV_EVENTS_TRUSTED, {"endpoint": self.endpoint}, 1)
        config = self._config
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, config.receive_hwm)
        sub.setsockopt(zmq.MAXMSGSIZE, config.max_message_bytes)
        sub.setsockopt(zmq.RECONNECT_IVL, max(1, int(config.reconnect_interval * 1000)))
        sub.setsockopt(zmq.RECONNECT_IVL_MAX, max(1, int(config.reconnect_interval_max * 1000)))
        sub.setsockopt(zmq.SUBSCRIBE, config.topic_filter)
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
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
                self._connected = False
                self._disconnected = self._disconnected or self._expected is not None
                self._mark_lost("disconnected")
            elif message["event"] == zmq.EVENT_CONNECTED:
                self._connected = True
            self._update_state()

    async def _receive(self, sub: zmq.asyncio.Socket) -> None:
        self._slice_started = time.monotonic()
        while True:
            # not copied: a 16 MB payload copied into a new bytes object cost the loop
            # 3-18 ms (the page faults of fresh memory); the frames are read in place
            message = await sub.recv_multipart(copy=False)
            frames: list[bytes | memoryview] = [frame.buffer for frame in message]
            await self._handle(frames)
            await self._pause()

    async def _pause(self) -> None:
        """Yield to the event loop when this subscriber's slice of it is spent."""
        if time.monotonic() - self._slice_started >= self._config.slice_seconds:
            await _yield_behind()
            self._slice_started = time.monotonic()

    async def _handle(self, frames: list[bytes | memoryview]) -> None:
        if not self._connected:  # the monitor's event may come after the first message
            self._connected = True
            self._update_state()
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
            await self._apply(frames[2])
        elif expected is None or seq == expected:
            await self._apply(frames[2])
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
                    await self._apply(payload)
                self._set_trusted()
            await self._apply(frames[2])
        else:
            # the publisher restarted: its numbering and its engine's cache start afresh
            self._reset()
            await self._apply(frames[2])
        self._expected = seq + 1

    async def _apply(self, payload: bytes | memoryview) -> None:
        """Decode ``payload`` and hand it to the sink, a piece at a time. Whatever fails in
        the decoding makes it a malformed batch: its changes are unknown, so what is known
        of the endpoint is dropped (pieces already applied included)."""
        steps = iter_batch(payload)
        first = True
        while True:
            try:
                piece = next(steps, _DONE)
            except Exception as exc:
                self._error("malformed", f"an undecodable batch ({exc})")
                self._reset()
                return
            if piece is _DONE:
                break
            if piece is not None:
                self._take(piece, first)
                first = False
            await self._pause()
        self.batches += 1

    def _take(self, piece: DecodedBatch, first: bool) -> None:
        endpoint = self.endpoint
        observer = self._observer
        if piece.unknown_kinds:
            self._error("unknown_kind", "an unknown event kind", piece.unknown_kinds)
        if piece.malformed_events:
            self._error("malformed", "a malformed event", piece.malformed_events)
        for kind, number in piece.kinds.items():
            observer.counter(KV_EVENTS, {"endpoint": endpoint, "kind": kind}, number)
        if first:
            observer.histogram(KV_EVENTS_LAG, {}, max(0.0, time.time() - piece.ts))
        if piece.events:
            self._sink.apply(endpoint, piece.events)

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
            self._update_state()

    def _set_trusted(self) -> None:
        self._lost = False
        self._sink.resynced(self.endpoint)
        self._observer.gauge(KV_EVENTS_TRUSTED, {"endpoint": self.endpoint}, 1)
        self._update_state()

    def _reset(self) -> None:
        """Forget what the endpoint holds and follow its stream from here."""
        self.resets += 1
        self._sink.apply(self.endpoint, (AllBlocksCleared(),))
        self._lost = False
        self._observer.gauge(KV_EVENTS_TRUSTED, {"endpoint": self.endpoint}, 1)
        self._update_state()

    def _error(self, reason: str, what: str, number: int = 1) -> None:
        self._observer.counter(
            KV_EVENTS_ERRORS, {"endpoint": self.endpoint, "reason": reason}, number
        )
        self._log_once(reason, "%s: dropped %s from the KV-event stream", self.endpoint, what)

    def _log_once(self, key: str, message: str, *args: object) -> None:
        if key not in self._logged:
            self._logged.add(key)
            _log.warning(message, *args)
