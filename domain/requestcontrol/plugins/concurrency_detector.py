"""``concurrency-detector``: saturation from the EPP's own count of in-flight work.

Reads each candidate's ``InFlightLoad`` attribute (requests or estimated tokens this EPP
has sent and not seen end); it consumes that key, so the config loader creates the
``inflight-load-producer`` when nothing else produces it. A candidate without the
attribute counts as idle.

- ``concurrencyMode`` ``requests`` compares in-flight requests with ``maxConcurrency``;
  ``tokens`` compares in-flight estimated tokens with ``maxTokenConcurrency``.
- ``saturation(candidates)`` = sum of in-flight / (limit * number of candidates); no
  candidates is 1.0 (saturated).
- ``filter`` keeps the candidates whose load is below ``limit * (1 + headroom)``. It does
  not fail open: when every candidate is at its limit the result is empty.
- ``capacity(candidates)`` (``requests`` mode) = ``maxConcurrency`` * number of candidates:
  flow control then gates on the requests it has let go over the pool against it
  (``CapacityDetector``), which counts a request from the moment it leaves the queue,
  before scheduling books it on an endpoint.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from domain.datalayer.attributes import IN_FLIGHT_LOAD, InFlightLoad
from domain.plugins.base import PluginRegistry, TypedName, class_factory
from domain.plugins.hooks import ConsumerPlugin
from domain.scheduling.interfaces import CycleState
from domain.scheduling.types import Candidate, InferenceRequest

__all__ = ["TYPE", "ConcurrencyDetector", "ConcurrencyDetectorParameters", "register"]

TYPE = "concurrency-detector"

MODE_REQUESTS = "requests"
MODE_TOKENS = "tokens"


@dataclass(frozen=True, slots=True, kw_only=True)
class ConcurrencyDetectorParameters:
    """``concurrencyMode`` (``requests`` or ``tokens``), ``maxConcurrency`` (> 0),
    ``maxTokenConcurrency`` (> 0) and ``headroom`` (>= 0)."""

    concurrency_mode: str = MODE_REQUESTS
    max_concurrency: int = 100
    max_token_concurrency: int = 1_000_000
    headroom: float = 0.0

    def __post_init__(self) -> None:
        if self.concurrency_mode not in (MODE_REQUESTS, MODE_TOKENS):
            raise ValueError(
                f"concurrencyMode: must be {MODE_REQUESTS!r} or {MODE_TOKENS!r}, "
                f"got {self.concurrency_mode!r}"
            )
        if not self.max_concurrency > 0:
            raise ValueError(f"maxConcurrency: must be > 0, got {self.max_concurrency}")
        if not self.max_token_concurrency > 0:
            raise ValueError(f"maxTokenConcurrency: must be > 0, got {self.max_token_concurrency}")
        if not self.headroom >= 0:
            raise ValueError(f"headroom: must be >= 0, got {self.headroom}")


class ConcurrencyDetector(ConsumerPlugin):
    """SaturationDetector and Filter over the in-flight load this EPP tracks."""

    def __init__(self, typed_name: TypedName, parameters: ConcurrencyDetectorParameters) -> None:
        self._typed_name = typed_name
        self._tokens = parameters.concurrency_mode == MODE_TOKENS
        limit = parameters.max_token_concurrency if self._tokens else parameters.max_concurrency
        self._limit = float(limit)
        self._filter_limit = self._limit * (1.0 + parameters.headroom)

    @property
    def typed_name(self) -> TypedName:
        return self._typed_name

    def consumes(self) -> Sequence[str]:
        return (IN_FLIGHT_LOAD,)

    def _load(self, candidate: Candidate) -> int:
        load = candidate.attributes.get(IN_FLIGHT_LOAD)
        if not isinstance(load, InFlightLoad):
            return 0
        return load.tokens if self._tokens else load.requests

    # SaturationDetector
    def saturation(self, candidates: Sequence[Candidate]) -> float:
        if not candidates:
            return 1.0
        in_flight = sum(self._load(candidate) for candidate in candidates)
        return in_flight / (self._limit * len(candidates))

    def capacity(self, candidates: Sequence[Candidate]) -> float | None:
        if self._tokens:
            return None
        return self._limit * len(candidates)

    # Filter
    def filter(
        self, cycle: CycleState, request: InferenceRequest, candidates: Sequence[Candidate]
    ) -> Sequence[Candidate]:
        limit = self._filter_limit
        return [candidate for candidate in candidates if self._load(candidate) < limit]


def register(registry: PluginRegistry) -> None:
    registry.register(
        TYPE,
        class_factory(TYPE, ConcurrencyDetector),
        parameters=ConcurrencyDetectorParameters,
        description="saturation from the in-flight requests or tokens; filter without fail-open",
    )
