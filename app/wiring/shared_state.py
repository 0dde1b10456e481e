"""The shared state's providers (docs/shared-state.md): in process, or on Redis with
``--redis-url``, one client for the process and one degraded gauge for all of it."""

from __future__ import annotations

import functools

from adapters.redis import (
    RedisClient,
    RedisKVBlockStore,
    RedisPrefixIndex,
    RedisSessionStore,
    RedisSharedLoad,
    connect,
)
from app.settings import Settings
from domain.prefixcache.index import InMemoryPrefixIndex
from domain.sharedstate.degraded import DegradedGauge
from domain.sharedstate.load import LocalSharedLoad
from domain.sharedstate.resilient_index import ResilientPrefixIndex
from domain.sharedstate.sessions import InMemorySessionStore
from ports.kv_events import KVBlockStore
from ports.observer import Observer
from ports.prefix_index import PrefixIndex
from ports.sessions import SessionStore
from ports.shared_state import SharedLoad

__all__ = ["kv_block_store", "prefix_index", "redis_client", "sessions", "shared_load"]


def redis_client(settings: Settings) -> RedisClient | None:
    """The one Redis client of the process with ``--redis-url``, else None. It connects
    lazily: a Redis that is down at start-up only degrades the shared state."""
    return connect(settings.redis_url) if settings.redis_url else None


def prefix_index(
    settings: Settings, client: RedisClient | None, observer: Observer, degraded: DegradedGauge
) -> PrefixIndex:
    if client is None:
        return InMemoryPrefixIndex()
    remote = RedisPrefixIndex(
        client, key_prefix=settings.shared_key_prefix(), ttl=settings.redis_prefix_ttl
    )
    return ResilientPrefixIndex(
        remote,
        InMemoryPrefixIndex(),
        observer=observer,
        degraded_gauge=degraded,
        budget=settings.redis_deadline,
        claim_budget=settings.redis_claim_deadline,
        # The first requests find open connections (a burst of new prefixes needs a match, a
        # load refresh and a claim each) and a loaded match script.
        warm_connections=16,
    )


def shared_load(
    settings: Settings, client: RedisClient | None, observer: Observer, degraded: DegradedGauge
) -> SharedLoad:
    if client is None:
        return LocalSharedLoad()
    return RedisSharedLoad(
        client,
        key_prefix=settings.shared_key_prefix(),
        lease=settings.redis_lease,
        staleness=settings.redis_load_staleness,
        refresh_budget=settings.redis_deadline,
        observer=observer,
        on_degraded=functools.partial(degraded.set, "shared-load"),
    )


def kv_block_store(settings: Settings, client: RedisClient | None) -> KVBlockStore | None:
    """The KV-block index's shared copy on Redis with ``--redis-url``, else none."""
    if client is None:
        return None
    return RedisKVBlockStore(
        client, key_prefix=settings.shared_key_prefix(), ttl=settings.redis_prefix_ttl
    )


def sessions(settings: Settings, client: RedisClient | None) -> SessionStore:
    if client is None:
        return InMemorySessionStore()
    return RedisSessionStore(client, key_prefix=settings.shared_key_prefix())
