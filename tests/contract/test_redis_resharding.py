"""A Redis Cluster moving the slots that hold the EPP's keys while the adapters are in use.

The slot is moved by hand, as ``redis-cli --cluster reshard`` does it (``CLUSTER SETSLOT
IMPORTING``/``MIGRATING``, ``MIGRATE`` in batches, ``SETSLOT NODE``), with the adapters called
between the steps, so that the servers really answer ``ASK`` (a key already migrated, asked
at the old node) and then ``MOVED`` (the slot owned by the new node, asked at the old one).
The routing path must see no ``SharedStateError`` and no degraded state, the data must be
found after the move, and the writes made meanwhile must not stop the migration (a key
created early on the importing node makes ``MIGRATE`` fail with ``BUSYKEY``). A prefix
chain is one key, so it is never split between the two nodes.
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
        key = remote.chain_key(chain[0])
        move = SlotMove(cluster, key_slot(key.encode()))
        assert move.keys_left() == [key]  # the whole chain is one key

        await _open_connections(client, move.target, 4)
        move.begin()
        # The chain migrates: the old node now answers ASK for it, and the calls follow it
        # to the new node, where all of it is.
        move.migrate([key])
        ask = _reply(move.source, "HGETALL", key)
        assert ask.startswith(f"ASK {move.slot} 127.0.0.1:{move.target.port}"), ask
        assert await index.match(chain) == {"pod-a": 8}
        # A write meanwhile lands on the new node too.
        await index.add(chain, "pod-b", 100)
        await index.flush()
        move.finish()  # nothing left to migrate, nothing in the way

        # Moved: the old node answers MOVED; the client's slot map is stale and follows it.
        moved = _reply(move.source, "HGETALL", key)
        assert moved.startswith(f"MOVED {move.slot} 127.0.0.1:{move.target.port}"), moved
        assert move.keys_left() == []
        assert await remote.match(chain) == {"pod-a": 8, "pod-b": 8}
        assert not index.degraded
        await index.add(chain, "pod-c", 100)
        await index.flush()
        assert (await remote.match(chain))["pod-c"] == 8
        assert observer.total(SHARED_STATE_ERRORS) == 0
        assert not index.degraded
    finally:
        await index.stop()
        await client.aclose()


async def test_prefix_index_while_its_slot_migrates_before_the_chain_moved(
    cluster: RedisCluster, key_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The slot migrating, the chain's key still on the old node: the old node serves the
    calls, a write there is moved with the key, and a new chain of that slot is created on
    the new node (ASK) without stopping the migration."""
    caplog.set_level(logging.INFO)
    client = connect(cluster.url, connect_timeout=2.0, socket_timeout=2.0)
    observer = RecordingObserver()
    remote = RedisPrefixIndex(client, key_prefix=key_prefix)
    index = ResilientPrefixIndex(remote, observer=observer, budget=2.0)
    chain = _chain(0x5B17_0000_0000_0000)
    await index.start()
    try:
        await remote.add(chain, "pod-a", 100)
        key = remote.chain_key(chain[0])
        slot = key_slot(key.encode())
        # Another root whose chain key falls in the same slot, not written yet.
        other = next(
            _chain(first)
            for first in range(chain[0] + 1, chain[0] + 1_000_000)
            if key_slot(remote.chain_key(first).encode()) == slot
        )
        move = SlotMove(cluster, slot)
        move.begin()
        assert await index.match(chain) == {"pod-a": 8}  # from the old node
        await index.add(chain, "pod-b", 100)
        await index.add(other, "pod-c", 100)  # a new key: created on the new node (ASK)
        await index.flush()
        assert move.keys_left() == [key]
        move.finish()  # MIGRATE must not find the key already on the new node
        assert await remote.match(chain) == {"pod-a": 8, "pod-b": 8}
        assert await remote.match(other) == {"pod-c": 8}
        assert observer.total(SHARED_STATE_ERRORS) == 0
        assert not index.degraded
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
