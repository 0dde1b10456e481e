"""The ``SessionStore`` contract, run on every implementation: the in-memory one
(``domain.sharedstate.sessions``), Redis on one server and on a 3-master cluster."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from adapters.redis import RedisClient, RedisSessionStore, connect
from domain.sharedstate.sessions import InMemorySessionStore
from ports.sessions import SessionStore
from ports.shared_state import SharedStateError
from tests.contract.conftest import BACKENDS
from tests.support.redis import RedisServer


class _Stores:
    """Stores on one backend: ``make(prefix)`` is one more EPP process's store."""

    def __init__(self, client: RedisClient | None, prefix: str) -> None:
        self.client = client
        self.prefix = prefix
        self._memory: dict[str, InMemorySessionStore] = {}

    def make(self, prefix: str | None = None) -> SessionStore:
        prefix = prefix or self.prefix
        if self.client is None:  # one process's memory stands for "the same store"
            return self._memory.setdefault(prefix, InMemorySessionStore())
        return RedisSessionStore(self.client, key_prefix=prefix)


@pytest.fixture(params=BACKENDS)
async def stores(request: pytest.FixtureRequest, key_prefix: str) -> AsyncIterator[_Stores]:
    name: str = request.param
    client: RedisClient | None = None
    if name == "redis":
        client = connect(request.getfixturevalue("redis_server").url)
    elif name == "redis-cluster":
        client = connect(request.getfixturevalue("redis_cluster").url)
    yield _Stores(client, key_prefix)
    if client is not None:
        await client.aclose()


async def test_an_unknown_session_is_unbound(stores: _Stores) -> None:
    assert await stores.make().get("nobody") is None


async def test_a_binding_is_seen_by_every_process_and_can_move(stores: _Stores) -> None:
    one, two = stores.make(), stores.make()
    await one.put("filter\x00chat-1", "ns/pod-a", ttl=60)
    assert await two.get("filter\x00chat-1") == "ns/pod-a"
    await two.put("filter\x00chat-1", "ns/pod-b", ttl=60)
    assert await one.get("filter\x00chat-1") == "ns/pod-b"
    assert await one.get("scorer\x00chat-1") is None  # keys are opaque and exact


async def test_keys_of_any_size_and_content_work(stores: _Stores) -> None:
    store = stores.make()
    odd = "s\x00" + "é/{}*?\n" * 80
    await store.put(odd, "/10.0.0.1:8000", ttl=60)
    assert await store.get(odd) == "/10.0.0.1:8000"


async def test_bindings_expire_after_their_ttl_and_a_put_restarts_it(stores: _Stores) -> None:
    store = stores.make()
    await store.put("short", "ns/a", ttl=0.3)
    await store.put("kept", "ns/b", ttl=60)
    deadline = time.monotonic() + 5
    while await store.get("short") is not None:
        assert time.monotonic() < deadline, "the binding never expired"
        await asyncio.sleep(0.02)
    assert await store.get("kept") == "ns/b"


async def test_pools_with_other_prefixes_do_not_share(stores: _Stores) -> None:
    await stores.make().put("chat", "ns/a", ttl=60)
    assert await stores.make(stores.prefix + "-other").get("chat") is None


async def test_a_redis_that_is_down_raises_shared_state_error(
    redis_scratch_server: RedisServer, key_prefix: str
) -> None:
    client = connect(redis_scratch_server.url)
    store = RedisSessionStore(client, key_prefix=key_prefix)
    await store.put("s", "ns/a", ttl=60)
    redis_scratch_server.close()
    with pytest.raises(SharedStateError, match="redis session"):
        await store.get("s")
    with pytest.raises(SharedStateError, match="redis session"):
        await store.put("s", "ns/b", ttl=60)
    await client.aclose()
