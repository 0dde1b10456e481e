"""The ``SharedKVBlocks`` contract, run on every implementation: the in-memory board
(``domain.sharedstate.LoadBoard``), Redis on one server and Redis on a 3-master cluster. Two
or three instances play the processes of one pool; each publishes the prefix blocks its
in-flight requests hold per endpoint and its blocks that are not shared, and reads back the
blocks the pool holds beyond its own: a prefix block several processes hold counts once.
The count is estimated from the sampled hashes (one in 16), exact where the processes hold
the same prefixes or different ones: the hashes here are chosen so (a prefix of 96 blocks
and tails of 16 each hold one sampled hash in 16). Then the faults: a process that dies, a
process that stops, Redis flushed."""

from __future__ import annotations

import asyncio
import time

from redis.asyncio import Redis

from adapters.redis import RedisSharedLoad, connect
from adapters.redis.shared_load import ADMISSION_LEASE
from ports.shared_state import HASH_MASK, SAMPLE_MASK
from tests.contract.processes import SEEN_WITHIN, Process, Processes, until
from tests.support.redis import RedisServer

#: 64-bit block hashes, the high bit set on some (as the hashers produce them).
SYSTEM_PROMPT = [0x8000_0000_0000_0000 + i for i in range(96)]
TAIL_A = [0x1111_0000_0000_0000 + i for i in range(16)]
TAIL_B = [0x2222_0000_0000_0000 + i for i in range(16)]


def counts(process: Process) -> dict[str, int]:
    return {endpoint: blocks.count for endpoint, blocks in process.kv_blocks().items()}


def sampled(hashes: list[int]) -> frozenset[int]:
    return frozenset(h & HASH_MASK for h in hashes if not h & SAMPLE_MASK)


async def test_a_prefix_held_by_two_processes_counts_once(pool: Processes) -> None:
    a, b, c = await pool.process(), await pool.process(), await pool.process()
    a.publish_blocks("e1", SYSTEM_PROMPT + TAIL_A, (), 5)
    b.publish_blocks("e1", SYSTEM_PROMPT + TAIL_B, (), 3)
    b.publish_blocks("e2", TAIL_B, (), 1)
    # c holds nothing: the pool's distinct prefix blocks plus everyone's own blocks.
    await until(lambda: counts(c) == {"e1": 128 + 8, "e2": 16 + 1}, "c sees a + b")
    # a: what b holds beyond a's blocks (its tail) and b's own blocks.
    await until(lambda: counts(a) == {"e1": 16 + 3, "e2": 17}, "a sees b beyond a")
    await until(lambda: counts(b) == {"e1": 16 + 5}, "b sees a beyond b")


async def test_a_partly_shared_prefix_is_estimated_from_the_sample(pool: Processes) -> None:
    # a holds the first half of the prompt b holds: b's blocks beyond a's are estimated
    # from b's sampled hashes a does not hold (3 of 6: 48 blocks).
    a, b = await pool.process(), await pool.process()
    a.publish_blocks("e1", SYSTEM_PROMPT[:48], (), 1)
    b.publish_blocks("e1", SYSTEM_PROMPT, (), 1)
    await until(lambda: counts(a) == {"e1": 48 + 1}, "a sees b's second half")
    await until(lambda: counts(b) == {"e1": 0 + 1}, "b sees nothing of a's beyond its own")


async def test_a_prefix_this_process_frees_counts_again_at_once(pool: Processes) -> None:
    # The server keeps the prefix for a's request: the moment b's last request on it ends,
    # b counts it as a's, without waiting for a round trip (where b would let in requests
    # into room that is not there).
    a, b = await pool.process(), await pool.process()
    a.publish_blocks("e1", SYSTEM_PROMPT, (), 1)
    b.publish_blocks("e1", SYSTEM_PROMPT + TAIL_B, (), 2)
    await until(lambda: counts(b) == {"e1": 0 + 1}, "b holds all a holds")
    b.publish_blocks("e1", (), SYSTEM_PROMPT + TAIL_B, 0)
    assert counts(b) == {"e1": 96 + 1}
    b.publish_blocks("e1", SYSTEM_PROMPT, (), 1)
    assert counts(b) == {"e1": 0 + 1}


