"""vLLM's KV-event batches: msgpack payloads decoded into ``ports.kv_events`` events.

The payload is an ``EventBatch``: ``[ts, events, data_parallel_rank]`` (older and most
current vLLM releases encode structs as arrays), or the same as a map with those keys.
Each event is an array whose first item is the kind, or a map whose ``type`` key is:

- ``BlockStored``: block_hashes, parent_block_hash, token_ids, block_size, lora_id,
  medium, lora_name (later fields optional; newer engines append more, ignored);
- ``BlockRemoved``: block_hashes, medium;
- ``AllBlocksCleared``.

A block hash is an unsigned 64-bit integer, or the engine's raw hash bytes (vLLM with
integer hashes turned off), reduced here to their low 64 bits, the integer form. The
token ids are checked to be an array and not kept (the index is keyed by the hashes).

msgspec decodes the payload untyped (lists, dicts, ints, bytes) and this module checks
each field, so a batch from a newer or older engine layout still decodes, and an unknown
or malformed event is skipped and counted rather than failing the whole batch. A payload
that does not decode at all (not msgpack, a string that is not UTF-8, nesting too deep for
the decoder, anything) is not a batch: ``KVEventDecodeError``.

Bounded work: ``iter_batch`` gives the batch in pieces of at most ``PIECE_HASHES`` hashes
(a longer ``BlockStored`` or ``BlockRemoved`` is split into consecutive events of the same
chain) and in steps of about a millisecond, so its caller can yield to the event loop
between them. A payload larger than ``DIRECT_BYTES`` is not decoded in one msgspec call
(13 MB of hashes hold the interpreter for 60-200 ms, and converting them for seconds):
``_Walker`` finds where its objects start and end from their msgpack headers, without
building them, iteratively (nesting deeper than ``MAX_DEPTH`` is an error) and a bounded
number at a time (a run of scalars of one type and width, as an engine's hashes are, is
skipped with one strided check); the events are then decoded a chunk of about
``CHUNK_BYTES`` at a time, and an event larger than that field by field, its hashes a
piece at a time. On that path an event larger than a chunk whose fields are malformed
fails the batch (its first pieces may have been given out already).
"""

from __future__ import annotations

import re
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from ports.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

__all__ = [
    "CHUNK_BYTES",
    "DIRECT_BYTES",
    "MAX_DEPTH",
    "PIECE_HASHES",
    "DecodedBatch",
    "KVEventDecodeError",
    "decode_batch",
    "external_hash",
    "iter_batch",
]

_MASK64 = (1 << 64) - 1
_DECODER = msgspec.msgpack.Decoder()

#: Payloads up to this many bytes are decoded in one msgspec call (about a millisecond).
DIRECT_BYTES = 16 * 1024
#: Larger payloads: their events are decoded this many bytes at a time.
CHUNK_BYTES = 4 * 1024
#: The most hashes in one piece of a batch (the index applies 512 in 0.5-1.5 ms).
PIECE_HASHES = 512
#: The deepest nesting of a large payload's objects (an event batch has 4 levels).
MAX_DEPTH = 32
#: The longest ``medium`` or ``lora_name`` kept (longer: the event is malformed).
MAX_NAME_CHARS = 256
#: A field of a large event other than its hashes and tokens, at most this many bytes.
_MAX_FIELD_BYTES = 1024

_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
)
_REMOVED_FIELDS = ("block_hashes", "medium")


class KVEventDecodeError(ValueError):
    """The payload is not an event batch."""


@dataclass(frozen=True, slots=True)
class DecodedBatch:
    """A batch, or one piece of it (``iter_batch``): the pieces of one batch share ``ts``;
    ``data_parallel_rank`` is known on the last piece (``None`` before it on the sliced
    path)."""

    ts: float
    events: tuple[KVEvent, ...]
    data_parallel_rank: int | None
    unknown_kinds: int = 0
    malformed_events: int = 0
    kinds: dict[str, int] = field(default_factory=dict)


