"""``RedisSessionStore``: the ``SessionStore`` port on Redis (a single server or a cluster).

One key per binding, ``P:session:<digest>`` (``P`` the pool's key prefix; the digest is a
128-bit BLAKE2b of the caller's key, so a client's session id never becomes key text and
every key has the same length), holding the endpoint name, with the binding's TTL as the
key's expiry: ``SET key endpoint PX ttl`` binds and restarts it, ``GET`` reads. Keys spread
over a cluster's slots. Any failure (connection, timeout, error reply) raises
``SharedStateError``; the caller routes as if the session were unbound.
"""

from __future__ import annotations

import hashlib

from adapters.redis.connection import RedisClient
from adapters.redis.script import guarded

__all__ = ["RedisSessionStore"]


class RedisSessionStore:
    """Session bindings shared by every EPP process using the same Redis and prefix."""

    def __init__(self, client: RedisClient, *, key_prefix: str) -> None:
        self._client = client
        self._prefix = f"{key_prefix}:session:"

    def _key(self, key: str) -> str:
        return self._prefix + hashlib.blake2b(key.encode(), digest_size=16).hexdigest()

    async def get(self, key: str) -> str | None:
        value = await guarded("session get", self._client.get(self._key(key)))
        if value is None:
            return None
        return value.decode() if isinstance(value, bytes) else str(value)

    async def put(self, key: str, endpoint: str, ttl: float) -> None:
        milliseconds = max(1, int(ttl * 1000))
        await guarded("session set", self._client.set(self._key(key), endpoint, px=milliseconds))
