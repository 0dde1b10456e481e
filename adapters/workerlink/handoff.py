"""The supervisor accepts the pod's ext_proc connections and hands each to a worker.

With ``SO_REUSEPORT`` the kernel picks a worker per connection by a hash of its addresses,
and a gateway keeps only a few connections: with one connection recycled every 250 ms, the
streams of nine short bench runs split anywhere from 15/85 to 54/46 over 2 workers. Handed
over by the supervisor, each connection goes to the ready worker with the fewest
connections still taking streams, and among those to the one that started the fewest
calls lately; round robin breaks the remaining ties (docs/decisions/0023, 0024). Each
handover is one ``sendmsg`` with the accepted socket as ``SCM_RIGHTS`` on a unix
``SOCK_SEQPACKET`` pair per worker; the worker serves the socket as if it had accepted it
(``H2GrpcServer.start_handed``), TLS included.
"""

from __future__ import annotations

import asyncio
import logging
import math
import socket
import time
from collections.abc import Callable

from adapters.workerlink.hub import HandedConnections

__all__ = ["ConnectionDispatcher"]

logger = logging.getLogger(__name__)

#: How often the dispatcher looks again for a ready worker while none is.
READY_POLL = 0.05
#: Seconds over which a worker's calls count (they weigh e^(-age / CALLS_DECAY)).
CALLS_DECAY = 10.0

_NOTHING_REPORTED = HandedConnections()


class _Calls:
    """A worker's calls as the dispatcher weighs them: the last total it reported, and
    the calls since attach, each weighted by e^(-age / CALLS_DECAY)."""

    __slots__ = ("at", "total", "weight")

    def __init__(self, at: float) -> None:
        self.total = 0
        self.weight = 0.0
        self.at = at

    def update(self, total: int, now: float) -> float:
        self.weight *= math.exp(-max(0.0, now - self.at) / CALLS_DECAY)
        self.weight += max(0, total - self.total)
        self.total = total
        self.at = now
        return self.weight


class ConnectionDispatcher:
    """Accepts on ``listener`` (a listening TCP socket) while a worker is ready, and hands
    each connection to a worker ``ready`` says is ready; one whose handoff socket is full or
    gone is passed over for the next. With ``connections`` (what each worker last reported,
    ``SupervisorHub.connections``) the order is: fewest connections still taking streams
    (those handed and not yet taken off the socket included), then fewest calls started
    lately, then round robin; without it, round robin. ``handed`` counts the connections
    each worker got."""

    def __init__(
        self,
        listener: socket.socket,
        ready: Callable[[int], bool],
        connections: Callable[[int], HandedConnections | None] | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        listener.setblocking(False)
        self._listener = listener
        self._ready = ready
        self._connections = connections
        self._clock = clock
        self._handoffs: dict[int, socket.socket] = {}
        self._next = 0
        self.handed: dict[int, int] = {}
        #: per worker, since its last attach: connections handed, and its calls
        self._handed_since: dict[int, int] = {}
        self._calls: dict[int, _Calls] = {}

    def attach(self, worker_id: int) -> socket.socket:
        """A new handoff pair for ``worker_id`` (replacing its previous one): returns the
        worker's end, inheritable, for the caller to pass to the worker process and then
        close."""
        self.detach(worker_id)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ours.setblocking(False)
        theirs.set_inheritable(True)
        self._handoffs[worker_id] = ours
        self._handed_since[worker_id] = 0
        self._calls[worker_id] = _Calls(self._clock())
        return theirs

    def detach(self, worker_id: int) -> None:
        """Stops handing connections to ``worker_id`` (it exited)."""
        handoff = self._handoffs.pop(worker_id, None)
        self._handed_since.pop(worker_id, None)
        self._calls.pop(worker_id, None)
        if handoff is not None:
            handoff.close()

    async def run(self) -> None:
        """Until cancelled. While no worker is ready, connections wait in the backlog."""
        loop = asyncio.get_running_loop()
        while True:
            if not any(self._ready(w) for w in self._handoffs):
                await asyncio.sleep(READY_POLL)
                continue
            connection, _ = await loop.sock_accept(self._listener)
            with connection:
                connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._hand(connection)

    def order(self) -> list[int]:
        """The ready workers, the one the next connection goes to first."""
        workers = sorted(w for w in self._handoffs if self._ready(w))
        start = next((i for i, w in enumerate(workers) if w >= self._next), 0)
        turn = workers[start:] + workers[:start]
        report = self._connections
        if report is None:
            return turn
        now = self._clock()
        keys: dict[int, tuple[int, float, int]] = {}
        for position, worker_id in enumerate(turn):
            reported = report(worker_id) or _NOTHING_REPORTED
            # handed but not taken yet: a burst of connections is not all sent to one worker
            waiting = max(0, self._handed_since[worker_id] - reported.received)
            calls = self._calls[worker_id].update(reported.calls, now)
            keys[worker_id] = (reported.accepting + waiting, calls, position)
        return sorted(turn, key=keys.__getitem__)

    def _hand(self, connection: socket.socket) -> None:
        for worker_id in self.order():
            try:
                socket.send_fds(self._handoffs[worker_id], [b"c"], [connection.fileno()])
            except OSError as exc:  # full (a stalled worker) or gone: the next one
                logger.debug("worker %d refused a connection: %s", worker_id, exc)
                continue
            self._next = worker_id + 1
            self.handed[worker_id] = self.handed.get(worker_id, 0) + 1
            self._handed_since[worker_id] += 1
            return
        logger.warning("no worker took a gateway connection; it is closed")