async def test_the_others_hashes_are_sampled(pool: Processes) -> None:
    # Which of its blocks another process holds, one hash in 16: a request's chain is held
    # elsewhere up to its last block in the sample.
    a, b = await pool.process(), await pool.process()
    negative = [-(i + 1) for i in range(16)]  # as Python's hash() can give
    a.publish_blocks("e1", SYSTEM_PROMPT + TAIL_A + negative, (), 1)
    b.publish_blocks("e1", SYSTEM_PROMPT, (), 1)
    expected = sampled(SYSTEM_PROMPT + TAIL_A + negative)
    await until(lambda: b.kv_blocks().get("e1") is not None, "b sees a")
    await until(lambda: b.kv_blocks()["e1"].sampled == expected, "b sees a's sample")
    assert b.kv_blocks()["e1"].count == 16 + 16 + 1
    assert len(expected) == 6 + 1 + 1  # 0x...00, 10, ..., 50 of the prompt; 0x1111...0; -16


async def test_released_blocks_stop_counting(pool: Processes) -> None:
    a, b = await pool.process(), await pool.process()
    a.publish_blocks("e1", SYSTEM_PROMPT + TAIL_A, (), 2)
    await until(lambda: counts(b).get("e1") == 114, "b sees a")
    a.publish_blocks("e1", (), TAIL_A, 1)  # one request ended: its tail is free
    await until(lambda: counts(b).get("e1") == 97, "b sees the tail released")
    a.publish_blocks("e1", (), SYSTEM_PROMPT, 0)  # the last one ended
    await until(lambda: "e1" not in b.kv_blocks(), "b sees nothing on e1")


async def test_a_removed_endpoint_is_forgotten(pool: Processes) -> None:
    a, b = await pool.process(), await pool.process()
    a.publish_blocks("gone", TAIL_A, (), 4)
    a.publish_blocks("kept", TAIL_B, (), 1)
    await until(lambda: counts(b) == {"gone": 20, "kept": 17}, "b sees both")
    a.remove_endpoint("gone")
    await until(lambda: counts(b) == {"kept": 17}, "b forgets the removed endpoint")


async def test_stop_withdraws_the_blocks(pool: Processes) -> None:
    a, b = await pool.process(lease=30.0), await pool.process(lease=30.0)
    a.publish_blocks("e1", SYSTEM_PROMPT, (), 1)
    await until(lambda: bool(b.kv_blocks()), "b sees a")
    await a.stop()
    pool.started.remove(a)
    await until(lambda: not b.kv_blocks(), "a withdrawn")


async def test_a_dead_process_stops_counting_within_the_admission_lease(pool: Processes) -> None:
    a, b = await pool.process(lease=30.0), await pool.process(lease=30.0)
    c = await pool.process(lease=30.0)
    a.publish_blocks("e1", SYSTEM_PROMPT + TAIL_A, (), 1)
    b.publish_blocks("e1", SYSTEM_PROMPT, (), 2)
    await until(lambda: counts(c) == {"e1": 112 + 3}, "c sees a and b")
    crashed_at = time.monotonic()
    await pool.crash(a)
    pool.started.remove(a)
    # a's tail and its own block stop counting; the prefix b holds too still counts.
    await until(
        lambda: counts(c) == {"e1": 96 + 2},
        "a's blocks lapsed",
        within=ADMISSION_LEASE + SEEN_WITHIN,
    )
    assert time.monotonic() - crashed_at >= ADMISSION_LEASE - 0.25


async def test_a_redis_flush_heals_without_a_new_publish(
    redis_scratch_server: RedisServer, key_prefix: str
) -> None:
    client = connect(redis_scratch_server.url, socket_timeout=5.0)
    raw = Redis(host="127.0.0.1", port=redis_scratch_server.port)
    a = RedisSharedLoad(client, key_prefix=key_prefix, lease=10.0, staleness=0.02)
    b = RedisSharedLoad(client, key_prefix=key_prefix, lease=10.0, staleness=0.02)
    try:
        await a.start()
        await b.start()
        a.publish_blocks("e1", SYSTEM_PROMPT + TAIL_A, (), 2)
        await until(lambda: counts(b).get("e1") == 114, "b sees a")
        await raw.flushall()
        # a's next round trip finds its keys gone and writes them all again.
        started = time.monotonic()
        while not await raw.keys(f"{key_prefix}:load:*:s:{a.process_id}:e1"):
            assert time.monotonic() - started < SEEN_WITHIN, "a never rewrote its blocks"
            await asyncio.sleep(0.005)
        await until(lambda: counts(b).get("e1") == 114, "b sees a again")
    finally:
        await a.stop()
        await b.stop()
        await client.aclose()
        await raw.aclose()
