"""Tests of the in-tree request-control plugins, and the doubles they share."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from domain.datastore.store import Datastore
from domain.plugins.handle import Handle
from domain.requesthandling.jsoncodec import StdlibJsonCodec


class FakeHasher:
    """A ``BlockHasher`` double: these plugins never hash."""

    def chain(self, data: bytes, block_size: int, seed: bytes, max_blocks: int) -> list[int]:
        return []


class FakePrefixIndex:
    """A ``PrefixIndex`` double that holds nothing."""

    async def match(self, hashes: Sequence[int]) -> Mapping[str, int]:
        return {}

    async def add(self, hashes: Sequence[int], endpoint: str, capacity: int) -> None:
        return None

    async def remove_endpoint(self, endpoint: str) -> None:
        return None

    def size(self) -> int:
        return 0


class FakeClock:
    """A clock that moves only when told to."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make_handle(clock: Callable[[], float] | None = None) -> Handle:
    """A Handle with the stdlib codec, a fresh empty datastore and the doubles above."""
    handle = Handle(
        codec=StdlibJsonCodec(),
        hasher=FakeHasher(),
        prefix_index=FakePrefixIndex(),
        datastore=Datastore(),
    )
    if clock is not None:
        handle.clock = clock
    return handle
