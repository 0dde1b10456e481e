"""The native transport's server: it listens (or adopts the connections a pod's supervisor
hands over), serves each connection (``connection.Connection``), and stops in a drain."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl

from adapters.envoy.h2.calls import CallRegistry, MethodHandler
from adapters.envoy.h2.connection import CLOSE_LINGER, Connection, ConnectionSet
from adapters.envoy.h2.limits import H2Limits

__all__ = ["H2GrpcServer"]

logger = logging.getLogger(__name__)


class H2GrpcServer:
    """Serves ``handlers`` (``/package.Service/Method`` → ``MethodHandler``) on one port,
    within ``limits``.

    ``ssl`` (with ALPN ``h2``) serves TLS; ``ssl_for_handshake``, if given, is asked for
    the context at every handshake (certificate reload). ``reuse_port`` binds with
    SO_REUSEPORT; ``start_handed`` serves the connections another process accepted and
    hands over (a pod's worker)."""

    def __init__(
        self,
        handlers: dict[str, MethodHandler],
        *,
        limits: H2Limits | None = None,
        ssl_context: ssl.SSLContext | None = None,
        reuse_port: bool = False,
    ) -> None:
        self.limits = limits = limits or H2Limits()
        self._ssl = ssl_context
        self._reuse_port = reuse_port
        self._calls = CallRegistry(handlers, limits.max_concurrent_rpcs)
        self._peers = ConnectionSet(logger)
        self._server: asyncio.Server | None = None
        self._handoff: socket.socket | None = None
        self._adopting: set[asyncio.Task[None]] = set()
        #: connections taken off the handoff socket since the start
        self.handed_received = 0

    # -- what the server counts --

    @property
    def connections(self) -> set[Connection]:
        return self._peers.connections

    @property
    def no_connections(self) -> asyncio.Event:
        return self._peers.no_connections

    @property
    def active_calls(self) -> int:
        return self._calls.active

    @property
    def no_calls(self) -> asyncio.Event:
        """Set while no call is open."""
        return self._calls.no_calls

    @property
    def calls_started(self) -> int:
        """Calls started since the start."""
        return self._calls.started

    def accepting_connections(self) -> int:
        """The connections open that have not been asked to go away: those a peer may still
        open streams on."""
        return sum(1 for c in self._peers.connections if not c.going_away)

    def strike(self, host: str, now: float) -> int:
        """Counts a protocol break by a peer on ``host`` (``ConnectionSet.strike``)."""
        return self._peers.strike(host, now)

    def _connection(self) -> Connection:
        return Connection(self._peers, self._calls, self.limits)

    # -- serving --

    async def start(self, host: str, port: int) -> int:
        """Binds and listens; returns the port bound. Raises ``OSError`` if it cannot."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            self._connection,
            host or None,
            port,
            ssl=self._ssl,
            reuse_port=self._reuse_port or None,
            backlog=1024,
        )
        return int(self._server.sockets[0].getsockname()[1])

    def start_handed(self, handoff: socket.socket) -> None:
        """Serves the connections that arrive on ``handoff`` (a unix socket carrying one
        accepted TCP socket per message, ``socket.send_fds``) instead of listening. A
        connection handed over while draining is served a GOAWAY at once; the end of
        ``handoff`` (its sender gone) stops the adoption, not the connections served."""
        handoff.setblocking(False)
        self._handoff = handoff
        asyncio.get_running_loop().add_reader(handoff.fileno(), self._take_handed)

    def _take_handed(self) -> None:
        handoff = self._handoff
        assert handoff is not None
        loop = asyncio.get_running_loop()
        while True:
            try:
                message, fds, _, _ = socket.recv_fds(handoff, 16, 4)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                logger.warning("connection handoff failed: %s; no more connections", exc)
                self._close_handoff()
                return
            if not message and not fds:
                self._close_handoff()
                return
            for fd in fds:
                self.handed_received += 1
                task = loop.create_task(self._adopt(socket.socket(fileno=fd)))
                self._adopting.add(task)
                task.add_done_callback(self._adopting.discard)

    async def _adopt(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        try:
            await loop.connect_accepted_socket(self._connection, sock, ssl=self._ssl)
        except (OSError, ssl.SSLError) as exc:  # a failed handshake: that connection only
            logger.debug("connection handed over but not served: %s", exc)
            sock.close()

    def _close_handoff(self) -> None:
        if self._handoff is not None:
            asyncio.get_running_loop().remove_reader(self._handoff.fileno())
            self._handoff.close()
            self._handoff = None

    async def stop(self, grace: float) -> None:
        """Stops accepting, asks every connection to open no new stream, waits up to
        ``grace`` seconds for the calls open, then ends them with UNAVAILABLE."""
        self._peers.draining = True
        if self._server is not None:
            self._server.close()
        for connection in list(self.connections):
            connection.go_away()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.no_calls.wait(), grace)
        for connection in list(self.connections):
            connection.cancel_calls()
        await self.no_calls.wait()
        for connection in list(self.connections):
            connection.shutdown()
        # the peers close their side once they read the last statuses (or we do, lingering)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.no_connections.wait(), CLOSE_LINGER + 0.5)
        self._server = None
        self._close_handoff()
