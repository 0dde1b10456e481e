"""``active-request-scorer``: prefer endpoints with fewer requests in flight.

The llm-d guides' decode-bound scorer: an endpoint's load is the number of requests the
pool's EPP processes have sent it and not seen end (the ``InFlightLoad`` attribute of
``inflight-load-producer``), whatever their size. An endpoint with at most
``idleThreshold`` of them scores 1; a busier one scores ``maxBusyScore`` scaled by how far
it is below the busiest candidate, ``maxBusyScore * (busiest - mine) / busiest``, so the
busiest scores 0.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from domain.datalayer.attributes import IN_FLIGHT_LOAD, InFlightLoad
from domain.plugins.base import PluginRegistry, TypedName, class_factory
from domain.plugins.hooks import ConfigNoticePlugin, ConsumerPlugin, NamedProducerConsumer
from domain.scheduling.interfaces import DISTRIBUTION, CycleState
from domain.scheduling.types import Candidate, InferenceRequest

__all__ = ["TYPE", "ActiveRequestScorer", "ActiveRequestScorerParameters", "register"]

TYPE = "active-request-scorer"


@dataclass(frozen=True, slots=True, kw_only=True)
class ActiveRequestScorerParameters:
    """``idleThreshold`` (0, >= 0): in-flight requests up to which an endpoint counts as
    idle and scores 1; ``maxBusyScore`` (1.0, in [0, 1]): the score of the least busy
    endpoint above the threshold, so idle endpoints stand that far ahead of busy ones;
    ``inFlightLoadProducerName`` (checked to name a producer of the in-flight load, of
    which this EPP has one per endpoint);
    ``requestTimeout`` (deprecated by the llm-d router, accepted and ignored)."""

    idle_threshold: int = 0
    max_busy_score: float = 1.0
    in_flight_load_producer_name: str = ""
    request_timeout: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.idle_threshold, bool) or not isinstance(self.idle_threshold, int):
            raise ValueError(f"idleThreshold: must be an integer, got {self.idle_threshold!r}")
        if self.idle_threshold < 0:
            raise ValueError(f"idleThreshold: must be >= 0, got {self.idle_threshold}")
        if not (math.isfinite(self.max_busy_score) and 0.0 <= self.max_busy_score <= 1.0):
            raise ValueError(f"maxBusyScore: must be in [0, 1], got {self.max_busy_score}")


class ActiveRequestScorer(ConsumerPlugin, ConfigNoticePlugin, NamedProducerConsumer):
    """Scores by in-flight request count (see the module docstring); a candidate without
    an ``InFlightLoad`` has none in flight. Consumes the ``InFlightLoad`` data key, so
    ``inflight-load-producer`` is created when no plugin produces it."""

    __slots__ = ("_idle", "_max_busy", "_producer", "_request_timeout", "typed_name")

    category = DISTRIBUTION

    def __init__(self, typed_name: TypedName, parameters: ActiveRequestScorerParameters) -> None:
        self.typed_name = typed_name
        self._idle = parameters.idle_threshold
        self._max_busy = parameters.max_busy_score
        self._request_timeout = parameters.request_timeout
        self._producer = parameters.in_flight_load_producer_name

    def consumes(self) -> Sequence[str]:
        return [IN_FLIGHT_LOAD]

    def producer_names(self) -> Mapping[str, str]:
        return {IN_FLIGHT_LOAD: self._producer}

    def config_notices(self) -> Sequence[str]:
        if not self._request_timeout:
            return ()
        return (
            "requestTimeout: accepted and ignored: a request counts as in flight until it "
            "ends (deprecated in the llm-d router as well)",
        )

    def score(
        self, cycle: CycleState, request: InferenceRequest, candidates: Sequence[Candidate]
    ) -> Sequence[float]:
        counts = [_in_flight(c) for c in candidates]
        busiest = max(counts, default=0)
        idle, max_busy = self._idle, self._max_busy
        return [
            1.0 if count <= idle else max_busy * (busiest - count) / busiest for count in counts
        ]


def _in_flight(candidate: Candidate) -> int:
    load = candidate.attributes.get(IN_FLIGHT_LOAD)
    return load.requests if isinstance(load, InFlightLoad) and load.requests > 0 else 0


def register(registry: PluginRegistry) -> None:
    registry.register(
        TYPE,
        class_factory(TYPE, ActiveRequestScorer),
        parameters=ActiveRequestScorerParameters,
        description="prefers endpoints with fewer requests in flight",
    )
