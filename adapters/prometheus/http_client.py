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

__all__ = ["MAX_BODY_BYTES", "HttpGetConnection", "HttpProtocolError"]

#: The default limit of a metrics body (protects the EPP's memory); a larger answer, or a
#: chunk declared larger than what is left of it, fails the request at once.
MAX_BODY_BYTES = 16 * 1024 * 1024
_MAX_HEAD_BYTES = 64 * 1024
#: A chunk-size line (hex size and extensions) longer than this is refused.
_MAX_CHUNK_LINE_BYTES = 1024
_HEX_DIGITS = frozenset(b"0123456789abcdefABCDEF")
#: Chunks decoded per event-loop callback: a body of tiny chunks is decoded in steps
#: (reading paused in between) so that it never blocks the loop for long.
_CHUNKS_PER_STEP = 1024
#: A body may come in this many chunks of any size; past them its chunks must average at
#: least ``_MIN_CHUNK_AVERAGE`` bytes. Each chunk costs about a microsecond of the event loop
#: however small, so without this a body of one-byte chunks up to the body limit would cost
#: it seconds per scrape; real servers send a metrics body whole or in buffered chunks of
#: kilobytes.
_FREE_CHUNKS = 1024
_MIN_CHUNK_AVERAGE = 128

# chunked decoder states
_SIZE, _DATA, _DATA_END, _TRAILER = range(4)


class HttpProtocolError(ValueError):
    """The server's answer is not a well-formed HTTP/1.1 response (or exceeds a limit)."""


