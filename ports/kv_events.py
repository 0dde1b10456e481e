"""KV-cache events from model servers, and the index of cached blocks they feed.

A model server (vLLM, SGLang) publishes what its prefix cache holds as events: a run of
blocks stored, blocks removed, everything cleared. A block is named by the engine's
64-bit block hash, a chain over the tokens (see ``domain.prefixcache.engine_hash``), so
the EPP can compute the same names from a prompt and ask which endpoints hold them.

The event source (``adapters/kvevents``) decodes the wire format and reports, per
endpoint, to a ``KVEventSink``; the domain's ``KVBlockIndex`` is that sink and answers
the routing path's lookups.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVBlockIndex",
    "KVEvent",
    "KVEventSink",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockStored:
    """A run of blocks became cached: ``block_hashes[0]`` follows ``parent_block_hash``."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    """Storage tier (``GPU``, ``CPU``, ...); ``None``: the engine did not say (GPU)."""
    lora_name: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]
    medium: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventSink(Protocol):
    """Receives one endpoint's decoded events. Called on the event loop; never blocks.

    The source keeps the stream's order and reports every break in it: ``lost`` when
    events may be missing (a sequence gap, a lost connection), ``resynced`` once the
    missing events were replayed. An ``AllBlocksCleared`` resyncs by itself.
    """

    def apply(self, endpoint: str, events: Sequence[KVEvent]) -> None: ...

    def lost(self, endpoint: str) -> None:
        """Events of ``endpoint`` may be missing: stop trusting what it is known to hold."""
        ...

    def resynced(self, endpoint: str) -> None:
        """The missing events were replayed: trust ``endpoint`` again."""
        ...

    def forget(self, endpoint: str) -> None:
        """``endpoint`` left the pool: drop everything known about it."""
        ...


class KVBlockIndex(KVEventSink, Protocol):
    """Which endpoints hold which blocks, from their events (and speculative entries).

    Bounded: each endpoint keeps at most a configured number of blocks, least recently
    stored or matched evicted first. Never raises.
    """

    def match(self, hashes: Sequence[int], endpoints: Sequence[str]) -> Mapping[str, int]:
        """Per endpoint among ``endpoints`` that is trusted, the number of leading
        ``hashes`` it holds (stopping at its first miss); endpoints with none are left out."""
        ...

    def size(self) -> int:
        """Number of (block, endpoint) entries held."""
        ...
