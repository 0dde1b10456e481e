"""Server-side session bindings: which endpoint served a client's session last.

Used by the ``session_id`` strategy of ``session-affinity-filter`` / ``-scorer``. The
in-memory implementation is ``domain.sharedstate.sessions.InMemorySessionStore`` (one
process). A shared implementation (Redis: one key per binding with the TTL as its expiry,
``GET`` + ``SET ... EX``) makes every replica see the same bindings.
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["SessionStore"]


class SessionStore(Protocol):
    """Bindings ``key -> endpoint name`` that expire ``ttl`` seconds after their last use.

    ``key`` is opaque (the caller namespaces it). ``get`` refreshes nothing; ``put`` binds
    (or re-binds) and restarts the TTL. A remote implementation may raise
    ``ports.shared_state.SharedStateError``; callers then route as if unbound. Called from
    the event loop only.
    """

    async def get(self, key: str) -> str | None: ...

    async def put(self, key: str, endpoint: str, ttl: float) -> None: ...
