"""``token-load-scorer``: prefer endpoints with fewer in-flight tokens from this EPP."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from domain.datalayer.attributes import IN_FLIGHT_LOAD, InFlightLoad
from domain.plugins.base import PluginRegistry, TypedName, class_factory
from domain.plugins.hooks import ConsumerPlugin
from domain.scheduling.interfaces import DISTRIBUTION, CycleState
from domain.scheduling.types import Candidate, InferenceRequest

__all__ = ["TYPE", "TokenLoadScorer", "TokenLoadScorerParameters", "register"]

TYPE = "token-load-scorer"


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenLoadScorerParameters:
    """``queueThresholdTokens``: in-flight tokens at which an endpoint scores 0
    (default 4,194,304: 128 requests * 32K tokens). Must be > 0."""

    queue_threshold_tokens: int = 4_194_304

    def __post_init__(self) -> None:
        value = self.queue_threshold_tokens
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"queueThresholdTokens: must be an integer, got {value!r}")
        if value <= 0:
            raise ValueError(f"queueThresholdTokens: must be > 0, got {value}")


class TokenLoadScorer(ConsumerPlugin):
    """Scores ``1 - min(tokens, threshold) / threshold`` from the ``InFlightLoad``
    attribute; 1.0 for a candidate without one (no known load).

    Consumes the ``InFlightLoad`` data key, so its default producer is created with it.
    """

    __slots__ = ("_threshold", "typed_name")

    category = DISTRIBUTION

    def __init__(self, typed_name: TypedName, parameters: TokenLoadScorerParameters) -> None:
        self.typed_name = typed_name
        self._threshold = parameters.queue_threshold_tokens

    def consumes(self) -> Sequence[str]:
        return [IN_FLIGHT_LOAD]

    def score(
        self, cycle: CycleState, request: InferenceRequest, candidates: Sequence[Candidate]
    ) -> Sequence[float]:
        threshold = self._threshold
        scores: list[float] = []
        for c in candidates:
            load = c.attributes.get(IN_FLIGHT_LOAD)
            if isinstance(load, InFlightLoad):
                tokens = min(max(load.tokens, 0), threshold)
                scores.append(1.0 - tokens / threshold)
            else:
                scores.append(1.0)
        return scores


def register(registry: PluginRegistry) -> None:
    registry.register(
        TYPE,
        class_factory(TYPE, TokenLoadScorer),
        parameters=TokenLoadScorerParameters,
        description="prefers endpoints with fewer in-flight tokens",
    )
