"""Decoding vLLM's KV-event batches: both layouts, both hash forms, bad input counted."""

from __future__ import annotations

import msgspec
import pytest

from adapters.kvevents.decode import KVEventDecodeError, decode_batch, external_hash
from ports.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from tests.simulator.kvevents import AllBlocksCleared as SimCleared
from tests.simulator.kvevents import BlockRemoved as SimRemoved
from tests.simulator.kvevents import BlockStored as SimStored
from tests.simulator.kvevents import EventBatch

encode = msgspec.msgpack.encode


def test_array_layout_from_the_simulator_publisher() -> None:
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
    decoded = decode_batch(encode(batch))
    assert decoded.ts == 12.5
    assert decoded.data_parallel_rank == 0
    assert decoded.events == (
        BlockStored(
            block_hashes=(1, 2),
            parent_block_hash=None,
            token_ids=tuple(range(32)),
            block_size=16,
            medium="GPU",
        ),
        BlockRemoved(block_hashes=(3,), medium="CPU"),
        AllBlocksCleared(),
    )
    assert decoded.kinds == {"BlockStored": 1, "BlockRemoved": 1, "AllBlocksCleared": 1}


def test_map_layout_bytes_hashes_and_older_shorter_events() -> None:
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
    decoded = decode_batch(payload)
    [stored] = decoded.events
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == (int.from_bytes(digest[-8:], "big"),)
    assert stored.lora_name == "ad"
    assert decoded.data_parallel_rank is None
    # a pre-medium engine: five fields after the kind, no rank
    older = decode_batch(encode([2.0, [["BlockStored", [7], 6, [1, 2], 2, None]]]))
    assert older.events[0] == BlockStored(
        block_hashes=(7,), parent_block_hash=6, token_ids=(1, 2), block_size=2
    )


def test_signed_and_huge_integers_become_unsigned_64_bit() -> None:
    assert external_hash(-1) == (1 << 64) - 1
    assert external_hash(5) == 5
    with pytest.raises(TypeError):
        external_hash(True)


@pytest.mark.parametrize(
    "payload",
    [b"\xc1", encode("batch"), encode([1.0]), encode(["x", []]), encode([1.0, {}]), encode({})],
)
def test_not_a_batch(payload: bytes) -> None:
    with pytest.raises(KVEventDecodeError):
        decode_batch(payload)


def test_unknown_and_malformed_events_are_skipped_and_counted() -> None:
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
    decoded = decode_batch(payload)
    assert decoded.unknown_kinds == 1
    assert decoded.malformed_events == 5
    assert decoded.events == (BlockRemoved(block_hashes=(9,)),)
