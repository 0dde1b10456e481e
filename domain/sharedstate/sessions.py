"""``InMemorySessionStore``: the one-process ``SessionStore`` (``ports.sessions``)."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

__all__ = ["DEFAULT_MAX_SESSIONS", "InMemorySessionStore"]

#: Bindings kept at most; past it the least recently bound is dropped, so clients sending
#: endless new session ids cannot grow the process without bound.
DEFAULT_MAX_SESSIONS = 1_000_000


class InMemorySessionStore:
    """Bindings in a dict ordered by last write; expired entries are dropped when read and,
    from the oldest, on every write (amortised O(1))."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
    ) -> None:
        self._clock = clock
        self._max = max_sessions
        #: key -> (endpoint, expiry), oldest write first.
        self._bindings: OrderedDict[str, tuple[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._bindings)

    async def get(self, key: str) -> str | None:
        entry = self._bindings.get(key)
        if entry is None:
            return None
        endpoint, expiry = entry
        if expiry <= self._clock():
            del self._bindings[key]
            return None
        return endpoint

    async def put(self, key: str, endpoint: str, ttl: float) -> None:
        now = self._clock()
        bindings = self._bindings
        bindings[key] = (endpoint, now + ttl)
        bindings.move_to_end(key)
        while bindings:
            oldest_key, (_, expiry) = next(iter(bindings.items()))
            if expiry > now and len(bindings) <= self._max:
                break
            del bindings[oldest_key]
