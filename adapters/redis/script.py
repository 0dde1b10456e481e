"""Lua scripts sent by SHA (``EVALSHA``), re-sent whole (``EVAL``) after ``NOSCRIPT``, and
the one place where a Redis failure becomes ``SharedStateError``."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Awaitable, Sequence
from typing import TypeVar

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import (
    ClusterDownError,
    ClusterError,
    MasterDownError,
    NoScriptError,
    OutOfMemoryError,
    ReadOnlyError,
    ResponseError,
)
from redis.exceptions import (
    ConnectionError as RedisConnectionError,
)

from adapters.redis.connection import PipelinedRedis
from ports.shared_state import SharedStateError, SharedStateReplyError, SharedStateWriteRefusedError

__all__ = ["LuaScript", "drop_idle_connections", "guarded"]

T = TypeVar("T")

Arg = str | bytes | int | float


class LuaScript:
    """One script: ``run`` sends ``EVALSHA``; on ``NOSCRIPT`` (a restarted server, ``SCRIPT
    FLUSH``) it sends ``EVAL``, which also caches the script again. One round trip either
    way, two after a flush. A single server's client from ``connect`` sends them on its
    ``ScriptChannel`` (one pipelined connection); a cluster's, through redis-py."""

    __slots__ = ("name", "sha", "source")

    def __init__(self, name: str, source: str) -> None:
        self.name = name
        self.source = source
        self.sha = hashlib.sha1(source.encode(), usedforsecurity=False).hexdigest()

    async def run(
        self, client: Redis | RedisCluster, keys: Sequence[str], args: Sequence[Arg]
    ) -> object:
        try:
            if isinstance(client, PipelinedRedis):
                channel = client.script_channel
                try:
                    return await channel.call(("EVALSHA", self.sha, len(keys), *keys, *args))
                except NoScriptError:
                    return await channel.call(("EVAL", self.source, len(keys), *keys, *args))
            try:
                return await client.evalsha(self.sha, len(keys), *keys, *args)
            except NoScriptError:
                return await client.eval(self.source, len(keys), *keys, *args)
        except RedisConnectionError:
            await drop_idle_connections(client)
            raise


async def drop_idle_connections(client: Redis | RedisCluster) -> None:
    """After a lost connection, close the pool's idle ones too: a server that died took
    them all, and each would otherwise fail once more after the server is back (one more
    failure, one more degraded/healthy flap and its log lines per idle connection). The
    cluster client does this per node itself."""
    if isinstance(client, Redis):
        with contextlib.suppress(Exception):
            await client.connection_pool.disconnect(inuse_connections=False)


async def guarded(operation: str, call: Awaitable[T]) -> T:
    """Await ``call``; any failure is raised as ``SharedStateError`` naming ``operation``:
    ``SharedStateWriteRefusedError`` for an ``OOM`` reply (the server refuses writes only),
    ``SharedStateReplyError`` for another error reply about this call (the server is up),
    plain ``SharedStateError`` for the rest (connection, timeout, a cluster or server state
    that makes every call fail: ``CLUSTERDOWN``, ``MASTERDOWN``, ``READONLY``). ``TRYAGAIN``
    (a multi-key call while its slot migrates) and a cluster client that gave up following
    redirections ("TTL exhausted") are about this call only: ``SharedStateReplyError``."""
    try:
        return await call
    except SharedStateError:
        raise
    except OutOfMemoryError as error:
        raise SharedStateWriteRefusedError(
            f"redis {operation} refused: out of memory: {error}"
        ) from error
    except _SERVER_STATE as error:
        raise SharedStateError(_describe(operation, error)) from error
    except ResponseError as error:
        raise SharedStateReplyError(_describe(operation, error)) from error
    except ClusterError as error:
        if "TTL exhausted" in str(error):
            # The cluster client followed MOVED/ASK/TRYAGAIN replies until it gave up:
            # this call's slot is migrating (its keys are split between two nodes).
            raise SharedStateReplyError(_describe(operation, error)) from error
        raise SharedStateError(_describe(operation, error)) from error
    except Exception as error:
        raise SharedStateError(_describe(operation, error)) from error


_SERVER_STATE = (ClusterDownError, MasterDownError, ReadOnlyError)


def _describe(operation: str, error: BaseException) -> str:
    detail = str(error) or "no detail"
    return f"redis {operation} failed: {type(error).__name__}: {detail}"