def external_hash(value: object) -> int:
    """A block hash as an unsigned 64-bit integer (bytes: their low 64 bits)."""
    if isinstance(value, bool):
        raise TypeError("a block hash is not a boolean")
    if isinstance(value, int):
        return value & _MASK64
    if isinstance(value, bytes | bytearray | memoryview):
        raw = bytes(value)
        if not raw:
            raise ValueError("empty block hash")
        return int.from_bytes(raw[-8:], "big")
    raise TypeError(f"a block hash is an integer or bytes, not {type(value).__name__}")


def decode_batch(payload: bytes | memoryview, *, direct_bytes: int = DIRECT_BYTES) -> DecodedBatch:
    """The whole batch at once (``iter_batch``'s pieces joined); raises
    ``KVEventDecodeError`` when it is not a batch."""
    pieces = [p for p in iter_batch(payload, direct_bytes=direct_bytes) if p is not None]
    if len(pieces) == 1:
        return pieces[0]
    kinds: dict[str, int] = {}
    for piece in pieces:
        for kind, number in piece.kinds.items():
            kinds[kind] = kinds.get(kind, 0) + number
    return DecodedBatch(
        pieces[0].ts,
        tuple(event for piece in pieces for event in piece.events),
        pieces[-1].data_parallel_rank,
        sum(piece.unknown_kinds for piece in pieces),
        sum(piece.malformed_events for piece in pieces),
        kinds,
    )


def iter_batch(
    payload: bytes | memoryview, *, direct_bytes: int = DIRECT_BYTES
) -> Iterator[DecodedBatch | None]:
    """The batch in pieces of at most ``PIECE_HASHES`` hashes, in order (at least one),
    with ``None`` between them for a step of work that has nothing to apply yet: the work
    between two items is bounded (about a millisecond), so a caller on an event loop may
    yield to it there. Raises ``KVEventDecodeError`` when the payload is not a batch,
    possibly after some pieces (the caller then forgets what they said). A payload of more
    than ``direct_bytes`` is walked (see the module docstring)."""
    if len(payload) <= direct_bytes:
        yield from _direct(payload)
    else:
        yield from _Sliced(payload).steps()


# --- one msgspec call -------------------------------------------------------------------


def _decode(data: bytes | memoryview) -> Any:
    """Untyped msgspec decode; any failure (a string that is not UTF-8, nesting deeper than
    the interpreter's stack, ...) is a ``KVEventDecodeError``."""
    try:
        return _DECODER.decode(data)
    except Exception as exc:
        raise KVEventDecodeError(f"not msgpack: {type(exc).__name__}: {exc}") from None


def _direct(payload: bytes | memoryview) -> Iterator[DecodedBatch]:
    root = _decode(payload)
    if isinstance(root, list):
        if len(root) < 2:
            raise KVEventDecodeError("a batch array needs [ts, events, ...]")
        ts, raw_events = root[0], root[1]
        rank = root[2] if len(root) > 2 else None
    elif isinstance(root, dict):
        ts, raw_events, rank = root.get("ts"), root.get("events"), root.get("data_parallel_rank")
    else:
        raise KVEventDecodeError(f"a batch is an array or a map, not {type(root).__name__}")
    stamp = _timestamp(ts)
    if not isinstance(raw_events, list):
        raise KVEventDecodeError("the batch events are not an array")
    checked_rank = _rank(rank)
    yield from _pieces(stamp, checked_rank, *_convert(raw_events))


def _timestamp(ts: Any) -> float:
    if isinstance(ts, bool) or not isinstance(ts, int | float):
        raise KVEventDecodeError("the batch timestamp is not a number")
    return float(ts)


def _rank(rank: Any) -> int | None:
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
        raise KVEventDecodeError("data_parallel_rank is not an integer")
    return rank


def _convert(raw_events: list[Any]) -> tuple[list[KVEvent], int, int, dict[str, int]]:
    events: list[KVEvent] = []
    unknown = malformed = 0
    kinds: dict[str, int] = {}
    for raw in raw_events:
        try:
            kind, event = _event(raw)
        except _UnknownKindError:
            unknown += 1
            continue
        except (TypeError, ValueError, KeyError, IndexError):
            malformed += 1
            continue
        events.append(event)
        kinds[kind] = kinds.get(kind, 0) + 1
    return events, unknown, malformed, kinds


def _weight(event: KVEvent) -> int:
    if isinstance(event, AllBlocksCleared):
        return 1
    return max(1, len(event.block_hashes))


