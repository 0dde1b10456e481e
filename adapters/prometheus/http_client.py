"""A small keep-alive HTTP/1.1 GET client for scraping ``/metrics`` at high rates.

The data layer polls every endpoint every 50 ms: 100 endpoints are 2,000 requests per
second, and a general-purpose client costs over 100 µs of CPU per request. This one keeps
one connection per endpoint (an endpoint's polls are sequential), writes a pre-built
request, and parses only what a metrics response needs: the status line, ``Content-Length``
or chunked transfer encoding, and ``Connection: close``. No redirects, no compression (it
does not ask for any), no proxies. Any protocol surprise closes the connection and raises.
"""

from __future__ import annotations

import asyncio
import ssl
from typing import cast

__all__ = ["HttpGetConnection", "HttpProtocolError"]

#: A metrics body larger than this is refused (protects the EPP's memory).
MAX_BODY_BYTES = 32 * 1024 * 1024
_MAX_HEAD_BYTES = 64 * 1024


class HttpProtocolError(ValueError):
    """The server's answer is not a well-formed HTTP/1.1 response."""


class HttpGetConnection(asyncio.Protocol):
    """One keep-alive connection; ``get`` sends one request and awaits the whole response."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._buffer = bytearray()
        self._waiter: asyncio.Future[tuple[int, bytes]] | None = None
        self._status = 0
        self._head_done = False
        self._length: int | None = None
        self._chunked = False
        self._close_after = False
        self._chunks: list[bytes] = []

    @classmethod
    async def open(
        cls, host: str, port: int, *, tls: ssl.SSLContext | None = None, server_name: str = ""
    ) -> HttpGetConnection:
        loop = asyncio.get_running_loop()
        _, protocol = await loop.create_connection(
            cls, host, port, ssl=tls, server_hostname=(server_name or host) if tls else None
        )
        return protocol

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement the interface without subclassing asyncio's.
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            if self._head_done and self._length is None and not self._chunked:
                # A body delimited by the end of the connection.
                waiter.set_result((self._status, bytes(self._buffer)))
            else:
                waiter.set_exception(ConnectionError("connection closed mid-response"))

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        try:
            self._advance()
        except HttpProtocolError as exc:
            self._fail(exc)

    # requests

    async def get(self, request: bytes) -> tuple[int, bytes]:
        """Send a complete request (bytes); return (status, body)."""
        if self.closed or self.transport is None:
            raise ConnectionError("connection is closed")
        if self._waiter is not None:
            raise RuntimeError("one request at a time per connection")
        if self._buffer:  # bytes nobody asked for: the connection is out of step
            self.close()
            raise HttpProtocolError("unexpected data before the request")
        self._reset()
        self._waiter = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        try:
            return await self._waiter
        except BaseException:
            self.close()  # its state is unknown (e.g. a timeout mid-response)
            raise
        finally:
            self._waiter = None

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    # parsing

    def _reset(self) -> None:
        self._status = 0
        self._head_done = False
        self._length = None
        self._chunked = False
        self._close_after = False
        self._chunks = []

    def _fail(self, exc: Exception) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)
        self.close()

    def _advance(self) -> None:
        if self._waiter is None:
            if self._buffer:
                raise HttpProtocolError("data received without a request")
            return
        if not self._head_done:
            end = self._buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buffer) > _MAX_HEAD_BYTES:
                    raise HttpProtocolError("response head too large")
                return
            self._parse_head(bytes(self._buffer[:end]))
            del self._buffer[: end + 4]
        if self._chunked:
            self._advance_chunked()
        elif self._length is not None:
            if len(self._buffer) >= self._length:
                body = bytes(self._buffer[: self._length])
                del self._buffer[: self._length]
                self._finish(body)
        elif len(self._buffer) > MAX_BODY_BYTES:
            raise HttpProtocolError("response body too large")

    def _parse_head(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise HttpProtocolError(f"bad status line {lines[0][:80]!r}")
        self._status = int(parts[1])
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep:
                raise HttpProtocolError(f"bad header line {line[:80]!r}")
            key = name.strip().lower()
            if key == b"content-length":
                text = value.strip()
                if not text.isdigit():
                    raise HttpProtocolError(f"bad Content-Length {text[:40]!r}")
                self._length = int(text)
                if self._length > MAX_BODY_BYTES:
                    raise HttpProtocolError("response body too large")
            elif key == b"transfer-encoding":
                self._chunked = b"chunked" in value.lower()
            elif key == b"connection":
                self._close_after = b"close" in value.lower()
        if parts[0] == b"HTTP/1.0":
            self._close_after = True
        if self._status in (204, 304) or 100 <= self._status < 200:
            self._length = 0
        self._head_done = True

    def _advance_chunked(self) -> None:
        while True:
            line_end = self._buffer.find(b"\r\n")
            if line_end < 0:
                return
            size_text = bytes(self._buffer[:line_end]).split(b";", 1)[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                raise HttpProtocolError(f"bad chunk size {size_text[:20]!r}") from None
            if size == 0:
                trailer_end = self._buffer.find(b"\r\n\r\n", line_end)
                if trailer_end < 0:
                    return
                del self._buffer[: trailer_end + 4]
                self._finish(b"".join(self._chunks))
                return
            if len(self._buffer) < line_end + 2 + size + 2:
                return
            start = line_end + 2
            self._chunks.append(bytes(self._buffer[start : start + size]))
            if sum(len(c) for c in self._chunks) > MAX_BODY_BYTES:
                raise HttpProtocolError("response body too large")
            del self._buffer[: start + size + 2]

    def _finish(self, body: bytes) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result((self._status, body))
        if self._close_after:
            self.close()
