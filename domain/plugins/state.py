"""Request-scoped state: what a plugin keeps between its extension points for one request.

A plugin that computes something in one extension point and needs it in another (the
prefix producer's block hashes, from PrepareData to PreRequest) stores it here under a
typed ``StateKey``. Entries are namespaced by the plugin's name and, for scheduling
extension points, by the profile run, so two plugins (or two runs of one profile) never
see each other's data. The store is created with the request and cleared when its stream
ends; ``RequestStates.sweep`` drops any store left behind by a leak.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Generic, TypeVar, cast

__all__ = ["RequestState", "RequestStates", "StateKey"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class StateKey(Generic[T]):
    """A typed key. Identity matters: define each key once, at module level."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"StateKey({self.name!r})"


class RequestState:
    """One request's store. Not thread-safe: used from the request's task only."""

    __slots__ = ("_data", "created", "request_id")

    def __init__(self, request_id: str, created: float) -> None:
        self.request_id = request_id
        self.created = created
        self._data: dict[tuple[str, str, StateKey[object]], object] = {}

    def put(self, owner: str, key: StateKey[T], value: T, *, profile: str = "") -> None:
        """Store ``value`` for plugin ``owner`` (its name), optionally per profile run."""
        self._data[(owner, profile, cast("StateKey[object]", key))] = value

    def get(self, owner: str, key: StateKey[T], *, profile: str = "") -> T | None:
        return cast("T | None", self._data.get((owner, profile, cast("StateKey[object]", key))))

    def pop(self, owner: str, key: StateKey[T], *, profile: str = "") -> T | None:
        return cast(
            "T | None", self._data.pop((owner, profile, cast("StateKey[object]", key)), None)
        )

    def __len__(self) -> int:
        return len(self._data)

    def clear(self) -> None:
        self._data.clear()


class RequestStates:
    """Creates request stores and keeps track of the live ones.

    ``release`` is called when the request's stream ends. ``sweep`` (run periodically)
    clears stores older than ``max_age`` seconds that were never released, and logs them.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic, max_age: float = 300.0):
        self._clock = clock
        self._max_age = max_age
        self._live: dict[int, RequestState] = {}

    def create(self, request_id: str) -> RequestState:
        state = RequestState(request_id, self._clock())
        self._live[id(state)] = state
        return state

    def release(self, state: RequestState) -> None:
        state.clear()
        self._live.pop(id(state), None)

    def __len__(self) -> int:
        return len(self._live)

    def sweep(self) -> int:
        cutoff = self._clock() - self._max_age
        stale = [s for s in self._live.values() if s.created < cutoff]
        for state in stale:
            logger.warning("request state of %s leaked; dropped by the sweep", state.request_id)
            self.release(state)
        return len(stale)