class HttpGetConnection(asyncio.Protocol):
    """One keep-alive connection; ``get`` sends one request and awaits the whole response.

    Parsing is linear in the bytes received: each byte is looked at a bounded number of
    times, however the server splits the answer into reads and chunks, and a body of many
    small chunks is decoded a bounded number of chunks per event-loop callback.
    ``max_body_bytes`` bounds the body (and so the memory one response can take).
    """

    def __init__(self, *, max_body_bytes: int = MAX_BODY_BYTES) -> None:
        if max_body_bytes <= 0:
            raise ValueError("max_body_bytes: must be > 0")
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._max_body = max_body_bytes
        self._buffer = bytearray()
        self._scanned = 0  # bytes at the start of _buffer already searched for a delimiter
        self._waiter: asyncio.Future[tuple[int, bytes]] | None = None
        self._status = 0
        self._head_done = False
        self._length: int | None = None
        self._chunked = False
        self._close_after = False
        self._body = bytearray()
        self._state = _SIZE
        self._chunk_left = 0
        self._trailer_bytes = 0
        self._chunks = 0
        self._deferred = False  # reading is paused; a callback decodes the rest
        self._lost = False  # the connection ended while deferred

    @classmethod
    async def open(
        cls,
        host: str,
        port: int,
        *,
        tls: ssl.SSLContext | None = None,
        server_name: str = "",
        max_body_bytes: int = MAX_BODY_BYTES,
    ) -> HttpGetConnection:
        loop = asyncio.get_running_loop()
        _, protocol = await loop.create_connection(
            lambda: cls(max_body_bytes=max_body_bytes),
            host,
            port,
            ssl=tls,
            server_hostname=(server_name or host) if tls else None,
        )
        return protocol

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement the interface without subclassing asyncio's.
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._deferred:  # what arrived is still being decoded: _resume settles it
            self._lost = True
            return
        self._settle_lost()

    def _settle_lost(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            if self._head_done and self._length is None and not self._chunked:
                # A body delimited by the end of the connection.
                waiter.set_result((self._status, bytes(self._buffer)))
            else:
                waiter.set_exception(ConnectionError("connection closed mid-response"))

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        if not self._deferred:
            self._step()

    def _step(self) -> None:
        try:
            self._advance()
        except HttpProtocolError as exc:
            self._fail(exc)

    def _defer(self) -> None:
        """Continue decoding in a later callback, reading nothing more meanwhile."""
        self._deferred = True
        if self.transport is not None and not self.closed:
            self.transport.pause_reading()
        asyncio.get_running_loop().call_soon(self._resume)

    def _resume(self) -> None:
        self._deferred = False
        waiter = self._waiter
        if waiter is None or waiter.done():
            return
        self._step()
        if self._deferred:
            return
        if self._lost:
            self._settle_lost()
        elif not self.closed and self.transport is not None:
            self.transport.resume_reading()

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
        self._scanned = 0
        self._body = bytearray()
        self._state = _SIZE
        self._chunk_left = 0
        self._trailer_bytes = 0
        self._chunks = 0
        self._deferred = False
        self._lost = False

    def _fail(self, exc: Exception) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)
        self.close()

    def _advance(self) -> None:
        waiter = self._waiter
        if waiter is None:
            if self._buffer:
                raise HttpProtocolError("data received without a request")
            return
        if waiter.done():  # answered: anything more is checked by the next ``get``
            return
        if not self._head_done:
            # Search only what arrived since the last look (and 3 bytes before it).
            end = self._buffer.find(b"\r\n\r\n", max(0, self._scanned - 3))
            if end < 0:
                if len(self._buffer) > _MAX_HEAD_BYTES:
                    raise HttpProtocolError(f"response head longer than {_MAX_HEAD_BYTES} bytes")
                self._scanned = len(self._buffer)
                return
            self._parse_head(bytes(self._buffer[:end]))
            del self._buffer[: end + 4]
            self._scanned = 0
        if self._chunked:
            self._advance_chunked()
        elif self._length is not None:
            if len(self._buffer) >= self._length:
                body = bytes(self._buffer[: self._length])
                del self._buffer[: self._length]
                self._finish(body)
        elif len(self._buffer) > self._max_body:
            raise HttpProtocolError(f"response body larger than {self._max_body} bytes")

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
                if self._length > self._max_body:
                    raise HttpProtocolError(
                        f"Content-Length {self._length} is larger than the "
                        f"{self._max_body}-byte body limit"
                    )
            elif key == b"transfer-encoding":
                self._chunked = b"chunked" in value.lower()
            elif key == b"connection":
                self._close_after = b"close" in value.lower()
        if parts[0] == b"HTTP/1.0":
            self._close_after = True
        if self._status in (204, 304) or 100 <= self._status < 200:
            self._length = 0
            self._chunked = False
        self._head_done = True

    def _advance_chunked(self) -> None:
        """Decodes what the buffer holds, moving chunk data straight into the body.

        Every step consumes what it looked at, and the buffer is compacted once per call:
        linear in the bytes received however they are chunked.
        """
        buffer = self._buffer
        pos = 0
        chunks = 0
        try:
            while True:
                state = self._state
                if state == _DATA:
                    available = len(buffer) - pos
                    if available <= 0:
                        return
                    take = min(self._chunk_left, available)
                    self._body += buffer[pos : pos + take]
                    pos += take
                    self._chunk_left -= take
                    if self._chunk_left == 0:
                        self._state = _DATA_END
                elif state == _DATA_END:
                    if len(buffer) - pos < 2:
                        return
                    if buffer[pos : pos + 2] != b"\r\n":
                        raise HttpProtocolError("chunk data not followed by CRLF")
                    pos += 2
                    self._state = _SIZE
                else:
                    line_end = buffer.find(b"\r\n", max(pos, self._scanned - 1))
                    if line_end < 0:
                        self._scanned = len(buffer)
                        pending = len(buffer) - pos
                        if state == _SIZE and pending > _MAX_CHUNK_LINE_BYTES:
                            raise HttpProtocolError(
                                f"chunk-size line longer than {_MAX_CHUNK_LINE_BYTES} bytes"
                            )
                        if state == _TRAILER and self._trailer_bytes + pending > _MAX_HEAD_BYTES:
                            raise HttpProtocolError(
                                f"chunked trailer longer than {_MAX_HEAD_BYTES} bytes"
                            )
                        return
                    line = bytes(buffer[pos:line_end])
                    pos = line_end + 2
                    self._scanned = pos
                    if state == _SIZE:
                        self._start_chunk(line)
                        chunks += 1
                        if chunks >= _CHUNKS_PER_STEP and len(buffer) > pos:
                            self._defer()
                            return
                    elif not line:  # the empty line ending the trailer
                        self._finish(bytes(self._body))
                        self._body = bytearray()
                        return
                    else:
                        self._trailer_bytes += len(line) + 2
                        if self._trailer_bytes > _MAX_HEAD_BYTES:
                            raise HttpProtocolError(
                                f"chunked trailer longer than {_MAX_HEAD_BYTES} bytes"
                            )
        finally:
            if pos:
                del buffer[:pos]
                self._scanned = max(0, self._scanned - pos)

    def _start_chunk(self, line: bytes) -> None:
        if len(line) > _MAX_CHUNK_LINE_BYTES:
            raise HttpProtocolError(f"chunk-size line longer than {_MAX_CHUNK_LINE_BYTES} bytes")
        size_text = line.split(b";", 1)[0].strip()
        if not size_text or len(size_text) > 16 or not _HEX_DIGITS.issuperset(size_text):
            raise HttpProtocolError(f"bad chunk size {size_text[:20]!r}")
        size = int(size_text, 16)
        if size == 0:
            self._state = _TRAILER
            return
        if size > self._max_body - len(self._body):
            raise HttpProtocolError(
                f"chunk of {size} bytes would make the response body larger than "
                f"{self._max_body} bytes"
            )
        self._chunks += 1
        if (
            self._chunks > _FREE_CHUNKS
            and self._chunks * _MIN_CHUNK_AVERAGE > len(self._body) + size
        ):
            raise HttpProtocolError(
                f"{self._chunks} chunks averaging fewer than {_MIN_CHUNK_AVERAGE} bytes"
            )
        self._chunk_left = size
        self._state = _DATA

    def _finish(self, body: bytes) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result((self._status, body))
        if self._close_after:
            self.close()