def _split(events: Sequence[KVEvent], limit: int = PIECE_HASHES) -> list[tuple[KVEvent, ...]]:
    """``events`` in runs of at most ``limit`` hashes; an event with more is cut into
    consecutive events of its chain (each one's parent the previous one's last hash)."""
    pieces: list[tuple[KVEvent, ...]] = []
    current: list[KVEvent] = []
    size = 0
    for event in events:
        weight = _weight(event)
        if weight > limit and not isinstance(event, AllBlocksCleared):
            if current:
                pieces.append(tuple(current))
                current, size = [], 0
            pieces.extend((part,) for part in _cut(event, limit))
            continue
        if size + weight > limit and current:
            pieces.append(tuple(current))
            current, size = [], 0
        current.append(event)
        size += weight
    if current or not pieces:
        pieces.append(tuple(current))
    return pieces


def _cut(event: BlockStored | BlockRemoved, limit: int) -> Iterator[KVEvent]:
    hashes = event.block_hashes
    parent = event.parent_block_hash if isinstance(event, BlockStored) else None
    for start in range(0, len(hashes), limit):
        part = hashes[start : start + limit]
        if isinstance(event, BlockStored):
            yield BlockStored(
                block_hashes=part,
                parent_block_hash=parent,
                block_size=event.block_size,
                lora_id=event.lora_id,
                medium=event.medium,
                lora_name=event.lora_name,
            )
            parent = part[-1]
        else:
            yield BlockRemoved(block_hashes=part, medium=event.medium)


class _UnknownKindError(Exception):
    pass


def _fields(raw: Any, names: Sequence[str], required: int) -> tuple[str, list[Any]]:
    if isinstance(raw, list):
        if not raw or not isinstance(raw[0], str):
            raise ValueError("an event array starts with its kind")
        kind, values = raw[0], raw[1:]
        if kind not in _KINDS:
            raise _UnknownKindError(kind)
        if len(values) < required:
            raise ValueError(f"{kind}: {len(values)} fields, {required} required")
        return kind, [values[i] if i < len(values) else None for i in range(len(names))]
    if isinstance(raw, dict):
        tag = raw.get("type")
        if not isinstance(tag, str):
            raise ValueError("an event map has a 'type'")
        if tag not in _KINDS:
            raise _UnknownKindError(tag)
        for name in names[:required]:
            if name not in raw:
                raise KeyError(name)
        return tag, [raw.get(name) for name in names]
    raise TypeError("an event is an array or a map")


