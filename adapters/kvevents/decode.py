"""vLLM's KV-event batches: msgpack payloads decoded into ``ports.kv_events`` events.

The payload is an ``EventBatch``: ``[ts, events, data_parallel_rank]`` (older and most
current vLLM releases encode structs as arrays), or the same as a map with those keys.
Each event is an array whose first item is the kind, or a map whose ``type`` key is:

- ``BlockStored``: block_hashes, parent_block_hash, token_ids, block_size, lora_id,
  medium, lora_name (later fields optional; newer engines append more, ignored);
- ``BlockRemoved``: block_hashes, medium;
- ``AllBlocksCleared``.

A block hash is an unsigned 64-bit integer, or the engine's raw hash bytes (vLLM with
integer hashes turned off), reduced here to their low 64 bits, the integer form.

msgspec decodes the payload untyped (lists, dicts, ints, bytes) and this module checks
each field, so a batch from a newer or older engine layout still decodes, and an unknown
or malformed event is skipped and counted rather than failing the whole batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from ports.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

__all__ = ["DecodedBatch", "KVEventDecodeError", "decode_batch", "external_hash"]

_MASK64 = (1 << 64) - 1
_DECODER = msgspec.msgpack.Decoder()

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


def decode_batch(payload: bytes) -> DecodedBatch:
    """Decode one payload; raises ``KVEventDecodeError`` when it is not a batch."""
    try:
        root = _DECODER.decode(payload)
    except msgspec.DecodeError as exc:
        raise KVEventDecodeError(f"not msgpack: {exc}") from None
    if isinstance(root, list):
        if len(root) < 2:
            raise KVEventDecodeError("a batch array needs [ts, events, ...]")
        ts, raw_events = root[0], root[1]
        rank = root[2] if len(root) > 2 else None
    elif isinstance(root, dict):
        ts, raw_events, rank = root.get("ts"), root.get("events"), root.get("data_parallel_rank")
    else:
        raise KVEventDecodeError(f"a batch is an array or a map, not {type(root).__name__}")
    if isinstance(ts, bool) or not isinstance(ts, int | float):
        raise KVEventDecodeError("the batch timestamp is not a number")
    if not isinstance(raw_events, list):
        raise KVEventDecodeError("the batch events are not an array")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
        raise KVEventDecodeError("data_parallel_rank is not an integer")
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
    return DecodedBatch(float(ts), tuple(events), rank, unknown, malformed, kinds)


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
    if value is None or isinstance(value, str):
        return value
    raise TypeError("expected a string")


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
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in tokens
        ):
            raise TypeError("token_ids is not an array of integers")
        block_size = _optional_int(size)
        if block_size is None or block_size < 1:
            raise ValueError("block_size must be >= 1")
        return kind, BlockStored(
            block_hashes=_hashes(hashes),
            parent_block_hash=None if parent is None else external_hash(parent),
            token_ids=tuple(tokens),
            block_size=block_size,
            lora_id=_optional_int(lora_id),
            medium=_optional_str(medium),
            lora_name=_optional_str(lora_name),
        )
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
