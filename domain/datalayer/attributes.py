"""Attribute keys and values that plugins exchange on candidates."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "IN_FLIGHT_LOAD",
    "PREFIX_CACHE_MATCH_INFO",
    "InFlightLoad",
    "PrefixCacheMatchInfo",
]

#: Data key / attribute name of ``PrefixCacheMatchInfo``.
PREFIX_CACHE_MATCH_INFO = "PrefixCacheMatchInfo"
#: Data key / attribute name of ``InFlightLoad``.
IN_FLIGHT_LOAD = "InFlightLoad"


@dataclass(frozen=True, slots=True)
class PrefixCacheMatchInfo:
    """How many of the request's prefix blocks this endpoint is believed to hold."""

    match_blocks: int
    total_blocks: int
    block_size_tokens: int

    @property
    def ratio(self) -> float:
        return self.match_blocks / self.total_blocks if self.total_blocks > 0 else 0.0


@dataclass(frozen=True, slots=True)
class InFlightLoad:
    """Requests and estimated tokens this EPP has sent to the endpoint and not seen end."""

    requests: int = 0
    tokens: int = 0