def _optional_str(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError("expected a string")
    if len(value) > MAX_NAME_CHARS:
        raise ValueError(f"a name longer than {MAX_NAME_CHARS} characters")
    return value


def _optional_int(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError("expected an integer")
    return value


def _hashes(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise TypeError("block_hashes is not an array")
    return tuple(external_hash(item) for item in value)


def _stored(
    hashes: tuple[int, ...], parent: Any, size: Any, lora_id: Any, medium: Any, lora_name: Any
) -> BlockStored:
    block_size = _optional_int(size)
    if block_size is None or block_size < 1:
        raise ValueError("block_size must be >= 1")
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=None if parent is None else external_hash(parent),
        block_size=block_size,
        lora_id=_optional_int(lora_id),
        medium=_optional_str(medium),
        lora_name=_optional_str(lora_name),
    )


def _event(raw: Any) -> tuple[str, KVEvent]:
    kind = (
        raw[0]
        if isinstance(raw, list) and raw
        else raw.get("type")
        if isinstance(raw, dict)
        else None
    )
    if kind == "BlockStored":
        _, (hashes, parent, tokens, size, lora_id, medium, lora_name) = _fields(
            raw, _STORED_FIELDS, 4
        )
        if not isinstance(tokens, list):
            raise TypeError("token_ids is not an array")
        return kind, _stored(_hashes(hashes), parent, size, lora_id, medium, lora_name)
    if kind == "BlockRemoved":
        _, (hashes, medium) = _fields(raw, _REMOVED_FIELDS, 1)
        return kind, BlockRemoved(block_hashes=_hashes(hashes), medium=_optional_str(medium))
    if kind == "AllBlocksCleared":
        _fields(raw, (), 0)
        return kind, AllBlocksCleared()
    if isinstance(kind, str):
        raise _UnknownKindError(kind)
    raise ValueError("an event has no kind")


_KINDS = frozenset({"BlockStored", "BlockRemoved", "AllBlocksCleared"})


# --- a large payload, walked -------------------------------------------------------------

# What each first byte of a msgpack object is: _SCALAR (its whole width in _WIDTH), _STR
# (fixstr: length in the low 5 bits), _SIZED (bin/str/ext: a length of _WIDTH bytes follows,
# then _EXTRA bytes, then the data), _FIXARRAY, _FIXMAP, _ARRAY16_32, _MAP16_32 (a count of
# _WIDTH bytes follows), _INVALID (0xc1).
_SCALAR, _STR, _SIZED, _FIXARRAY, _FIXMAP, _ARRAY16_32, _MAP16_32, _INVALID = range(8)
_KIND = [_SCALAR] * 256
_WIDTH = [1] * 256
_EXTRA = [0] * 256
for _tag in range(0x80, 0x90):
    _KIND[_tag] = _FIXMAP
for _tag in range(0x90, 0xA0):
    _KIND[_tag] = _FIXARRAY
for _tag in range(0xA0, 0xC0):
    _KIND[_tag] = _STR
for _tag, _width in {
    0xCA: 5, 0xCB: 9, 0xCC: 2, 0xCD: 3, 0xCE: 5, 0xCF: 9, 0xD0: 2, 0xD1: 3, 0xD2: 5, 0xD3: 9,
    0xD4: 3, 0xD5: 4, 0xD6: 6, 0xD7: 10, 0xD8: 18,
}.items():  # fmt: skip
    _WIDTH[_tag] = _width
for _tag, (_width, _extra) in {
    0xC4: (1, 0), 0xC5: (2, 0), 0xC6: (4, 0), 0xC7: (1, 1), 0xC8: (2, 1), 0xC9: (4, 1),
    0xD9: (1, 0), 0xDA: (2, 0), 0xDB: (4, 0),
}.items():  # fmt: skip
    _KIND[_tag], _WIDTH[_tag], _EXTRA[_tag] = _SIZED, _width, _extra
for _tag, _kind in {0xDC: _ARRAY16_32, 0xDD: _ARRAY16_32, 0xDE: _MAP16_32, 0xDF: _MAP16_32}.items():
    _KIND[_tag], _WIDTH[_tag] = _kind, 2 if _tag in (0xDC, 0xDE) else 4
_KIND[0xC1] = _INVALID
_ARRAY, _MAP = 1, 2
# type bytes a block hash may have: integers and binary
_HASH_TAGS = frozenset((*range(0x80), *range(0xE0, 0x100), *range(0xCC, 0xD4), 0xC4, 0xC5, 0xC6))


def _array_header(count: int) -> bytes:
    if count < 16:
        return bytes((0x90 | count,))
    if count < 1 << 16:
        return b"\xdc" + count.to_bytes(2, "big")
    return b"\xdd" + count.to_bytes(4, "big")


def _strided(buf: bytes | memoryview, start: int, stop: int, step: int) -> bytes:
    """``buf[start:stop:step]`` as bytes (a memoryview's strided copy is item by item, five
    times slower than a contiguous copy sliced)."""
    if isinstance(buf, bytes):
        return buf[start:stop:step]
    return bytes(buf[start:stop])[::step]


class _TooLargeError(Exception):
    """A bounded walk went past its limit."""


class _Walker:
    """Where the msgpack objects of ``buf`` start and end, found from their headers
    without building them: iteratively (nesting cannot exhaust the stack; deeper than
    ``MAX_DEPTH`` is an error) and in steps (``walk`` yields ``None`` after every
    ``_STEP_ITEMS`` objects or skipped run)."""

    __slots__ = ("buf",)

    def __init__(self, buf: bytes | memoryview) -> None:
        self.buf = buf

    def container(self, pos: int) -> tuple[int, int, int] | None:
        """``(_ARRAY or _MAP, number of items, offset of the first)`` when an array or a
        map starts at ``pos``; ``None`` for a scalar. A map's items are its keys and values."""
        buf = self.buf
        if pos >= len(buf):
            raise KVEventDecodeError("truncated msgpack")
        tag = buf[pos]
        kind = _KIND[tag]
        if kind == _FIXARRAY:
            return _ARRAY, tag & 0x0F, pos + 1
        if kind == _FIXMAP:
            return _MAP, 2 * (tag & 0x0F), pos + 1
        if kind in (_ARRAY16_32, _MAP16_32):
            first = pos + 1 + _WIDTH[tag]
            if first > len(buf):
                raise KVEventDecodeError("truncated msgpack")
            count = int.from_bytes(buf[pos + 1 : first], "big")
            return (_ARRAY, count, first) if kind == _ARRAY16_32 else (_MAP, 2 * count, first)
        return None

    def scalar_end(self, pos: int) -> int:
        """Where the scalar at ``pos`` ends (``KVEventDecodeError`` for anything else)."""
        buf = self.buf
        if pos >= len(buf):
            raise KVEventDecodeError("truncated msgpack")
        tag = buf[pos]
        kind = _KIND[tag]
        if kind == _SCALAR:
            return pos + _WIDTH[tag]
        if kind == _STR:
            return pos + 1 + (tag & 0x1F)
        if kind == _SIZED:
            width = _WIDTH[tag]
            length = int.from_bytes(buf[pos + 1 : pos + 1 + width], "big")
            return pos + 1 + width + _EXTRA[tag] + length
        raise KVEventDecodeError("expected a scalar")

    def uniform(self, pos: int, count: int) -> int:
        """The width of each of the ``count`` objects from ``pos`` when they are all scalars
        of one type and width (integers of one size, binaries of one length); else 0."""
        buf = self.buf
        if count < 1 or pos >= len(buf):
            return 0
        tag = buf[pos]
        if tag < 0x80:
            run = bytes(buf[pos : pos + count])  # (a copy of at most _BULK_ITEMS bytes)
            return 1 if len(run) == count and run.isascii() else 0
        width = _WIDTH[tag] if _KIND[tag] == _SCALAR else 0
        if tag == 0xC4 and pos + 1 < len(buf):
            width = 2 + buf[pos + 1]
            lengths = _strided(buf, pos + 1, pos + width * count, width)
            if len(lengths) != count or lengths.count(buf[pos + 1]) != count:
                return 0
        if width < 2 or pos + width * count > len(buf):
            return 0
        tags = _strided(buf, pos, pos + width * count, width)
        return width if tags.count(tag) == count else 0

    def walk(self, pos: int, limit: int | None = None) -> Generator[None, None, int]:
        """Where the object at ``pos`` ends, found in steps of at most ``_STEP_ITEMS``
        objects; ``_TooLargeError`` once it is known to be more than ``limit`` bytes."""
        stop = len(self.buf) if limit is None else min(len(self.buf), pos + limit)
        walk = _Walk(pos)
        while not self._advance(walk, stop, _STEP_ITEMS):
            yield None
        return walk.pos

    def end(self, pos: int, limit: int) -> int:
        """Where the object at ``pos`` ends, in one go: it is at most ``limit`` bytes
        (``_TooLargeError`` otherwise), so at most ``limit`` objects are walked."""
        walk = _Walk(pos)
        self._advance(walk, min(len(self.buf), pos + limit), limit + 1)
        return walk.pos

    def _advance(self, walk: _Walk, stop: int, budget: int) -> bool:
        """Walks on by about ``budget`` objects; whether the object ended."""
        buf = self.buf
        pos = walk.pos
        remaining = walk.remaining
        outer = walk.outer
        bulk = walk.bulk
        try:
            while budget > 0:
                if not remaining:
                    if not outer:
                        break
                    remaining = outer.pop()
                    bulk = False
                    continue
                if bulk:
                    bulk = False
                    if remaining > 16:
                        # a run of scalars of one type and width, or of integers
                        take = min(remaining, _BULK_ITEMS)
                        width = self.uniform(pos, take)
                        if width:
                            pos += width * take
                            remaining -= take
                            budget -= _BULK_COST
                            bulk = True
                            continue
                        run = _INT_RUN.match(buf, pos) if remaining >= _RUN else None
                        if run is not None:
                            pos = run.end()
                            remaining -= _RUN
                            budget -= _RUN_COST
                            bulk = True
                            continue
                remaining -= 1
                budget -= 1
                tag = buf[pos]
                kind = _KIND[tag]
                if kind == _SCALAR:
                    pos += _WIDTH[tag]
                    continue
                if kind == _STR:
                    pos += 1 + (tag & 0x1F)
                    continue
                if kind == _SIZED:
                    width = _WIDTH[tag]
                    length = int.from_bytes(buf[pos + 1 : pos + 1 + width], "big")
                    pos += 1 + width + _EXTRA[tag] + length
                    continue
                if kind == _FIXARRAY:
                    count = tag & 0x0F
                    pos += 1
                elif kind == _FIXMAP:
                    count = 2 * (tag & 0x0F)
                    pos += 1
                elif kind == _INVALID:
                    raise KVEventDecodeError("not msgpack: type byte 0xc1")
                else:
                    width = _WIDTH[tag]
                    count = int.from_bytes(buf[pos + 1 : pos + 1 + width], "big")
                    count *= 2 if kind == _MAP16_32 else 1
                    pos += 1 + width
                if not count:
                    continue
                if len(outer) >= MAX_DEPTH - 1:
                    raise KVEventDecodeError(f"nested deeper than {MAX_DEPTH} levels")
                outer.append(remaining)
                remaining = count
                bulk = True
            else:
                if pos > stop:
                    raise _TooLargeError
                walk.pos, walk.remaining, walk.bulk = pos, remaining, bulk
                return False
        except IndexError:
            raise KVEventDecodeError("truncated msgpack") from None
        if pos > len(buf):
            raise KVEventDecodeError("truncated msgpack")
        if pos > stop:
            raise _TooLargeError
        walk.pos, walk.remaining, walk.bulk = pos, 0, False
        return True

    def decode(self, start: int, end: int) -> Any:
        return _decode(self.buf[start:end])


#: Objects walked between two steps (about a millisecond).
_STEP_ITEMS = 4096
#: Scalars of one type skipped at once (a strided slice of at most 2 MiB).
_BULK_ITEMS = 65536
#: What one skipped run of ``_BULK_ITEMS`` counts for in a step's objects (2 a step: the
#: strided checks of 1.5 M hashes in one step held the loop 11 ms, 8 runs 3-4.6 ms with the
#: walk's start, 2 runs under 1.5 ms).
_BULK_COST = 2048
#: Integers of mixed widths (an engine's token ids) skipped at once, by a regular expression
#: (in C; the widths are told apart by the type byte, so it never backtracks).
_RUN = 256
_INT = (
    rb"(?:[\x00-\x7f\xe0-\xff]|[\xcc\xd0][\x00-\xff]|[\xcd\xd1][\x00-\xff]{2}"
    rb"|[\xce\xd2][\x00-\xff]{4}|[\xcf\xd3][\x00-\xff]{8})"
)
_INT_RUN = re.compile(_INT + b"{%d}" % _RUN)
#: What one run of ``_RUN`` integers counts for in a step's objects.
_RUN_COST = 64


class _Walk:
    """Where a walk is: the offset, the objects left at this level and around it, whether
    a run of scalars may start here."""

    __slots__ = ("bulk", "outer", "pos", "remaining")

    def __init__(self, pos: int) -> None:
        self.pos = pos
        self.remaining = 1
        self.outer: list[int] = []
        self.bulk = False


_Step = Generator[DecodedBatch | None, None, int]


class _Sliced:
    """``iter_batch`` of a large payload: a generator of bounded steps, each giving a piece
    or ``None`` (nothing to apply yet); see the module docstring."""

    def __init__(self, payload: bytes | memoryview) -> None:
        self.walker = _Walker(payload)
        self.ts = 0.0
        self.rank: int | None = None

    def steps(self) -> Iterator[DecodedBatch | None]:
        """The pieces, each held back until the next is ready: the last carries the rank."""
        last: DecodedBatch | None = None
        for step in self._batch():
            if step is None:
                yield None
                continue
            if last is not None:
                yield last
            last = step
        if last is None:
            last = DecodedBatch(self.ts, (), None)
        yield DecodedBatch(
            last.ts, last.events, self.rank, last.unknown_kinds, last.malformed_events, last.kinds
        )

    def _small(self, pos: int) -> tuple[Any, int]:
        """The value at ``pos`` (at most ``_MAX_FIELD_BYTES``) and where it ends."""
        try:
            end = self.walker.end(pos, _MAX_FIELD_BYTES)
        except _TooLargeError:
            raise KVEventDecodeError(f"a field longer than {_MAX_FIELD_BYTES} bytes") from None
        return self.walker.decode(pos, end), end

    def _batch(self) -> _Step:
        walker = self.walker
        root = walker.container(0)
        if root is None:
            raise KVEventDecodeError("a batch is an array or a map")
        layout, count, pos = root
        if layout == _ARRAY:
            # [ts, events, rank, ...]: one pass, in order
            if count < 2:
                raise KVEventDecodeError("a batch array needs [ts, events, ...]")
            ts, pos = self._small(pos)
            self.ts = _timestamp(ts)
            end = yield from self._events(self._array_at(pos, "the batch events"))
            if count > 2:
                self.rank = _rank(self._small(end)[0])
            return end
        # a map: its keys in any order (the events are walked past, then read)
        events: tuple[int, int] | None = None
        fields: dict[str, Any] = {}
        for _ in range(count // 2):
            key, pos = self._small(pos)
            if key == "events":
                events = self._array_at(pos, "the batch events")
                pos = yield from walker.walk(pos)
            elif key in ("ts", "data_parallel_rank"):
                fields[key], pos = self._small(pos)
            else:
                pos = yield from walker.walk(pos)
        if "ts" not in fields:
            raise KVEventDecodeError("the batch timestamp is not a number")
        self.ts = _timestamp(fields["ts"])
        self.rank = _rank(fields.get("data_parallel_rank"))
        if events is None:
            raise KVEventDecodeError("the batch events are not an array")
        yield from self._events(events)
        return pos

    def _array_at(self, pos: int, what: str) -> tuple[int, int]:
        """The offset of the first item and the number of items of the array at ``pos``."""
        opened = self.walker.container(pos)
        if opened is None or opened[0] != _ARRAY:
            raise KVEventDecodeError(f"{what} are not an array")
        return opened[2], opened[1]

    def _events(self, array: tuple[int, int]) -> _Step:
        """The pieces of the events of ``array``; returns where they end."""
        walker = self.walker
        pos, count = array
        chunk_start = pos
        chunk_count = 0
        for _ in range(count):
            try:
                end = walker.end(pos, CHUNK_BYTES)
            except _TooLargeError:
                if chunk_count:
                    yield from self._chunk(chunk_start, pos, chunk_count)
                pos = yield from self._large(pos)
                chunk_start, chunk_count = pos, 0
                continue
            if end - chunk_start > CHUNK_BYTES and chunk_count:
                yield from self._chunk(chunk_start, pos, chunk_count)
                chunk_start, chunk_count = pos, 0
            pos = end
            chunk_count += 1
        if chunk_count:
            yield from self._chunk(chunk_start, pos, chunk_count)
        return pos

    def _chunk(self, start: int, end: int, count: int) -> Iterator[DecodedBatch]:
        """``count`` events of at most a chunk's bytes, decoded in one msgspec call."""
        raw = _decode(_array_header(count) + self.walker.buf[start:end])
        events, unknown, malformed, kinds = _convert(raw)
        yield from _pieces(self.ts, None, events, unknown, malformed, kinds)

    def _large(self, pos: int) -> _Step:
        """One event larger than a chunk: its small fields decoded, its token ids checked to
        be an array (not kept), its hashes decoded ``PIECE_HASHES`` at a time. Returns where
        it ends. Malformed: the batch is (its first pieces may have been given out)."""
        walker = self.walker
        opened = walker.container(pos)
        if opened is None:
            raise KVEventDecodeError("a large event is neither an array nor a map")
        layout, count, pos = opened
        values: dict[str, Any] = {}
        arrays: dict[str, tuple[int, int]] = {}
        if layout == _ARRAY:
            if not count:
                raise KVEventDecodeError("a large event without a kind")
            kind, pos = self._small(pos)
            names: Sequence[str] = _STORED_FIELDS if kind == "BlockStored" else _REMOVED_FIELDS
            for number in range(count - 1):
                name = names[number] if number < len(names) else ""
                pos = yield from self._field(name, pos, values, arrays)
        else:
            for _ in range(count // 2):
                name, pos = self._small(pos)
                pos = yield from self._field(
                    name if isinstance(name, str) else "", pos, values, arrays
                )
            kind = values.get("type")
        if kind == "AllBlocksCleared":
            yield DecodedBatch(self.ts, (AllBlocksCleared(),), None, kinds={kind: 1})
            return pos
        if isinstance(kind, str) and kind not in _KINDS:
            yield DecodedBatch(self.ts, (), None, unknown_kinds=1)
            return pos
        if kind not in ("BlockStored", "BlockRemoved"):
            raise KVEventDecodeError("a large event without a kind")
        hashes = arrays.get("block_hashes")
        if hashes is None:
            raise KVEventDecodeError(f"{kind}: block_hashes is not an array")
        try:
            if kind == "BlockStored":
                if "token_ids" not in arrays:
                    raise KVEventDecodeError("BlockStored: token_ids is not an array")
                head = _stored(
                    (),
                    values.get("parent_block_hash"),
                    values.get("block_size"),
                    values.get("lora_id"),
                    values.get("medium"),
                    values.get("lora_name"),
                )
                parent = head.parent_block_hash
                counted = {kind: 1}
                for part in self._hashes(*hashes):
                    stored = BlockStored(
                        block_hashes=part,
                        parent_block_hash=parent,
                        block_size=head.block_size,
                        lora_id=head.lora_id,
                        medium=head.medium,
                        lora_name=head.lora_name,
                    )
                    parent = part[-1]
                    yield DecodedBatch(self.ts, (stored,), None, kinds=counted)
                    counted = {}  # the event counts once, not once per piece
            else:
                medium = _optional_str(values.get("medium"))
                counted = {kind: 1}
                for part in self._hashes(*hashes):
                    removed = BlockRemoved(block_hashes=part, medium=medium)
                    yield DecodedBatch(self.ts, (removed,), None, kinds=counted)
                    counted = {}
        except (TypeError, ValueError) as exc:
            raise KVEventDecodeError(f"a large {kind}: {exc}") from None
        return pos

    def _field(
        self,
        name: str,
        pos: int,
        values: dict[str, Any],
        arrays: dict[str, tuple[int, int]],
    ) -> Generator[None, None, int]:
        """One field of a large event: the hashes' and token ids' arrays located and
        walked past, the others decoded (small) or walked past (unknown). Returns its end."""
        if name in ("block_hashes", "token_ids"):
            opened = self.walker.container(pos)
            if opened is None or opened[0] != _ARRAY:
                raise KVEventDecodeError(f"{name} is not an array")
            arrays[name] = (opened[2], opened[1])
            return (yield from self.walker.walk(pos))
        if name in _STORED_FIELDS or name == "type":
            values[name], end = self._small(pos)
            return end
        return (yield from self.walker.walk(pos))

    def _hashes(self, pos: int, count: int) -> Iterator[tuple[int, ...]]:
        """The hashes of the array of ``count`` items at ``pos``, ``PIECE_HASHES`` at a time
        (already walked: each item is checked to be an integer or a binary)."""
        walker = self.walker
        buf = walker.buf
        while count:
            taken = min(PIECE_HASHES, count)
            width = walker.uniform(pos, taken)
            if width:
                end = pos + width * taken
            else:
                end = pos
                for _ in range(taken):
                    if buf[end] not in _HASH_TAGS:
                        raise KVEventDecodeError("a block hash is an integer or bytes")
                    end = walker.scalar_end(end)
            yield _hashes(_decode(_array_header(taken) + buf[pos:end]))
            pos = end
            count -= taken


def _pieces(
    ts: float,
    rank: int | None,
    events: Sequence[KVEvent],
    unknown: int,
    malformed: int,
    kinds: dict[str, int],
) -> Iterator[DecodedBatch]:
    """``events`` in pieces of at most ``PIECE_HASHES`` hashes; the counts go with the first."""
    for number, part in enumerate(_split(events)):
        if number == 0:
            yield DecodedBatch(ts, part, rank, unknown, malformed, kinds)
        else:
            yield DecodedBatch(ts, part, rank)
