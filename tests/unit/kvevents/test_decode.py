"""Decoding vLLM's KV-event batches: both layouts, both hash forms, bad input counted.

Every case runs on both decoders: the whole payload in one msgspec call (``direct``, small
payloads) and the walked one that decodes a large payload a chunk at a time (``sliced``,
here forced on small payloads too), and the walked one on a ``memoryview`` (the subscriber
reads a ZMQ frame in place)."""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import pytest

from adapters.kvevents.decode import (
    CHUNK_BYTES,
    MAX_DEPTH,
    PIECE_HASHES,
    DecodedBatch,
    KVEventDecodeError,
    decode_batch,
    external_hash,
    iter_batch,
)
from ports.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from tests.simulator.kvevents import AllBlocksCleared as SimCleared
from tests.simulator.kvevents import BlockRemoved as SimRemoved
from tests.simulator.kvevents import BlockStored as SimStored
from tests.simulator.kvevents import EventBatch

encode = msgspec.msgpack.encode
Decode = Callable[[bytes], DecodedBatch]


@pytest.fixture(params=["direct", "sliced", "sliced-memoryview"])
def decode(request: pytest.FixtureRequest) -> Decode:
    if request.param == "direct":
        return lambda payload: decode_batch(payload, direct_bytes=1 << 30)
    if request.param == "sliced-memoryview":
        return lambda payload: decode_batch(memoryview(payload), direct_bytes=0)
    return lambda payload: decode_batch(payload, direct_bytes=0)


def test_array_layout_from_the_simulator_publisher(decode: Decode) -> None:
    batch = EventBatch(
        ts=12.5,
        events=[
            SimStored(
                block_hashes=[1, 2],
                parent_block_hash=None,
                token_ids=list(range(32)),
                block_size=16,
                lora_id=None,
                medium="GPU",
                lora_name=None,
            ),
            SimRemoved(block_hashes=[3], medium="CPU"),
            SimCleared(),
        ],
        data_parallel_rank=0,
    )
    decoded = decode(encode(batch))
    assert decoded.ts == 12.5
    assert decoded.data_parallel_rank == 0
    assert decoded.events == (
        BlockStored(
            block_hashes=(1, 2),
            parent_block_hash=None,
            block_size=16,
            medium="GPU",
        ),
        BlockRemoved(block_hashes=(3,), medium="CPU"),
        AllBlocksCleared(),
    )
    assert decoded.kinds == {"BlockStored": 1, "BlockRemoved": 1, "AllBlocksCleared": 1}


def test_map_layout_bytes_hashes_and_older_shorter_events(decode: Decode) -> None:
    digest = bytes(range(32))
    payload = encode(
        {
            "ts": 1,
            "events": [
                {
                    "type": "BlockStored",
                    "block_hashes": [digest],
                    "parent_block_hash": digest,
                    "token_ids": [5],
                    "block_size": 1,
                    "lora_id": None,
                    "medium": None,
                    "lora_name": "ad",
                    "extra_keys": None,
                },
            ],
        }
    )
    decoded = decode(payload)
    [stored] = decoded.events
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == (int.from_bytes(digest[-8:], "big"),)
    assert stored.lora_name == "ad"
    assert decoded.data_parallel_rank is None
    # a pre-medium engine: five fields after the kind, no rank
    older = decode(encode([2.0, [["BlockStored", [7], 6, [1, 2], 2, None]]]))
    assert older.events[0] == BlockStored(block_hashes=(7,), parent_block_hash=6, block_size=2)


def test_signed_and_huge_integers_become_unsigned_64_bit() -> None:
    assert external_hash(-1) == (1 << 64) - 1
    assert external_hash(5) == 5
    with pytest.raises(TypeError):
        external_hash(True)


@pytest.mark.parametrize(
    "payload",
    [b"\xc1", encode("batch"), encode([1.0]), encode(["x", []]), encode([1.0, {}]), encode({})],
)
def test_not_a_batch(decode: Decode, payload: bytes) -> None:
    with pytest.raises(KVEventDecodeError):
        decode(payload)


def test_unknown_and_malformed_events_are_skipped_and_counted(decode: Decode) -> None:
    payload = encode(
        [
            1.0,
            [
                ["BlockMoved", [1]],
                ["BlockStored", "nope", None, [], 16, None, None],
                ["BlockStored", [1], None, [1], 0],  # block_size 0
                ["BlockRemoved"],
                [],
                42,
                ["BlockRemoved", [9], None],
            ],
        ]
    )
    decoded = decode(payload)
    assert decoded.unknown_kinds == 1
    assert decoded.malformed_events == 5
    assert decoded.events == (BlockRemoved(block_hashes=(9,)),)


NOT_UTF8 = b"\xa3\xff\xfe\xfd"  # a msgpack string of 3 bytes that are not UTF-8


