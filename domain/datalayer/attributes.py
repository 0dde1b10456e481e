"""Attribute keys and values that plugins exchange on candidates."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "IN_FLIGHT_LOAD",
    "LATENCY_PREDICTION_INFO",
    "PREFIX_CACHE_MATCH_INFO",
    "InFlightLoad",
    "LatencyPredictionInfo",
    "PrefixCacheMatchInfo",
]

#: Data key / attribute name of ``PrefixCacheMatchInfo``.
PREFIX_CACHE_MATCH_INFO = "PrefixCacheMatchInfo"
#: Data key / attribute name of ``InFlightLoad``.
IN_FLIGHT_LOAD = "InFlightLoad"
#: Data key / attribute name of ``LatencyPredictionInfo``.
LATENCY_PREDICTION_INFO = "LatencyPredictionInfo"


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


@dataclass(frozen=True, slots=True)
class LatencyPredictionInfo:
    """A request's predicted latency on this endpoint (``predicted-latency-producer``).

    ``ttft_ms`` and ``tpot_ms`` are the predictions; a headroom is the request's SLO minus
    the prediction (``0 - prediction`` without an SLO, so always negative then), and a
    ``*_valid`` flag says whether the prediction is within the SLO. A TPOT that does not
    count (the producer's ``streamingMode`` off) has headroom 0 and is valid.
    ``dispatched_requests`` are the requests in flight on the endpoint: those the pool's
    EPP processes sent and have not seen end or, when more, the running and waiting
    requests its server last reported (load no EPP sent, such as another pool's).
    ``source`` is the model level that predicted (``endpoint``, ``pool``, or ``heuristic``
    while too few samples were seen).
    """

    ttft_ms: float
    tpot_ms: float
    ttft_headroom_ms: float
    tpot_headroom_ms: float
    ttft_valid: bool
    tpot_valid: bool
    dispatched_requests: int
    source: str

    @property
    def valid(self) -> bool:
        return self.ttft_valid and self.tpot_valid
