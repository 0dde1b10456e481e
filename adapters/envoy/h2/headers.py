"""Header blocks (RFC 9113 4.3 and 6.10, RFC 7541): a block assembled from its HEADERS and
CONTINUATION frames within a size cap, decoded with ``hpack`` (and kept decoded while the
dynamic table does not change: a gateway sends the same bytes for every stream), and the
blocks we send, encoded once.

What a block costs to decode is bounded: its compressed size (``MAX_HEADER_BLOCK``), its
decoded size (``MAX_HEADER_LIST_SIZE``), and the dynamic table size updates at its start (at
most two, RFC 7541 4.2: a 64 KiB block of one-byte updates took 60-170 ms of the event
loop). ``HeaderDecoder.decode`` also says what a block cost, in units of the connection's
budget: one, one more per KiB, one more per 25 µs of decoding (the budget of 1,000 is 25 ms
of decoding beyond what requests refill).
"""

from __future__ import annotations

import logging
import time
from typing import cast

import hpack

from adapters.envoy.h2.frames import (
    COMPRESSION_ERROR,
    END_HEADERS,
    ENHANCE_YOUR_CALM,
    H2ConnectionError,
)

__all__ = [
    "MAX_HEADER_BLOCK",
    "MAX_HEADER_LIST_SIZE",
    "HeaderAssembly",
    "HeaderDecoder",
    "malformed_request",
    "never_indexed",
]

# hpack logs every header it decodes at DEBUG: at -v 3 that would be several lines per stream
logging.getLogger("hpack").setLevel(logging.INFO)

MAX_HEADER_LIST_SIZE = 16_384  # decoded, as SETTINGS_MAX_HEADER_LIST_SIZE says
MAX_HEADER_BLOCK = 4 * MAX_HEADER_LIST_SIZE  # compressed, over HEADERS and CONTINUATIONs
DECODED_BLOCKS = 16  # header blocks kept decoded per connection
DECODED_BLOCK_MAX = 1024  # bytes: larger blocks are decoded each time
TABLE_SIZE_UPDATES = 2  # at the start of a block, at most (RFC 7541 4.2)
_DECODE_UNIT = 25e-6  # seconds of decoding a budget unit pays for

Headers = list[tuple[bytes, bytes]]


