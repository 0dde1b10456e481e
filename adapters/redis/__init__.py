"""Shared state on Redis: the ``PrefixIndex``, ``SharedLoad``, ``SessionStore`` and
``KVBlockStore`` ports (see docs/shared-state.md), and clients made from a
``redis://``-style URL."""

from adapters.redis.connection import RedisClient, RedisUrl, connect, parse_redis_url
from adapters.redis.kv_blocks import RedisKVBlockStore
from adapters.redis.prefix_index import RedisPrefixIndex
from adapters.redis.sessions import RedisSessionStore
from adapters.redis.shared_load import RedisSharedLoad

__all__ = [
    "RedisClient",
    "RedisKVBlockStore",
    "RedisPrefixIndex",
    "RedisSessionStore",
    "RedisSharedLoad",
    "RedisUrl",
    "connect",
    "parse_redis_url",
]
