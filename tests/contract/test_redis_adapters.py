"""What only the Redis adapters have: TLS, ACL users, bad credentials, unreachable or
silent servers, a flushed script cache, a server killed and restarted empty, error replies.
Every store failure must surface as ``SharedStateError``, quickly, and the same client must
work again once the server is back."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable

import pytest

from adapters.redis import RedisClient, RedisPrefixIndex, RedisSharedLoad, connect
from ports.shared_state import EndpointLoad, SharedStateError
from tests.support.redis import (
    ACL_CLUSTER_COMMANDS,
    ACL_COMMANDS,
    ACL_PASSWORD,
    ACL_USER,
    RedisCluster,
    RedisServer,
    TlsFiles,
)

CONNECT_TIMEOUT = 0.2
SOCKET_TIMEOUT = 0.1
#: Scheduling slack on a shared 2-core machine.
SLACK = 0.5
CHAIN = [0x1234_5678_9ABC_DEF0 + i for i in range(8)]


async def until(condition: Callable[[], bool], what: str, within: float = 5.0) -> None:
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > within:
            raise AssertionError(f"not within {within}s: {what}")
        await asyncio.sleep(0.01)


async def exercise(url: str, key_prefix: str) -> None:
    """Every call both adapters make, through a client for ``url``."""
    client = connect(url, connect_timeout=2.0, socket_timeout=2.0)
    try:
        index = RedisPrefixIndex(client, key_prefix=key_prefix)
        await index.add(CHAIN, "pod-a", 100)
        await index.add(CHAIN[:3], "pod-b", 2)
        assert await index.match(CHAIN) == {"pod-a": 8, "pod-b": 2}
        await index.remove_endpoint("pod-a")
        assert await index.match(CHAIN) == {}
        assert await index.claim(CHAIN, "pod-c", 100) == "pod-c"
        assert await index.claim(CHAIN, "pod-d", 100) == "pod-c"
        await index.remove_endpoint("pod-c")
        a = RedisSharedLoad(client, key_prefix=key_prefix, lease=2.0)
        b = RedisSharedLoad(client, key_prefix=key_prefix, lease=2.0)
        a.publish("pod-a", EndpointLoad(2, 20))
        await a.sync_once()
        await b.sync_once()
        assert b.others() == {"pod-a": EndpointLoad(2, 20)}
        a.remove_endpoint("pod-a")
        await a.sync_once()
        await b.sync_once()
        assert b.others() == {}
        await a.stop()
        await b.stop()
    finally:
        await client.aclose()


async def test_tls_with_the_servers_ca(
    tls_redis_server: RedisServer, tls_files: TlsFiles, key_prefix: str
) -> None:
    url = f"rediss://{tls_redis_server.address}?ssl_ca_certs={tls_files.ca_cert}"
    await exercise(url, key_prefix)


async def test_tls_with_an_unknown_ca_fails_as_shared_state_error(
    tls_redis_server: RedisServer, key_prefix: str
) -> None:
    client = connect(f"rediss://{tls_redis_server.address}", connect_timeout=2.0)
    try:
        with pytest.raises(SharedStateError, match="prefix match failed"):
            await RedisPrefixIndex(client, key_prefix=key_prefix).match(CHAIN)
    finally:
        await client.aclose()


async def test_an_acl_user_limited_to_epp_keys(redis_server: RedisServer, key_prefix: str) -> None:
    url = f"redis://{ACL_USER}:{ACL_PASSWORD}@{redis_server.address}"
    await exercise(url, key_prefix)
    client = connect(url)
    try:
        with pytest.raises(SharedStateError, match="NoPermissionError"):
            await RedisPrefixIndex(client, key_prefix="other").add(CHAIN, "pod-a", 10)
    finally:
        await client.aclose()


async def test_an_acl_user_on_a_cluster(redis_cluster: RedisCluster, key_prefix: str) -> None:
    """The same user on every node, with the cluster client's own commands added."""
    for node in redis_cluster.nodes:
        node.add_acl_user(commands=ACL_COMMANDS + " " + ACL_CLUSTER_COMMANDS)
    first = redis_cluster.nodes[0].address
    others = ",".join(node.address for node in redis_cluster.nodes[1:])
    await exercise(f"redis+cluster://{ACL_USER}:{ACL_PASSWORD}@{first},{others}", key_prefix)


