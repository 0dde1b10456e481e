"""KV-cache events from model servers, and the index of cached blocks they feed.

A model server (vLLM, SGLang) publishes what its prefix cache holds as events: a run of
blocks stored, blocks removed, everything cleared. A block is named by the engine's
64-bit block hash, a chain over the tokens (see ``domain.prefixcache.engine_hash``), so
the EPP can compute the same names from a prompt and ask which endpoints hold them.

Several EPP processes of one pool share the index through a ``KVBlockStore`` (in memory,
or on Redis with ``--redis-url``): every process subscribes to every endpoint and keeps
its own copy for the routing path, one process per endpoint (the holder of its writer
lease) writes that endpoint's events to the store, and a process that starts loads the
store's copy, so it routes warm before the servers publish again.

The event source (``adapters/kvevents``) decodes the wire format and reports, per
endpoint, to a ``KVEventSink``; the domain's ``KVBlockIndex`` is that sink and answers
the routing path's lookups.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from ports.endpoints import EndpointEvent, EndpointInfo

__all__ = [
    "DATA_PARALLEL_RANK_HEADER",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "Digest",
    "KVBlockIndex",
    "KVBlockStore",
    "KVEvent",
    "KVEventFeed",
    "KVEventSink",
    "StoredBlock",
    "rank_key",
]

#: The request header that pins a request to one engine (data-parallel rank) of a model
#: server that runs several behind one port (vLLM's internal load balancing).
DATA_PARALLEL_RANK_HEADER = "x-data-parallel-rank"


def rank_key(endpoint: str, rank: int) -> str:
    """The index's name for engine ``rank`` of ``endpoint`` when one endpoint serves several
    data-parallel engines, each with its own KV cache and its own event stream."""
    return f"{endpoint}@dp{rank}"


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockStored:
    """A run of blocks became cached: ``block_hashes[0]`` follows ``parent_block_hash``.
    (The engine's event also carries the blocks' token ids; the index is keyed by the
    hashes, so they are not kept: a 16 MB event of token ids would be 16 M objects.)"""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
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


class Digest(Protocol):
    """A hash function over bytes, as the engine's block hashes use one (XXH3-128 for
    vLLM's ``xxhash`` algorithms: its 16-byte digest). Pure; thread-safe."""

    def __call__(self, data: bytes, /) -> bytes: ...


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


class KVEventFeed(Protocol):
    """The model servers' KV-event streams, one subscription per endpoint (per engine with
    data parallelism), feeding a sink. ``add`` is idempotent for an endpoint at the same
    address; before the event loop runs it only remembers the endpoint, and
    ``start_pending`` (on the loop) subscribes to those remembered."""

    def add(self, info: EndpointInfo) -> None: ...

    def on_endpoint_event(self, event: EndpointEvent, _endpoint: object = None) -> None:
        """A datastore listener: subscribe to an added endpoint, drop a deleted one."""
        ...

    def keys(self, endpoint: str) -> list[str]:
        """The sink's names of ``endpoint``'s engines (itself, or one per rank)."""
        ...

    def start_pending(self) -> None: ...

    async def close(self) -> None:
        """End every subscription."""
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


#: One block of a ``KVBlockStore``'s copy: its hash and the tiers (media) holding it.
StoredBlock = tuple[int, tuple[str, ...]]


class KVBlockStore(Protocol):
    """The pool's shared copy of the KV-block index: per endpoint, the blocks its events
    say it holds (hash → tiers), oldest stored first, at most ``cap`` per endpoint (past
    it the oldest are dropped, as ``KVBlockIndex`` does).

    Dedup: every EPP process receives every endpoint's events; only the holder of an
    endpoint's writer lease (``claim``) writes them, so each event is written once and in
    the stream's order. Async; a remote implementation raises
    ``ports.shared_state.SharedStateError`` when its store fails (the domain never lets that
    reach a request: the routing path reads the process's own copy). Called from the
    event loop only.
    """

    async def claim(self, endpoint: str, owner: str, lease: float) -> bool | None:
        """Take or renew ``endpoint``'s writer lease for ``owner`` for ``lease`` seconds.
        ``True``: newly taken, or the store lost the endpoint's copy (the holder must
        ``replace`` it from its own); ``False``: renewed, the copy is there; ``None``:
        another owner holds it."""
        ...

    async def apply(self, endpoint: str, events: Sequence[KVEvent], cap: int) -> None:
        """Apply one batch of ``endpoint``'s events in order (as ``KVEventSink.apply``
        does), then keep at most ``cap`` blocks."""
        ...

    async def replace(self, endpoint: str, blocks: Sequence[StoredBlock], cap: int) -> None:
        """``endpoint``'s copy becomes ``blocks`` (oldest first), at most ``cap`` kept."""
        ...

    async def blocks(self, endpoint: str, limit: int) -> list[StoredBlock]:
        """``endpoint``'s newest ``limit`` blocks, oldest first (empty when unknown)."""
        ...

    async def forget(self, endpoint: str) -> None:
        """``endpoint`` left the pool: drop its copy and its lease."""
        ...

    async def release(self, endpoint: str, owner: str, lease: float) -> None:
        """``owner`` stops writing ``endpoint`` (its process stops): its lease ends now, so
        the next ``claim`` of another owner takes it (and rewrites the copy). The copy stays
        ``current`` for ``lease`` seconds more, long enough for a successor to claim it. A
        lease ``owner`` does not hold is left alone."""
        ...

    async def current(self, endpoint: str) -> bool:
        """Whether ``endpoint``'s copy is kept up to date: a writer holds its lease, or
        released it less than a lease ago. A copy whose writer died and whose lease lapsed
        misses the events since; a starting process does not load it."""
        ...