_PSEUDO = {b":method": 1, b":scheme": 2, b":path": 4, b":authority": 8}
_REQUIRED = 1 | 2 | 4
# connection-specific fields (RFC 9113 8.2.2); TE may only say "trailers"
_CONNECTION_FIELDS = frozenset(
    (b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade")
)


def malformed_request(headers: Headers) -> str | None:
    """Why a request's header list is malformed (RFC 9113 8.2 and 8.3), or None: a
    pseudo-header a request has not, twice, or after a regular field; no ``:method``,
    ``:scheme`` or ``:path``, or an empty ``:path``; a field name with upper case; a
    connection-specific field."""
    seen = 0
    regular = False
    for name, value in headers:
        if name[:1] == b":":
            bit = _PSEUDO.get(name, 0)
            if not bit or seen & bit or regular:
                return f"pseudo-header {name[:32]!r} unknown, repeated or late"
            seen |= bit
            if bit == 4 and not value:  # 8.3.1: an http or https URI's :path is never empty
                return "empty :path"
            continue
        regular = True
        if not name.islower() and name != name.lower():
            return "upper case in a field name"
        if name in _CONNECTION_FIELDS or (name == b"te" and value != b"trailers"):
            return f"connection-specific field {name.decode('latin-1')}"
    if seen & _REQUIRED != _REQUIRED:
        return "no :method, :scheme or :path"
    return None


def never_indexed(headers: list[tuple[str, str]]) -> bytes:
    """``headers`` as literals never indexed: the block leaves the peer's decoder table
    untouched, so any block can be sent in any order and cached."""
    return hpack.Encoder().encode(
        [hpack.NeverIndexedHeaderTuple(name, value) for name, value in headers], huffman=False
    )


class HeaderAssembly:
    """One header block in progress: a HEADERS without END_HEADERS and its CONTINUATIONs,
    at most ``MAX_HEADER_BLOCK`` bytes (a frame's 9-byte header counted too: empty
    CONTINUATIONs are not free). Only CONTINUATIONs of that stream may follow until it
    ends (the connection checks)."""

    __slots__ = ("_parts", "_size", "flags", "stream_id")

    def __init__(self) -> None:
        self.stream_id = 0  # 0: no block in progress
        self.flags = 0  # the HEADERS frame's
        self._parts: list[bytes] = []
        self._size = 0

    def begin(self, stream_id: int, flags: int) -> None:
        self.stream_id = stream_id
        self.flags = flags
        self._parts = []
        self._size = 0

    def add(self, flags: int, fragment: bytes) -> bytes | None:
        """Adds a frame's fragment; returns the whole block once END_HEADERS ends it."""
        self._size += 9 + len(fragment)
        if self._size > MAX_HEADER_BLOCK:
            raise H2ConnectionError(ENHANCE_YOUR_CALM, "header block too large")
        self._parts.append(fragment)
        if not flags & END_HEADERS:
            return None
        self.stream_id = 0
        block = b"".join(self._parts) if len(self._parts) > 1 else self._parts[0]
        self._parts = []
        return block


def _leading_size_updates(block: bytes) -> int:
    """Dynamic table size updates at the start of ``block`` (RFC 7541 6.3), counted up to
    one past the limit."""
    count = position = 0
    end = len(block)
    while position < end and block[position] & 0xE0 == 0x20 and count <= TABLE_SIZE_UPDATES:
        count += 1
        if block[position] & 0x1F == 0x1F:  # a longer integer: its continuation bytes
            position += 1
            while position < end and block[position] & 0x80:
                position += 1
        position += 1
    return count


class HeaderDecoder:
    """The connection's HPACK decoder, and the blocks it decoded without changing the
    dynamic table: decoding one of those again gives the same headers as long as the table
    has not changed since, so they are kept until it does."""

    __slots__ = ("_decoded", "_decoder")

    def __init__(self) -> None:
        self._decoder = hpack.Decoder(max_header_list_size=MAX_HEADER_LIST_SIZE)
        self._decoder.max_allowed_table_size = 4096
        self._decoded: dict[bytes, Headers] = {}

    def decode(self, block: bytes) -> tuple[Headers, int]:
        """The block's headers, and what decoding it cost in budget units (0 when it was
        kept decoded)."""
        headers = self._decoded.get(block)
        if headers is not None:
            return headers, 0
        if block and block[0] & 0xE0 == 0x20 and _leading_size_updates(block) > TABLE_SIZE_UPDATES:
            raise H2ConnectionError(
                COMPRESSION_ERROR,
                f"header block: more than {TABLE_SIZE_UPDATES} table size updates",
            )
        decoder = self._decoder
        table = decoder.header_table
        entries = table.dynamic_entries
        newest, count, size = entries[0] if entries else None, len(entries), table.maxsize
        started = time.perf_counter()
        try:
            headers = cast(Headers, decoder.decode(block, raw=True))
        except hpack.OversizedHeaderListError:
            raise H2ConnectionError(ENHANCE_YOUR_CALM, "header list too large") from None
        except hpack.HPACKError as exc:
            raise H2ConnectionError(COMPRESSION_ERROR, f"header block: {exc}") from None
        cost = 1 + len(block) // 1024 + int((time.perf_counter() - started) / _DECODE_UNIT)
        entries = table.dynamic_entries
        # an entry added is a new tuple at the front; a size update changes maxsize
        newest_now = entries[0] if entries else None
        if newest_now is newest and len(entries) == count and table.maxsize == size:
            if len(block) <= DECODED_BLOCK_MAX and len(self._decoded) < DECODED_BLOCKS:
                self._decoded[block] = headers
        elif self._decoded:
            self._decoded.clear()
        return headers, cost
