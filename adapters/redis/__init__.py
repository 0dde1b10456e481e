"""Shared state on Redis: the ``PrefixIndex`` port (see
docs/shared-state.md), and clients made from a ``redis://``-style URL."""

from adapters.redis.connection import RedisClient, RedisUrl, connect, parse_redis_url
from adapters.redis.prefix_index import RedisPrefixIndex

__all__ = [
    "RedisClient",
    "RedisPrefixIndex",
    "RedisUrl",
    "connect",
    "parse_redis_url",
]