async def test_a_wrong_password_fails_fast(redis_server: RedisServer, key_prefix: str) -> None:
    url = f"redis://{ACL_USER}:wrong@{redis_server.address}"
    client = connect(url, connect_timeout=CONNECT_TIMEOUT, socket_timeout=SOCKET_TIMEOUT)
    try:
        started = time.monotonic()
        with pytest.raises(SharedStateError, match="prefix match failed"):
            await RedisPrefixIndex(client, key_prefix=key_prefix).match(CHAIN)
        assert time.monotonic() - started < CONNECT_TIMEOUT + SOCKET_TIMEOUT + SLACK
    finally:
        await client.aclose()


@pytest.mark.parametrize("scheme", ["redis", "redis+cluster"])
async def test_a_silent_server_fails_within_the_timeouts(
    silent_port: int, scheme: str, key_prefix: str
) -> None:
    client = connect(
        f"{scheme}://127.0.0.1:{silent_port}",
        connect_timeout=CONNECT_TIMEOUT,
        socket_timeout=SOCKET_TIMEOUT,
    )
    try:
        started = time.monotonic()
        with pytest.raises(SharedStateError, match="Timeout"):
            await RedisPrefixIndex(client, key_prefix=key_prefix).match(CHAIN)
        took = time.monotonic() - started
        assert took < CONNECT_TIMEOUT + SOCKET_TIMEOUT + SLACK, took
    finally:
        await client.aclose()


@pytest.mark.parametrize("scheme", ["redis", "redis+cluster"])
async def test_a_closed_port_fails_at_once(scheme: str, key_prefix: str) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])  # bound, never listening: refused
        client = connect(f"{scheme}://127.0.0.1:{port}", connect_timeout=CONNECT_TIMEOUT)
        try:
            started = time.monotonic()
            with pytest.raises(SharedStateError):
                await RedisPrefixIndex(client, key_prefix=key_prefix).add(CHAIN, "pod-a", 5)
            assert time.monotonic() - started < CONNECT_TIMEOUT + SLACK
        finally:
            await client.aclose()


async def test_noscript_after_script_flush_is_transparent(
    redis_server: RedisServer, redis_client: RedisClient, key_prefix: str
) -> None:
    index = RedisPrefixIndex(redis_client, key_prefix=key_prefix)
    await index.add(CHAIN, "pod-a", 100)
    assert await index.match(CHAIN) == {"pod-a": 8}
    redis_server.cli("SCRIPT", "FLUSH")
    assert await index.match(CHAIN) == {"pod-a": 8}
    redis_server.cli("SCRIPT", "FLUSH")
    await index.add(CHAIN, "pod-b", 100)
    redis_server.cli("SCRIPT", "FLUSH")
    await index.remove_endpoint("pod-a")
    assert await index.match(CHAIN) == {"pod-b": 8}
    load = RedisSharedLoad(redis_client, key_prefix=key_prefix)
    redis_server.cli("SCRIPT", "FLUSH")
    await load.sync_once()


async def test_noscript_on_a_cluster_is_transparent(
    redis_cluster: RedisCluster, key_prefix: str
) -> None:
    client = connect(redis_cluster.url)
    try:
        index = RedisPrefixIndex(client, key_prefix=key_prefix)
        await index.add(CHAIN, "pod-a", 4)
        for node in redis_cluster.nodes:
            node.cli("SCRIPT", "FLUSH")
        await index.add(CHAIN, "pod-b", 100)
        assert await index.match(CHAIN) == {"pod-b": 8, "pod-a": 4}
    finally:
        await client.aclose()