@pytest.mark.parametrize(
    "payload",
    [
        pytest.param(NOT_UTF8, id="not-utf8"),
        pytest.param(b"\x93\x01\x91\x91" + NOT_UTF8 + b"\x00", id="not-utf8-kind"),
        pytest.param(b"\x93\x01\x91" + b"\x91" * 5_000 + b"\xc0\x00", id="nested-5000"),
        pytest.param(b"\x91" * 200_000 + b"\xc0", id="nested-200000"),
        pytest.param(b"\x93\x01\xdd\xff\xff\xff\xff\x00", id="array-longer-than-the-payload"),
        pytest.param(b"\x93\x01\x91\xc1", id="reserved-type-byte"),
    ],
)
def test_anything_that_does_not_decode_is_not_a_batch(decode: Decode, payload: bytes) -> None:
    with pytest.raises(KVEventDecodeError):
        decode(payload)


def test_nesting_beyond_the_walkers_limit_is_not_a_batch() -> None:
    deep = b"\x93\x01\x91" + b"\x91" * MAX_DEPTH + b"\xc0\x00"
    with pytest.raises(KVEventDecodeError, match="nested deeper"):
        decode_batch(deep, direct_bytes=0)


def test_a_name_longer_than_a_name_makes_the_event_malformed(decode: Decode) -> None:
    payload = encode([1.0, [["BlockRemoved", [1], "G" * 300], ["BlockRemoved", [2], "CPU"]]])
    decoded = decode(payload)
    assert decoded.malformed_events == 1
    assert decoded.events == (BlockRemoved(block_hashes=(2,), medium="CPU"),)


def _chained(parts: list[BlockStored]) -> tuple[int, ...]:
    """The hashes of consecutive pieces of one event, checking each follows the last."""
    out: list[int] = []
    for part in parts:
        assert part.parent_block_hash == (out[-1] if out else 5)
        out.extend(part.block_hashes)
    return tuple(out)


@pytest.mark.parametrize(
    "hashes",
    [
        pytest.param([(1 << 63) + i for i in range(8 * PIECE_HASHES + 7)], id="uint64"),
        pytest.param([i % 100 for i in range(70_000)], id="fixint"),
        pytest.param([bytes([i % 251]) * 32 for i in range(2 * PIECE_HASHES + 1)], id="bytes"),
        pytest.param([i if i % 2 else bytes([1]) * 32 for i in range(10_000)], id="mixed"),
    ],
)
@pytest.mark.parametrize("layout", ["array", "map"])
def test_an_event_of_many_hashes_comes_in_pieces_of_one_chain(
    hashes: list[int | bytes], layout: str
) -> None:
    event: object = ["BlockStored", hashes, 5, list(range(16)), 16, None, "CPU", "ad"]
    if layout == "map":
        event = {
            "type": "BlockStored",
            "block_hashes": hashes,
            "parent_block_hash": 5,
            "token_ids": [],
            "block_size": 16,
            "medium": "CPU",
            "lora_name": "ad",
        }
    payload = encode([3.0, [["AllBlocksCleared"], event, ["BlockRemoved", [1]]], 2])
    assert len(payload) > CHUNK_BYTES  # the large-event path when sliced
    expected = tuple(external_hash(h) for h in hashes)
    for direct, given in ((1 << 30, payload), (0, payload), (0, memoryview(payload))):
        pieces = [p for p in iter_batch(given, direct_bytes=direct) if p is not None]
        assert all(
            sum(len(getattr(e, "block_hashes", ())) for e in p.events) <= PIECE_HASHES
            for p in pieces
        )
        events = [e for p in pieces for e in p.events]
        assert events[0] == AllBlocksCleared()
        assert events[-1] == BlockRemoved(block_hashes=(1,))
        stored = events[1:-1]
        assert all(isinstance(e, BlockStored) for e in stored)
        assert _chained(stored) == expected  # type: ignore[arg-type]
        assert {(e.medium, e.lora_name, e.block_size) for e in stored} == {("CPU", "ad", 16)}  # type: ignore[union-attr]
        # counted once each, whatever the pieces
        assert sum(p.kinds.get("BlockStored", 0) for p in pieces) == 1
        assert pieces[-1].data_parallel_rank == 2
        assert {p.ts for p in pieces} == {3.0}


def test_a_large_event_with_a_bad_hash_fails_the_batch() -> None:
    hashes: list[object] = [(1 << 63) + i for i in range(10_000)]
    hashes[9_000] = "not a hash"
    payload = encode([1.0, [["BlockStored", hashes, None, [], 16]]])
    assert len(payload) > CHUNK_BYTES
    with pytest.raises(KVEventDecodeError):
        decode_batch(payload, direct_bytes=0)
    # the same in one call: the event is skipped and counted
    assert decode_batch(payload, direct_bytes=1 << 30).malformed_events == 1


def test_many_small_events_are_decoded_a_chunk_at_a_time() -> None:
    events = [["BlockRemoved", [i]] for i in range(20_000)] + [["BlockMoved"], ["BlockStored"]]
    payload = encode({"events": events, "ts": 4.0})
    assert len(payload) > 3 * CHUNK_BYTES
    pieces = [p for p in iter_batch(payload, direct_bytes=0) if p is not None]
    assert len(pieces) >= 3
    removed = [e for p in pieces for e in p.events]
    assert [e.block_hashes for e in removed] == [(i,) for i in range(20_000)]  # type: ignore[union-attr]
    assert sum(p.unknown_kinds for p in pieces) == 1
    assert sum(p.malformed_events for p in pieces) == 1
    assert sum(p.kinds.get("BlockRemoved", 0) for p in pieces) == 20_000
