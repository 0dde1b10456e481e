"""A Redis Cluster moving the slots that hold the EPP's keys while the adapters are in use.

The slot is moved by hand, as ``redis-cli --cluster reshard`` does it (``CLUSTER SETSLOT
IMPORTING``/``MIGRATING``, ``MIGRATE`` in batches, ``SETSLOT NODE``), with the adapters called
between the steps, so that the servers really answer ``ASK`` (a key already migrated, asked
at the old node) and then ``MOVED`` (the slot owned by the new node, asked at the old one).
The routing path must see no ``SharedStateError`` and no degraded state, the data must be
found after the move, and the writes made meanwhile must not stop the migration (a key
created early on the importing node makes ``MIGRATE`` fail with ``BUSYKEY``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator

import pytest
from redis.asyncio.cluster import RedisCluster as RedisCluster_
from redis.crc import key_slot

from adapters.redis import RedisClient, RedisPrefixIndex, RedisSharedLoad, connect
from domain.sharedstate.resilient_index import ResilientPrefixIndex
from ports.metric_catalogue import SHARED_STATE_ERRORS
from ports.shared_state import EndpointLoad
from tests.fakes.observer import RecordingObserver
from tests.support.redis import RedisCluster, RedisServer, redis_available


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisCluster]:
    """A cluster of this module's own: its slots are moved."""
    if not redis_available():
        pytest.fail("redis-server and redis-cli are not on PATH: run `make install`")
    cluster = RedisCluster()
    cluster.start()
    yield cluster
    cluster.close()


class SlotMove:
    """Moves one slot between two masters, step by step, as ``redis-cli`` does."""

    def __init__(self, cluster: RedisCluster, slot: int, target: int | None = None) -> None:
        self.cluster = cluster
        self.slot = slot
        self.source = cluster.nodes[cluster.node_of_slot(slot)]
        index = target if target is not None else (cluster.nodes.index(self.source) + 1) % 3
        self.target = cluster.nodes[index]
        self.source_id = self.source.cli("CLUSTER", "MYID").strip()
        self.target_id = self.target.cli("CLUSTER", "MYID").strip()

    def begin(self) -> None:
        self.target.cli("CLUSTER", "SETSLOT", str(self.slot), "IMPORTING", self.source_id)
        self.source.cli("CLUSTER", "SETSLOT", str(self.slot), "MIGRATING", self.target_id)

    def keys_left(self) -> list[str]:
        out = self.source.cli("CLUSTER", "GETKEYSINSLOT", str(self.slot), "1000")
        return out.split()

    def migrate(self, keys: list[str]) -> None:
        if not keys:
            return
        reply = self.source.cli(
            "MIGRATE", "127.0.0.1", str(self.target.port), "", "0", "5000", "KEYS", *keys
        )
        assert reply.strip() == "OK", f"MIGRATE {keys}: {reply}"

    def finish(self) -> None:
        self.migrate(self.keys_left())
        for node in (self.target, self.source):  # the target first, as redis-cli does
            node.cli("CLUSTER", "SETSLOT", str(self.slot), "NODE", self.target_id)
        for node in self.cluster.nodes:
            if node not in (self.source, self.target):
                node.cli("CLUSTER", "SETSLOT", str(self.slot), "NODE", self.target_id)


def _reply(node: RedisServer, *command: str) -> str:
    """What ``node`` itself answers (redis-cli without -c: redirections are shown)."""
    return node.cli(*command, check=False).strip()


async def _open_connections(client: RedisClient, node: RedisServer, count: int) -> None:
    """Leave ``count`` idle connections to ``node`` in the client's pool (a busy process
    has several), so a redirected call has a choice of connection."""
    assert isinstance(client, RedisCluster_)
    target = client.get_node(host="127.0.0.1", port=node.port)
    assert target is not None
    await asyncio.gather(
        *(client.execute_command("PING", target_nodes=target) for _ in range(count))
    )


def _chain(first: int) -> list[int]:
    """A chain of 8 blocks; each test its own root, so its own slot."""
    return [first + i for i in range(8)]


