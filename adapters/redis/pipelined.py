"""``ScriptChannel``: Lua scripts on one Redis connection, pipelined.

redis-py sends each command on a connection of its own from its pool and waits for the
reply there: a script called by every routed request costs 40-80 µs of CPU in the client
(pool, per-read timeout, one write and one read wake-up per call), and concurrent calls
each add their own write and read. Here every call made in one pass of the event loop
goes out in one write on a single connection, and replies are matched to their calls in
order (Redis answers a connection's commands in the order it received them), parsed by
hiredis (redis-py's own parser). ``tests.bench.redis_client_cost`` compares the two.

Behaviour, as redis-py's client has it in ``adapters.redis.connection``:
- connects on the first call (TCP or TLS, ``AUTH`` and ``SELECT`` first when configured),
  within ``connect_timeout``; a call made while connecting waits for that connection;
- a call whose reply has not come within ``socket_timeout`` closes the connection, and every
  call waiting on it fails (``redis.exceptions.TimeoutError``); a lost connection fails them
  with ``redis.exceptions.ConnectionError``; the next call connects again;
- an error reply raises redis-py's exception for it (``NoScriptError``, ``OutOfMemoryError``,
  ``ReadOnlyError``...), so ``guarded`` classifies it the same way;
- a caller cancelled (its own deadline) leaves the connection as it is: its reply, when it
  comes, is dropped;
- at most ``max_pending`` calls wait for replies, and at most ``max_buffered`` bytes of
  commands wait to be sent (a server that stopped reading, a prompt of thousands of blocks
  per call): past either a call fails at once, so memory stays bounded until the timeout
  closes the connection.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import hiredis
from redis._parsers.base import BaseParser
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

__all__ = ["DEFAULT_MAX_BUFFERED", "DEFAULT_MAX_PENDING", "ScriptChannel", "TlsOptions"]

Arg = str | bytes | int | float

#: Calls waiting for a reply on the connection, at most.
DEFAULT_MAX_PENDING = 10_000
#: Bytes of commands not yet taken by the kernel, at most.
DEFAULT_MAX_BUFFERED = 16 << 20


def _pack(args: Sequence[Arg | None]) -> bytes:
    """The command in RESP (hiredis's packer, in C)."""
    # hiredis's stub types the argument as a 1-tuple; it takes any number of arguments.
    return hiredis.pack_command(tuple(args))  # type: ignore[arg-type,no-any-return]


@dataclass(frozen=True, slots=True)
class TlsOptions:
    """The ``rediss://`` URL's TLS parameters (``adapters.redis.connection``)."""

    ca_certs: str | None = None
    cert_reqs: str = "required"
    check_hostname: bool = True

    def context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=self.ca_certs)
        if self.cert_reqs == "none":
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        else:
            context.check_hostname = self.check_hostname
            context.verify_mode = (
                ssl.CERT_REQUIRED if self.cert_reqs == "required" else ssl.CERT_OPTIONAL
            )
        return context


class _Connection(asyncio.Protocol):
    """One connection: packed commands out once per loop pass, replies to waiters in order."""

    def __init__(self, channel: ScriptChannel) -> None:
        self._channel = channel
        self._loop = asyncio.get_running_loop()
        self._reader = hiredis.Reader(replyError=BaseParser.parse_error)
        #: (future, when it was sent), oldest first
        self.waiters: deque[tuple[asyncio.Future[object], float]] = deque()
        self._out: list[bytes] = []
        self._out_bytes = 0
        self._flush_scheduled = False
        self._transport: asyncio.Transport | None = None
        self._watchdog: asyncio.TimerHandle | None = None
        self.closed = False

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(RedisConnectionError(f"connection to redis lost: {exc or 'closed'}"))

    def data_received(self, data: bytes) -> None:
        reader = self._reader
        reader.feed(data)
        waiters = self.waiters
        while True:
            try:
                reply = reader.gets()
            except hiredis.ProtocolError as error:
                self.close(RedisConnectionError(f"redis protocol error: {error}"))
                return
            if reply is False:
                return
            if not waiters:
                self.close(RedisConnectionError("redis sent a reply nobody asked for"))
                return
            future, _ = waiters.popleft()
            if future.done():
                continue  # its caller gave up
            if isinstance(reply, Exception):
                future.set_exception(reply)
            else:
                future.set_result(reply)

    def eof_received(self) -> bool | None:
        return False

    # calls
    def send(self, packed: bytes) -> asyncio.Future[object]:
        if self.closed:
            raise RedisConnectionError("connection to redis closed")
        future: asyncio.Future[object] = self._loop.create_future()
        self.waiters.append((future, self._loop.time()))
        self._out.append(packed)
        self._out_bytes += len(packed)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)
        if self._watchdog is None:
            self._arm(self._channel.socket_timeout)
        return future

    def buffered(self) -> int:
        """Bytes of commands not yet taken by the kernel."""
        transport = self._transport
        queued = self._out_bytes
        return queued + (transport.get_write_buffer_size() if transport is not None else 0)

    def _flush(self) -> None:
        self._flush_scheduled = False
        out, self._out = self._out, []
        self._out_bytes = 0
        if out and self._transport is not None and not self.closed:
            self._transport.write(b"".join(out) if len(out) > 1 else out[0])

    def _arm(self, delay: float) -> None:
        self._watchdog = self._loop.call_later(delay, self._check)

    def _check(self) -> None:
        """The oldest call still waiting after ``socket_timeout``: the server is not answering."""
        self._watchdog = None
        if self.closed or not self.waiters:
            return
        timeout = self._channel.socket_timeout
        waited = self._loop.time() - self.waiters[0][1]
        if waited >= timeout:
            self.close(RedisTimeoutError(f"no reply from redis within {timeout:g} s"))
        else:
            self._arm(timeout - waited)

    def close(self, error: Exception) -> None:
        self._fail(error)
        if self._transport is not None:
            self._transport.abort()

    def _fail(self, error: Exception) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        first = not self.closed
        self.closed = True
        self._out.clear()
        self._out_bytes = 0
        waiters, self.waiters = self.waiters, deque()
        for future, _ in waiters:
            if not future.done():
                future.set_exception(error)
                # Retrieved here: a caller that gave up meanwhile would leave it unretrieved.
                future.exception()
        if first:
            self._channel.lost(self)


