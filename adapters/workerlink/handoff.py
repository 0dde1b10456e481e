"""The supervisor accepts the pod's ext_proc connections and hands each to a worker in turn.

With ``SO_REUSEPORT`` the kernel picks a worker per connection by a hash of its addresses,
and a gateway keeps only a few connections: with one connection recycled every 250 ms, the
streams of nine short bench runs split anywhere from 15/85 to 54/46 over 2 workers. Handed
over in turn, connections alternate over the ready workers, whatever their number
(docs/decisions/0023). Each handover is one ``sendmsg`` with the
accepted socket as ``SCM_RIGHTS`` on a unix ``SOCK_SEQPACKET`` pair per worker; the worker
serves the socket as if it had accepted it (``H2GrpcServer.start_handed``), TLS included.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable

__all__ = ["ConnectionDispatcher"]

logger = logging.getLogger(__name__)

#: How often the dispatcher looks again for a ready worker while none is.
READY_POLL = 0.05


class ConnectionDispatcher:
    """Accepts on ``listener`` (a listening TCP socket) while a worker is ready, and hands
    each connection to the next worker ``ready`` says is ready, round robin; a worker whose
    handoff socket is full or gone is passed over. ``handed`` counts the connections each
    worker got."""

    def __init__(self, listener: socket.socket, ready: Callable[[int], bool]) -> None:
        listener.setblocking(False)
        self._listener = listener
        self._ready = ready
        self._handoffs: dict[int, socket.socket] = {}
        self._next = 0
        self.handed: dict[int, int] = {}

    def attach(self, worker_id: int) -> socket.socket:
        """A new handoff pair for ``worker_id`` (replacing its previous one): returns the
        worker's end, inheritable, for the caller to pass to the worker process and then
        close."""
        self.detach(worker_id)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ours.setblocking(False)
        theirs.set_inheritable(True)
        self._handoffs[worker_id] = ours
        return theirs

    def detach(self, worker_id: int) -> None:
        """Stops handing connections to ``worker_id`` (it exited)."""
        handoff = self._handoffs.pop(worker_id, None)
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

    def _hand(self, connection: socket.socket) -> None:
        order = sorted(self._handoffs)
        start = next((i for i, w in enumerate(order) if w >= self._next), 0)
        for worker_id in order[start:] + order[:start]:
            if not self._ready(worker_id):
                continue
            try:
                socket.send_fds(self._handoffs[worker_id], [b"c"], [connection.fileno()])
            except OSError as exc:  # full (a stalled worker) or gone: the next one
                logger.debug("worker %d refused a connection: %s", worker_id, exc)
                continue
            self._next = worker_id + 1
            self.handed[worker_id] = self.handed.get(worker_id, 0) + 1
            return
        logger.warning("no worker took a gateway connection; it is closed")
