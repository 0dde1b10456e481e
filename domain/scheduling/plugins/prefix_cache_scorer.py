"""``prefix-cache-scorer`` (Affinity): prefer endpoints believed to hold the prompt prefix.

The score is the fraction of the request's prefix blocks the endpoint holds, read from the
``PrefixCacheMatchInfo`` attribute written by ``approx-prefix-cache-producer`` (or the
precise producer). The scorer also takes the producer's parameters: configuring the scorer
without a producer creates one automatically, built with them.
``prefixMatchInfoProducerName`` names the producer it reads (the llm-d router's); the
loader checks that plugin produces the match.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from domain.datalayer.attributes import PREFIX_CACHE_MATCH_INFO, PrefixCacheMatchInfo
from domain.plugins.base import PluginRegistry, TypedName, class_factory
from domain.plugins.hooks import (
    ConsumerPlugin,
    NamedProducerConsumer,
    ProducerParametersProvider,
)
from domain.prefixcache.parameters import PrefixCacheParameters
from domain.scheduling.interfaces import AFFINITY, CycleState
from domain.scheduling.types import Candidate, InferenceRequest

__all__ = [
    "TYPE",
    "PrefixCacheScorer",
    "PrefixCacheScorerParameters",
    "register",
]

TYPE = "prefix-cache-scorer"


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefixCacheScorerParameters(PrefixCacheParameters):
    """The producer's parameters (the reference's configs put them here), and
    ``prefixMatchInfoProducerName`` ("": whichever plugin produces the match)."""

    prefix_match_info_producer_name: str = ""


class PrefixCacheScorer(ConsumerPlugin, NamedProducerConsumer, ProducerParametersProvider):
    """Score = matched blocks / total blocks; 0 without a match attribute or blocks."""

    def __init__(self, typed_name: TypedName, parameters: PrefixCacheScorerParameters) -> None:
        self._typed_name = typed_name
        self.parameters = parameters

    @property
    def typed_name(self) -> TypedName:
        return self._typed_name

    @property
    def category(self) -> str:
        return AFFINITY

    def consumes(self) -> Sequence[str]:
        return [PREFIX_CACHE_MATCH_INFO]

    def producer_names(self) -> Mapping[str, str]:
        return {PREFIX_CACHE_MATCH_INFO: self.parameters.prefix_match_info_producer_name}

    def producer_parameters(self) -> PrefixCacheParameters:
        """The producer's share of the parameters, for a producer created for this scorer."""
        return PrefixCacheParameters(
            **{
                f.name: getattr(self.parameters, f.name)
                for f in dataclasses.fields(PrefixCacheParameters)
            }
        )

    def score(
        self, cycle: CycleState, request: InferenceRequest, candidates: Sequence[Candidate]
    ) -> Sequence[float]:
        return [_ratio(c.attributes.get(PREFIX_CACHE_MATCH_INFO)) for c in candidates]


def _ratio(info: object) -> float:
    if isinstance(info, PrefixCacheMatchInfo) and info.total_blocks > 0:
        return info.match_blocks / info.total_blocks
    return 0.0


def register(registry: PluginRegistry) -> None:
    registry.register(
        TYPE,
        class_factory(TYPE, PrefixCacheScorer),
        parameters=PrefixCacheScorerParameters,
        description="affinity to endpoints holding the request's prompt prefix",
    )
