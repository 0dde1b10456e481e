"""Shared prefix-cache state: which endpoints were recently sent which prompt blocks."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Protocol, runtime_checkable

__all__ = [
    "CLAIM_HALF_LIFE",
    "BlockHasher",
    "ClaimingPrefixIndex",
    "PrefixIndex",
    "StagedClaimingPrefixIndex",
    "TailAddingPrefixIndex",
]

#: Seconds in which the count of new chains recently claimed for an endpoint halves.
CLAIM_HALF_LIFE = 10.0


class BlockHasher(Protocol):
    """Chained 64-bit hashes of a prompt's blocks. Pure, thread-safe, deterministic.

    ``chain(data, block_size, seed, max_blocks)``: ``data`` is cut to
    ``max_blocks * block_size`` bytes; ``h0 = H(seed)``; for each block (the trailing
    partial block included) ``h_i = H(block || little-endian uint64(h_{i-1}))``. Returns
    ``[h_1, ...]``; empty when ``data`` is shorter than one block.
    """

    def chain(self, data: bytes, block_size: int, seed: bytes, max_blocks: int) -> list[int]: ...


class PrefixIndex(Protocol):
    """Maps block hashes to the endpoints (by name) that were sent them.

    Each endpoint keeps at most ``capacity`` hashes, least recently used evicted first.
    Implementations: in-memory (per process) and shared (several EPP processes, on a
    remote store). Methods may be called concurrently from many request tasks.

    Errors: the in-memory implementation never raises. A remote implementation raises
    ``ports.shared_state.SharedStateError`` when its store fails; the domain wraps it (a
    deadline, the in-memory index as fallback), so what plugins see never raises: ``match``
    then returns what the local index knows and ``add`` still records locally.
    """

    async def match(self, hashes: Sequence[int]) -> Mapping[str, int]:
        """Walk ``hashes`` in order; stop at the first hash no endpoint has; count for
        every endpoint each hash it has. Returns endpoint name → matched blocks."""
        ...

    async def add(self, hashes: Sequence[int], endpoint: str, capacity: int) -> None:
        """Record that ``endpoint`` was sent ``hashes`` (most recent last)."""
        ...

    async def remove_endpoint(self, endpoint: str) -> None: ...

    def size(self) -> int:
        """Number of (hash, endpoint) entries held, for metrics; -1 when unknown."""
        ...


@runtime_checkable
class ClaimingPrefixIndex(PrefixIndex, Protocol):
    """A ``PrefixIndex`` that can place a new chain atomically (several EPP processes
    routing the same new prefix at the same instant agree on one endpoint).

    Errors: as ``PrefixIndex`` (the domain's wrapper never raises).
    """

    async def claim(
        self,
        hashes: Sequence[int],
        endpoint: str,
        capacity: int,
        alternates: Sequence[str] = (),
    ) -> str:
        """If no endpoint holds ``hashes[0]``, record ``hashes`` (as ``add``) for the one
        of ``endpoint`` and ``alternates`` (endpoints the caller rates as good) that the
        fewest new chains were claimed for lately, by every caller of the index (a count
        decaying by half every ``CLAIM_HALF_LIFE`` seconds; ``endpoint`` wins a tie), and
        return it. Otherwise record nothing and return the endpoint matching the most of
        ``hashes`` (as ``match`` counts). One atomic step: of two callers claiming the
        same new chain, one records it and the other is told its endpoint; callers placing
        different new chains at the same instant spread them over equally good endpoints
        rather than each choosing blind. ``hashes`` is non-empty."""
        ...


@runtime_checkable
class StagedClaimingPrefixIndex(ClaimingPrefixIndex, Protocol):
    """A ``ClaimingPrefixIndex`` that can name a claim's owner before it has recorded all
    of the claim (a remote store whose last writes take another round trip).

    Errors: as ``PrefixIndex``.
    """

    async def claim_owner(
        self,
        hashes: Sequence[int],
        endpoint: str,
        capacity: int,
        alternates: Sequence[str] = (),
    ) -> tuple[str, Callable[[], Awaitable[None]] | None]:
        """``claim`` in two steps: the owner, as soon as it is decided (the chain is then
        written for it, when this claim won), and what is left to record (``None``:
        nothing), for the caller to run off its request's path. Until that has run, the
        chain may not yet count against the endpoint's ``capacity``, nor the claim in the
        choices of the next claims. ``claim`` is both steps at once."""
        ...


@runtime_checkable
class TailAddingPrefixIndex(PrefixIndex, Protocol):
    """A ``PrefixIndex`` that can record only the new end of a chain whose start the same
    endpoint was just sent (a remote store then writes a few blocks, not the whole chain).

    Errors: as ``PrefixIndex``.
    """

    async def add_tail(
        self, hashes: Sequence[int], held: int, endpoint: str, capacity: int
    ) -> None:
        """Record ``hashes[held:]`` for ``endpoint`` (most recent last) as part of the chain
        that starts at ``hashes[0]``: what ``add(hashes, ...)`` records when ``endpoint``
        already holds ``hashes[:held]``, except that those keep their earlier recency.
        ``0 <= held < len(hashes)``."""
        ...
