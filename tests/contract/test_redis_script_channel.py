"""The single server's script channel (``adapters.redis.pipelined``) on a real redis-server:
concurrent scripts on one connection, each caller given its own reply, callers that give up
leaving the others' replies in place, a bound on the calls waiting, the database number."""

from __future__ import annotations

import asyncio
import time

import pytest
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from adapters.redis import RedisClient, RedisPrefixIndex, connect
from adapters.redis.pipelined import ScriptChannel
from tests.support.redis import RedisServer

# asserts how long calls take: run alone (`make test` runs these after the others)
pytestmark = pytest.mark.timed


def _connections_received(server: RedisServer) -> int:
    for line in server.cli("INFO", "stats").splitlines():
        if line.startswith("total_connections_received:"):
            return int(line.split(":")[1])
    raise AssertionError("no total_connections_received in INFO stats")


def _chain(i: int) -> list[int]:
    return [0x10_0000 * (i + 1) + j for j in range(4)]


async def test_concurrent_scripts_share_one_connection_and_get_their_own_replies(
    redis_server: RedisServer, redis_client: RedisClient, key_prefix: str
) -> None:
    index = RedisPrefixIndex(redis_client, key_prefix=key_prefix)
    before = _connections_received(redis_server)
    # 40 chains, each on its own endpoint with its own length: every reply is different
    await asyncio.gather(*(index.add(_chain(i)[: 1 + i % 4], f"pod-{i}", 10) for i in range(40)))
    matches = await asyncio.gather(*(index.match(_chain(i)) for i in range(40)))
    assert matches == [{f"pod-{i}": 1 + i % 4} for i in range(40)]
    # one for the 80 scripts, one for the redis-cli that reads INFO
    assert _connections_received(redis_server) - before == 2


async def test_callers_that_give_up_leave_the_others_replies_in_place(
    redis_client: RedisClient, key_prefix: str
) -> None:
    index = RedisPrefixIndex(redis_client, key_prefix=key_prefix)
    await asyncio.gather(*(index.add(_chain(i), f"pod-{i}", 10) for i in range(20)))
    calls = [asyncio.ensure_future(index.match(_chain(i))) for i in range(20)]
    await asyncio.sleep(0)  # all sent, in one write, no reply read yet
    for call in calls[::2]:
        call.cancel()
    kept = await asyncio.gather(*calls[1::2])
    assert kept == [{f"pod-{i}": 4} for i in range(1, 20, 2)]
    assert await index.match(_chain(0)) == {"pod-0": 4}


async def test_calls_waiting_on_a_silent_server_are_bounded_then_time_out(
    silent_port: int,
) -> None:
    channel = ScriptChannel(
        "127.0.0.1", silent_port, connect_timeout=1.0, socket_timeout=0.3, max_pending=3
    )
    try:
        waiting = [asyncio.ensure_future(channel.call(("PING",))) for _ in range(3)]
        await asyncio.sleep(0.05)  # connected, sent
        assert not any(call.done() for call in waiting)
        started = time.monotonic()
        with pytest.raises(RedisConnectionError, match="3 calls already wait"):
            await channel.call(("PING",))
        assert time.monotonic() - started < 0.1
        results = await asyncio.gather(*waiting, return_exceptions=True)
        assert all(isinstance(r, RedisTimeoutError) for r in results), results
        assert time.monotonic() - started < 0.3 + 0.5
    finally:
        await channel.aclose()


async def test_commands_a_server_does_not_read_are_bounded_in_bytes(silent_port: int) -> None:
    channel = ScriptChannel(
        "127.0.0.1", silent_port, connect_timeout=1.0, socket_timeout=5.0, max_buffered=1 << 20
    )
    try:
        # more than the kernel's buffers take on loopback: the rest waits in the transport
        big = asyncio.ensure_future(channel.call(("ECHO", b"x" * (64 << 20))))
        await asyncio.sleep(0.05)
        assert not big.done()
        with pytest.raises(RedisConnectionError, match="bytes of commands already wait"):
            await channel.call(("PING",))
    finally:
        await channel.aclose()
    with pytest.raises(RedisConnectionError, match="closed"):
        await big


async def test_the_urls_database_is_the_one_written(
    redis_server: RedisServer, key_prefix: str
) -> None:
    client = connect(f"{redis_server.url}/3")
    db3 = Redis(host="127.0.0.1", port=redis_server.port, db=3)
    db0 = Redis(host="127.0.0.1", port=redis_server.port, db=0)
    try:
        await RedisPrefixIndex(client, key_prefix=key_prefix).add(_chain(0), "pod-a", 10)
        assert await db3.keys(f"{key_prefix}*")
        assert not await db0.keys(f"{key_prefix}*")
    finally:
        await db3.aclose()
        await db0.aclose()
        await client.aclose()
