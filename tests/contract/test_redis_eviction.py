"""A Redis at its ``maxmemory``: with ``allkeys-lru`` it drops the EPP's keys silently, with
``noeviction`` it refuses writes (``OOM``) and still answers reads. Neither may surface as an
error on the routing path: evicted keys mean fewer prefix matches and a load written again,
refused writes are counted and logged once, and reads keep using the store."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator

import pytest
from redis.asyncio import Redis

from adapters.redis import RedisPrefixIndex, RedisSharedLoad, connect
from domain.sharedstate.resilient_index import ResilientPrefixIndex
from ports.metric_catalogue import SHARED_STATE_DROPPED_WRITES, SHARED_STATE_ERRORS
from ports.shared_state import EndpointLoad, SharedStateWriteRefusedError
from tests.contract.test_redis_adapters import CHAIN
from tests.fakes.observer import RecordingObserver
from tests.support.redis import RedisServer, redis_available

#: Small enough to fill in a fraction of a second, large enough for the server's own needs.
MAXMEMORY = 4 * 1024 * 1024


def _server(policy: str) -> Iterator[RedisServer]:
    if not redis_available():
        pytest.fail("redis-server and redis-cli are not on PATH: run `make install`")
    server = RedisServer(extra_args=["--maxmemory-policy", policy])
    server.start()
    yield server
    server.close()


@pytest.fixture(scope="module")
def lru_server() -> Iterator[RedisServer]:
    yield from _server("allkeys-lru")


@pytest.fixture(scope="module")
def noeviction_server() -> Iterator[RedisServer]:
    yield from _server("noeviction")


async def _flood_until_gone(server: RedisServer, keys: list[str]) -> int:
    """Write filler under a ``maxmemory`` until every key in ``keys`` was evicted; the
    number of filler keys it took."""
    server.cli("CONFIG", "SET", "maxmemory", str(MAXMEMORY))
    filler = Redis(host="127.0.0.1", port=server.port)
    written = 0
    try:
        value = b"x" * 16384
        while await filler.exists(*keys):
            pipe = filler.pipeline(transaction=False)
            for _ in range(64):
                pipe.set(f"filler:{uuid.uuid4().hex}", value)
                written += 1
            await pipe.execute()
            assert written < 100_000, "the keys were never evicted"
        return written
    finally:
        await filler.aclose()
        server.cli("CONFIG", "SET", "maxmemory", "0")
        server.cli("FLUSHDB")


async def test_evicted_keys_mean_fewer_matches_and_republished_load(
    lru_server: RedisServer, key_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    client = connect(lru_server.url, connect_timeout=2.0, socket_timeout=2.0)
    observer = RecordingObserver()
    remote = RedisPrefixIndex(client, key_prefix=key_prefix)
    index = ResilientPrefixIndex(remote, observer=observer, budget=2.0)
    a = RedisSharedLoad(client, key_prefix=key_prefix, lease=5.0, observer=observer)
    b = RedisSharedLoad(client, key_prefix=key_prefix, lease=5.0, observer=observer)
    try:
        await remote.add(CHAIN, "pod-a", 100)  # another process's add: not in index.local
        assert await index.match(CHAIN) == {"pod-a": 8}
        # One block of the chain gone (another process's eviction): the walk stops there.
        lru_server.cli("HDEL", remote.chain_key(CHAIN[0]), f"{CHAIN[5]:016x}")
        assert await index.match(CHAIN) == {"pod-a": 5}

        a.publish("pod-a", EndpointLoad(3, 30))
        a.publish("pod-b", EndpointLoad(1, 10))
        await a.sync_once()
        await b.sync_once()
        assert b.others() == {"pod-a": EndpointLoad(3, 30), "pod-b": EndpointLoad(1, 10)}

        load_keys = [f"{key_prefix}:load:{{{key_prefix}}}:p:{a.process_id}"]
        chain = remote.chain_key(CHAIN[0])
        await _flood_until_gone(lru_server, [chain, remote.lru_key("pod-a"), *load_keys])

        # Everything evicted: no match, no error, the store still in use.
        assert await index.match(CHAIN) == {}
        assert not index.degraded
        # b reads nothing of a (a's hash is gone): never a negative or a stale total.
        await b.sync_once()
        assert b.others() == {}
        # a notices its hash lost at its next round trip and writes every total again,
        # though none of them changed.
        await a.sync_once()
        await a.sync_once()
        await b.sync_once()
        assert b.others() == {"pod-a": EndpointLoad(3, 30), "pod-b": EndpointLoad(1, 10)}
        # A finished request releases at once: no load stuck at the evicted value.
        a.publish("pod-a", EndpointLoad(0, 0))
        await a.sync_once()
        await b.sync_once()
        assert b.others() == {"pod-b": EndpointLoad(1, 10)}
        # The index learns again.
        await index.add(CHAIN, "pod-b", 100)
        await index.start()
        await index.flush()
        await index.stop()
        assert await remote.match(CHAIN) == {"pod-b": 8}
        assert observer.total(SHARED_STATE_ERRORS) == 0
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    finally:
        await a.stop()
        await b.stop()
        await client.aclose()


@pytest.fixture
def out_of_memory(noeviction_server: RedisServer) -> Iterator[RedisServer]:
    """The server refuses every write (``maxmemory`` 1 byte) until the test ends."""
    yield noeviction_server
    noeviction_server.cli("CONFIG", "SET", "maxmemory", "0")


def _warnings(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and text in r.getMessage()
    ]


async def test_out_of_memory_refuses_writes_once_and_keeps_reading(
    out_of_memory: RedisServer, key_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    server = out_of_memory
    client = connect(server.url, connect_timeout=2.0, socket_timeout=2.0)
    observer = RecordingObserver()
    remote = RedisPrefixIndex(client, key_prefix=key_prefix)
    index = ResilientPrefixIndex(remote, observer=observer, budget=2.0)
    a = RedisSharedLoad(client, key_prefix=key_prefix, lease=5.0, observer=observer)
    b = RedisSharedLoad(client, key_prefix=key_prefix, lease=5.0, observer=observer)
    await index.start()
    try:
        await remote.add(CHAIN, "pod-a", 100)
        a.publish("pod-a", EndpointLoad(3, 30))
        await a.sync_once()
        server.cli("CONFIG", "SET", "maxmemory", "1")

        with pytest.raises(SharedStateWriteRefusedError, match="out of memory"):
            await remote.add(CHAIN, "pod-b", 100)
        # Writes through the domain: kept, counted, logged once; never degraded.
        for endpoint in ("pod-b", "pod-c", "pod-d"):
            await index.add(CHAIN, endpoint, 100)
            await index.flush()
        assert index.writes_refused
        assert not index.degraded
        assert observer.total(SHARED_STATE_ERRORS, operation="add") == 3
        assert observer.total(SHARED_STATE_DROPPED_WRITES) == 0  # kept to be sent again
        assert len(_warnings(caplog, "refuses writes")) == 1
        # Reads still go to the store: pod-a's entries come from redis, not the local index.
        match = await index.match(CHAIN)
        assert match["pod-a"] == 8

        # The load: its script's first write is one Redis never refuses, so its few bytes
        # still land on a full server, and every replica keeps reading the pool's load.
        for requests in (4, 5):
            a.publish("pod-a", EndpointLoad(requests, 10 * requests))
            await a.sync_once()
            await b.sync_once()
            assert b.others() == {"pod-a": EndpointLoad(requests, 10 * requests)}
        assert not a.writes_refused
        assert not b.writes_refused
        assert observer.total(SHARED_STATE_ERRORS, operation="load_write") == 0
        assert not _warnings(caplog, "shared load")

        server.cli("CONFIG", "SET", "maxmemory", "0")
        await index.add(CHAIN, "pod-e", 100)
        await index.flush()
        assert not index.writes_refused
        # The writes refused while the server was full land once it has room again.
        assert await remote.match(CHAIN) == {f"pod-{x}": 8 for x in "abcde"}
        infos = [r.getMessage() for r in caplog.records if "accepts writes again" in r.getMessage()]
        assert len(infos) == 1, infos
    finally:
        await index.stop()
        await a.stop()
        await b.stop()
        await client.aclose()