async def test_keys_of_the_earlier_one_key_per_block_layout_are_ignored(
    redis_server: RedisServer, redis_client: RedisClient, key_prefix: str
) -> None:
    """Keys an earlier version wrote (one hash per block, ``P:b:{<root>}:<hash>``; recency
    members that name them) break nothing: matches ignore them, evicting or removing their
    endpoint succeeds, and they expire on their own."""
    index = RedisPrefixIndex(redis_client, key_prefix=key_prefix)
    root = f"{CHAIN[0]:016x}"
    now_ms = str(time.time_ns() // 1_000_000)
    for block in CHAIN:
        old = f"{key_prefix}:b:{{{root}}}:{block:016x}"
        redis_server.cli("HSET", old, "pod-old", now_ms)
        redis_server.cli("PEXPIRE", old, "60000")
        redis_server.cli("ZADD", index.lru_key("pod-a"), "0", f"{root}:{block:016x}")
    assert await index.match(CHAIN) == {}
    # pod-a's recency set holds the old members first: this add evicts them.
    await index.add(CHAIN[:3], "pod-a", 3)
    assert await index.match(CHAIN) == {"pod-a": 3}
    assert await index.claim(CHAIN, "pod-b", 100) == "pod-a"
    await index.remove_endpoint("pod-a")
    assert await index.match(CHAIN) == {}
    assert int(redis_server.cli("PTTL", f"{key_prefix}:b:{{{root}}}:{CHAIN[0]:016x}")) > 0


async def test_an_endpoint_name_that_ends_like_another_is_kept_apart(
    redis_client: RedisClient, key_prefix: str
) -> None:
    """A block's holders are lines of one value: a name that ends in another's (after a
    space) must not be taken for it when that one is refreshed or evicted."""
    index = RedisPrefixIndex(redis_client, key_prefix=key_prefix)
    await index.add(CHAIN, "x pod-a", 100)
    await index.add(CHAIN, "pod-a", 100)
    await index.add(CHAIN, "x pod-a", 100)
    await index.add(CHAIN, "pod-a", 100)
    assert await index.match(CHAIN) == {"x pod-a": 8, "pod-a": 8}
    await index.add([CHAIN[0] + 100 + i for i in range(8)], "pod-a", 8)  # evicts CHAIN
    assert await index.match(CHAIN) == {"x pod-a": 8}
    await index.remove_endpoint("x pod-a")
    assert await index.match(CHAIN) == {}


async def test_a_chain_key_sheds_the_blocks_nobody_holds_any_more(
    redis_server: RedisServer, redis_client: RedisClient, key_prefix: str
) -> None:
    """A chain written for as long as it is used keeps only the blocks some endpoint held
    within the TTL, even when an endpoint's evictions were lost (its recency set gone)."""
    index = RedisPrefixIndex(redis_client, key_prefix=key_prefix, ttl=0.3)
    long_chain = [CHAIN[0] + i for i in range(200)]
    await index.add(long_chain, "pod-a", 1000)
    redis_server.cli("DEL", index.lru_key("pod-a"))  # its entries can no longer be evicted
    key = index.chain_key(CHAIN[0])
    assert int(redis_server.cli("HLEN", key)) >= 200
    started = time.monotonic()
    while int(redis_server.cli("HLEN", key)) > 3:  # the live block and the sweep mark
        assert time.monotonic() - started < 5.0, "the stale blocks stayed"
        await index.add(CHAIN[:1], "pod-b", 10)  # keeps the chain key alive
        await asyncio.sleep(0.02)
    assert await index.match(long_chain) == {"pod-b": 1}


async def test_an_error_reply_is_a_shared_state_error(
    redis_server: RedisServer, redis_client: RedisClient, key_prefix: str
) -> None:
    index = RedisPrefixIndex(redis_client, key_prefix=key_prefix)
    redis_server.cli("SET", index.chain_key(CHAIN[0]), "not a hash")
    with pytest.raises(SharedStateError, match="WRONGTYPE"):
        await index.match(CHAIN)
    with pytest.raises(SharedStateError, match="WRONGTYPE"):
        await index.add(CHAIN, "pod-a", 10)


async def test_a_server_killed_and_restarted_empty(
    redis_scratch_server: RedisServer, key_prefix: str
) -> None:
    server = redis_scratch_server
    client = connect(server.url, connect_timeout=CONNECT_TIMEOUT, socket_timeout=SOCKET_TIMEOUT)
    lease = 1.0
    index = RedisPrefixIndex(client, key_prefix=key_prefix)
    a = RedisSharedLoad(client, key_prefix=key_prefix, lease=lease, staleness=0.02)
    b = RedisSharedLoad(client, key_prefix=key_prefix, lease=lease, staleness=0.02)
    try:
        await a.start()
        await b.start()
        await index.add(CHAIN, "pod-a", 100)
        a.publish("pod-a", EndpointLoad(3, 30))
        await until(lambda: b.others() == {"pod-a": EndpointLoad(3, 30)}, "b sees a")

        server.kill()
        for call in (index.match(CHAIN), index.add(CHAIN, "pod-b", 10)):
            started = time.monotonic()
            with pytest.raises(SharedStateError):
                await call
            assert time.monotonic() - started < CONNECT_TIMEOUT + SOCKET_TIMEOUT + SLACK
        with pytest.raises(SharedStateError):
            await index.remove_endpoint("pod-a")
        await until(lambda: b.degraded, "b notices the outage")
        assert b.others() == {"pod-a": EndpointLoad(3, 30)}  # the last copy, within a lease
        await until(lambda: b.others() == {}, "the copy expires after a lease", within=lease + 3)

        server.start()  # same port, empty
        await until(lambda: not a.degraded and not b.degraded, "both heal")
        # a republished its totals without publishing again.
        await until(lambda: b.others() == {"pod-a": EndpointLoad(3, 30)}, "b sees a again")
        assert await index.match(CHAIN) == {}  # the prefix index restarted empty
        await index.add(CHAIN, "pod-a", 100)
        assert await index.match(CHAIN) == {"pod-a": 8}
    finally:
        await a.stop()
        await b.stop()
        await client.aclose()


async def test_a_change_is_synced_within_a_quarter_of_the_staleness(
    redis_server: RedisServer, key_prefix: str
) -> None:
    """Under traffic the shared load is fresher than the idle period: a publish wakes the
    sync task (at most once per staleness / 4), which writes it and reads the others'."""
    client = connect(redis_server.url, connect_timeout=2.0, socket_timeout=2.0)
    staleness = 4.0
    busy = RedisSharedLoad(client, key_prefix=key_prefix, lease=30.0, staleness=staleness)
    reader = RedisSharedLoad(client, key_prefix=key_prefix, lease=30.0, staleness=staleness)
    try:
        await busy.start()
        await asyncio.sleep(0)  # its first sync starts now; the next is staleness away
        started = time.monotonic()
        busy.publish("pod-a", EndpointLoad(1, 10))
        while reader.others() != {"pod-a": EndpointLoad(1, 10)}:
            assert time.monotonic() - started < staleness / 2, "the booking was not written"
            await reader.sync_once()
            await asyncio.sleep(0.02)
        # And a change here reads what the others wrote meanwhile.
        reader.publish("pod-b", EndpointLoad(2, 20))
        await reader.sync_once()
        started = time.monotonic()
        busy.publish("pod-a", EndpointLoad(2, 10))
        await until(
            lambda: busy.others() == {"pod-b": EndpointLoad(2, 20)},
            "the busy process read the others'",
            within=staleness / 2,
        )
    finally:
        await busy.stop()
        await reader.stop()
        await client.aclose()


def _script_calls(server: RedisServer) -> int:
    """Scripts the server has run so far (``EVALSHA`` and ``EVAL``)."""
    calls = 0
    for line in server.cli("INFO", "commandstats").splitlines():
        if line.startswith(("cmdstat_evalsha:", "cmdstat_eval:")):
            calls += int(line.split("calls=")[1].split(",")[0])
    return calls


@pytest.mark.timed
async def test_an_idle_process_syncs_once_per_idle_period_and_wakes_on_a_change(
    redis_server: RedisServer, key_prefix: str
) -> None:
    """With nothing booked and nothing asked for, the load's round trips slow from one per
    staleness (50/s here) to one per idle period (a quarter of the lease, 0.5 s here); the
    next booking is written at once, not an idle period later."""
    client = connect(redis_server.url, connect_timeout=2.0, socket_timeout=2.0)
    idle = RedisSharedLoad(client, key_prefix=key_prefix, lease=2.0, staleness=0.02, idle_after=0.2)
    reader = RedisSharedLoad(client, key_prefix=key_prefix, lease=2.0)
    try:
        await idle.start()
        await until(lambda: idle.idle, "the process became idle", within=2.0)
        before = _script_calls(redis_server)
        await asyncio.sleep(1.0)
        # 2 at an idle period of 0.5 s (3 with a round trip at each edge); 50 at staleness
        assert _script_calls(redis_server) - before <= 3
        started = time.monotonic()
        idle.publish("pod-a", EndpointLoad(1, 10))
        assert not idle.idle
        while reader.others() != {"pod-a": EndpointLoad(1, 10)}:
            assert time.monotonic() - started < 0.25, "the booking waited for the idle period"
            await reader.sync_once()
            await asyncio.sleep(0.01)
    finally:
        await idle.stop()
        await reader.stop()
        await client.aclose()


async def test_a_slow_redis_does_not_stretch_the_time_flow_control_counts_dispatches_unseen(
    redis_scratch_server: RedisServer, key_prefix: str
) -> None:
    """Flow control counts this process's recent dispatches again for every other process
    for ``visible_after``, which grows with the load sync's round trips; a Redis that takes
    0.4 s to answer must not make that 0.8 s (four staleness at most)."""
    server = redis_scratch_server
    client = connect(server.url, connect_timeout=2.0, socket_timeout=2.0)
    load = RedisSharedLoad(client, key_prefix=key_prefix, lease=10.0, staleness=0.02)
    try:
        await load.sync_once()
        assert 0.02 <= load.visible_after() <= 0.08
        server.freeze()
        try:
            sync = asyncio.create_task(load.sync_once())
            await asyncio.sleep(0.4)  # the slow round trip's length (the input, not a wait)
        finally:
            server.thaw()
        await asyncio.wait_for(sync, 5.0)
        assert load.visible_after() == pytest.approx(0.08)
    finally:
        await load.stop()
        await client.aclose()