class ScriptChannel:
    """Commands on one pipelined connection to one Redis server (see the module docstring)."""

    __slots__ = (
        "_connecting",
        "_connection",
        "_handshake",
        "_host",
        "_port",
        "_tls",
        "connect_timeout",
        "max_buffered",
        "max_pending",
        "socket_timeout",
    )

    def __init__(
        self,
        host: str,
        port: int,
        *,
        db: int = 0,
        username: str | None = None,
        password: str | None = None,
        tls: TlsOptions | None = None,
        connect_timeout: float,
        socket_timeout: float,
        max_pending: int = DEFAULT_MAX_PENDING,
        max_buffered: int = DEFAULT_MAX_BUFFERED,
    ) -> None:
        self._host, self._port, self._tls = host, port, tls
        self.connect_timeout = connect_timeout
        self.socket_timeout = socket_timeout
        self.max_pending = max_pending
        self.max_buffered = max_buffered
        handshake: list[bytes] = []
        if password is not None:
            auth = ("AUTH", username, password) if username else ("AUTH", password)
            handshake.append(_pack(auth))
        if db:
            handshake.append(_pack(("SELECT", db)))
        self._handshake = handshake
        self._connection: _Connection | None = None
        self._connecting: asyncio.Future[_Connection] | None = None

    async def call(self, args: Sequence[Arg]) -> object:
        """One command's reply; raises redis-py's exceptions (see the module docstring)."""
        connection = self._connection
        if connection is None:
            connection = await self._connected()
        if len(connection.waiters) >= self.max_pending:
            raise RedisConnectionError(f"{self.max_pending} calls already wait for redis to answer")
        if connection.buffered() >= self.max_buffered:
            raise RedisConnectionError(
                f"{self.max_buffered} bytes of commands already wait for redis to read them"
            )
        return await connection.send(_pack(args))

    def lost(self, connection: _Connection) -> None:
        if self._connection is connection:
            self._connection = None

    async def aclose(self) -> None:
        connecting, self._connecting = self._connecting, None
        if connecting is not None and not connecting.done():
            connecting.cancel()
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.close(RedisConnectionError("the client is closed"))

    async def _connected(self) -> _Connection:
        """The connection, once made: concurrent callers share one attempt."""
        connecting = self._connecting
        if connecting is None or connecting.done():
            connecting = self._connecting = asyncio.ensure_future(self._connect())
        # A caller cancelled while waiting must not cancel the attempt the others wait on.
        return await asyncio.shield(connecting)

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        tls = self._tls
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, connection = await loop.create_connection(
                    lambda: _Connection(self),
                    self._host,
                    self._port,
                    ssl=tls.context() if tls is not None else None,
                    server_hostname=self._host if tls is not None else None,
                )
                try:
                    for packed in self._handshake:
                        await connection.send(packed)
                except BaseException:
                    connection.close(RedisConnectionError("redis handshake failed"))
                    raise
        except TimeoutError as error:
            raise RedisTimeoutError(
                f"cannot connect to redis at {self._host}:{self._port} within "
                f"{self.connect_timeout:g} s"
            ) from error
        except OSError as error:
            raise RedisConnectionError(
                f"cannot connect to redis at {self._host}:{self._port}: {error}"
            ) from error
        finally:
            self._connecting = None
        if connection.closed:
            raise RedisConnectionError("connection to redis lost while connecting")
        self._connection = connection
        return connection
