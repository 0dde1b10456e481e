"""State shared by every EPP process of a pool (replicas and workers): the in-flight load
each process has booked, and the failure a remote store reports.

The prefix index is shared through the ``PrefixIndex`` port (``ports.prefix_index``). A
remote implementation of it (Redis) raises ``SharedStateError`` when the store fails or is
slow; the domain wraps it with a deadline and a local fallback, so routing never waits long
for the store and never fails because of it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

__all__ = [
    "EndpointLoad",
    "SharedLoad",
    "SharedStateError",
    "SharedStateReplyError",
    "SharedStateWriteRefusedError",
]


class SharedStateError(Exception):
    """The shared store failed (connection refused or lost, timeout, an error reply, a reply
    that does not parse). The message says what; the caller degrades to local state."""


class SharedStateReplyError(SharedStateError):
    """The store is up and answered this one call with an error or a reply that does not
    parse (a key of the wrong type, a script refused while a cluster slot migrates). That
    call falls back to local state; the store stays in use for the others."""


class SharedStateWriteRefusedError(SharedStateError):
    """The store answered but refused a write (it is out of memory and evicts nothing).
    Reads still work: the caller keeps reading the store and keeps its new writes local."""


@dataclass(frozen=True, slots=True)
class EndpointLoad:
    """Requests and estimated tokens in flight on one endpoint."""

    requests: int = 0
    tokens: int = 0


class SharedLoad(Protocol):
    """The in-flight load the *other* EPP processes of the pool have booked, per endpoint.

    Every process knows its own bookings exactly and publishes its totals per endpoint
    (``publish``: absolute values, so a write that is lost or repeated does no harm, and
    publishing again after the store restarted empty rebuilds it). ``others`` is the sum
    over the other live processes, read from a local copy that is at most ``staleness``
    seconds old while the store answers; a process that stops publishing (it died) drops
    out of every other process's sum once its lease lapses.

    Both calls are synchronous and cheap (no I/O on the caller's path: writes and refreshes
    happen in the implementation's background task, between ``start`` and ``stop``), and
    never raise: when the store fails, ``publish`` keeps the totals to write later and
    ``others`` returns the last copy, or nothing once that is older than the lease.
    Called from the event loop only.
    """

    @property
    def staleness(self) -> float:
        """The most, in seconds, that ``others`` lags the store while the store answers."""
        ...

    def publish(self, endpoint: str, load: EndpointLoad) -> None:
        """This process's in-flight totals on ``endpoint`` are now ``load``."""
        ...

    def others(self) -> Mapping[str, EndpointLoad]:
        """The other processes' summed totals, by endpoint name (absent means none)."""
        ...

    def remove_endpoint(self, endpoint: str) -> None:
        """``endpoint`` left the pool: forget this process's totals for it."""
        ...

    async def refresh(self) -> None:
        """Bring ``others`` up to date now (and write this process's changes), waiting at
        most the implementation's routing budget; a refresh already under way is joined.
        Never raises: past the budget, or when the store fails, ``others`` stays the copy
        it was. For a routing decision that should see the pool's load as of now."""
        ...

    async def start(self) -> None: ...

    async def stop(self) -> None:
        """Withdraw this process's totals (best effort) and stop the background task."""
        ...