async def test_prefix_index_through_ask_and_moved(
    cluster: RedisCluster, key_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    client = connect(cluster.url, connect_timeout=2.0, socket_timeout=2.0)
    observer = RecordingObserver()
    remote = RedisPrefixIndex(client, key_prefix=key_prefix)
    index = ResilientPrefixIndex(remote, observer=observer, budget=2.0)
    chain = _chain(0x0A5C_0000_0000_0000)
    await index.start()
    try:
        await remote.add(chain, "pod-a", 100)  # written by "another process"
        root = remote.block_key(chain[0], chain[0])
        blocks = [remote.block_key(chain[0], h) for h in chain]
        move = SlotMove(cluster, key_slot(root.encode()))
        assert sorted(move.keys_left()) == sorted(blocks)

        await _open_connections(client, move.target, 4)
        move.begin()
        # The chain's first key (the one each call declares, so routes by) migrates first:
        # the old node now answers ASK for it, and the calls follow it to the new node,
        # where the rest of the chain is not yet.
        move.migrate([root])
        ask = _reply(move.source, "HGETALL", root)
        assert ask.startswith(f"ASK {move.slot} 127.0.0.1:{move.target.port}"), ask
        assert await index.match(chain) == {"pod-a": 1}  # the part already moved
        # A write meanwhile: the chain is split between the nodes, so Redis answers TRYAGAIN
        # (the client retries for a while) rather than letting it create keys on the new
        # node that the old one still holds. That write is dropped and counted.
        await index.add(chain, "pod-b", 100)
        await index.flush()
        assert observer.total(SHARED_STATE_ERRORS, operation="add") == 1
        move.finish()  # MIGRATE of the rest must not find the keys already there

        # Moved: the old node answers MOVED; the client's slot map is stale and follows it.
        moved = _reply(move.source, "HGETALL", root)
        assert moved.startswith(f"MOVED {move.slot} 127.0.0.1:{move.target.port}"), moved
        assert move.keys_left() == []
        assert await remote.match(chain) == {"pod-a": 8}  # pod-b's write was dropped
        assert await index.match(chain) == {"pod-a": 8, "pod-b": 8}  # pod-b: local
        assert not index.degraded
        await index.add(chain, "pod-c", 100)
        await index.flush()
        assert (await remote.match(chain))["pod-c"] == 8
        assert not index.degraded
    finally:
        await index.stop()
        await client.aclose()


async def test_prefix_index_while_a_chain_is_split_between_nodes(
    cluster: RedisCluster, key_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The chain's first key still on the old node, others moved: the script cannot read
    the moved keys there (Redis refuses a script a key of a migrating slot it no longer
    has). That request routes on local state; the store stays in use; no degraded state."""
    caplog.set_level(logging.INFO)
    client = connect(cluster.url, connect_timeout=2.0, socket_timeout=2.0)
    observer = RecordingObserver()
    remote = RedisPrefixIndex(client, key_prefix=key_prefix)
    index = ResilientPrefixIndex(remote, observer=observer, budget=2.0)
    chain = _chain(0x5B17_0000_0000_0000)
    await index.start()
    try:
        await remote.add(chain, "pod-a", 100)
        root = remote.block_key(chain[0], chain[0])
        blocks = [remote.block_key(chain[0], h) for h in chain]
        move = SlotMove(cluster, key_slot(root.encode()))
        move.begin()
        move.migrate(blocks[4:])
        ask = _reply(move.source, "HGETALL", blocks[5])
        assert ask.startswith(f"ASK {move.slot} "), ask
        for _ in range(5):
            assert await index.match(chain) == {}  # local: this process added nothing
        await index.add(chain, "pod-b", 100)
        await index.flush()
        assert not index.degraded
        assert observer.total(SHARED_STATE_ERRORS, operation="match") == 5
        assert observer.total(SHARED_STATE_ERRORS, operation="add") == 1
        move.finish()
        match = await index.match(chain)
        assert match["pod-a"] == 8
        assert not index.degraded
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) <= 1, warnings  # one line however many requests fell back
    finally:
        await index.stop()
        await client.aclose()


async def test_shared_load_through_a_slot_move(cluster: RedisCluster, key_prefix: str) -> None:
    client = connect(cluster.url, connect_timeout=2.0, socket_timeout=2.0)
    a = RedisSharedLoad(client, key_prefix=key_prefix, lease=10.0)
    b = RedisSharedLoad(client, key_prefix=key_prefix, lease=10.0)
    try:
        a.publish("pod-a", EndpointLoad(3, 30))
        await a.sync_once()
        await b.sync_once()
        assert b.others() == {"pod-a": EndpointLoad(3, 30)}
        live = f"{key_prefix}:load:{{{key_prefix}}}:live"
        move = SlotMove(cluster, key_slot(live.encode()))
        move.begin()
        move.finish()
        moved = _reply(move.source, "ZRANGE", live, "0", "-1")
        assert moved.startswith(f"MOVED {move.slot} "), moved
        a.publish("pod-a", EndpointLoad(4, 40))
        await a.sync_once()
        await b.sync_once()
        assert b.others() == {"pod-a": EndpointLoad(4, 40)}
        assert not a.degraded
        assert not b.degraded
    finally:
        await a.stop()
        await b.stop()
        await client.aclose()
