"""The prefix index's semantics written plainly, for the property tests of the in-memory
index (tests/unit) and of every ``PrefixIndex`` implementation (tests/contract)."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["PrefixIndexModel"]


class PrefixIndexModel:
    """The index semantics written plainly: a recency list per endpoint."""

    def __init__(self) -> None:
        self.lrus: dict[str, list[int]] = {}

    def add(self, hashes: Sequence[int], endpoint: str, capacity: int) -> None:
        lru = self.lrus.setdefault(endpoint, [])
        for h in hashes:
            if h in lru:
                lru.remove(h)
            lru.append(h)
        del lru[: max(0, len(lru) - capacity)]

    def remove(self, endpoint: str) -> None:
        self.lrus.pop(endpoint, None)

    def match(self, hashes: Sequence[int]) -> dict[str, int]:
        counts: dict[str, int] = {}
        for h in hashes:
            holders = [name for name, lru in self.lrus.items() if h in lru]
            if not holders:
                break
            for name in holders:
                counts[name] = counts.get(name, 0) + 1
        return counts

    def size(self) -> int:
        return sum(len(lru) for lru in self.lrus.values())
