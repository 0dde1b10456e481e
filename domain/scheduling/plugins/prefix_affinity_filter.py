"""``prefix-cache-affinity-filter``: keep only the endpoints that hold most of the prefix.

"Sticky" endpoints are those whose ``PrefixCacheMatchInfo`` ratio is at least
``affinityThreshold``. When some exist, only they pass; when none does, every candidate
passes. With probability ``explorationProbability`` the filter passes everything, so new
endpoints still get traffic for popular prefixes.

``maxTTFTPenaltyMs`` is accepted for configuration compatibility: it breaks stickiness when
the best sticky endpoint's predicted time-to-first-token exceeds the best other one's by
more than that. This EPP has no latency predictions yet, so it currently has no effect.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from domain.datalayer.attributes import PREFIX_CACHE_MATCH_INFO, PrefixCacheMatchInfo
from domain.plugins.base import Plugin, PluginRegistry, TypedName
from domain.plugins.handle import Handle
from domain.plugins.hooks import ConsumerPlugin
from domain.scheduling.interfaces import CycleState
from domain.scheduling.types import Candidate, InferenceRequest

__all__ = ["TYPE", "PrefixAffinityFilter", "PrefixAffinityFilterParameters", "register"]

TYPE = "prefix-cache-affinity-filter"


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefixAffinityFilterParameters:
    """``affinityThreshold`` (0.80), ``explorationProbability`` (0.01), both in [0, 1];
    ``maxTTFTPenaltyMs`` (5000, >= 0; no effect until latency predictions exist)."""

    affinity_threshold: float = 0.80
    exploration_probability: float = 0.01
    # Spelled so that the camelCase config key is exactly ``maxTTFTPenaltyMs``.
    max_TTFT_penalty_ms: float = 5000.0  # noqa: N815

    def __post_init__(self) -> None:
        if not 0.0 <= self.affinity_threshold <= 1.0:
            raise ValueError("affinityThreshold: must be within [0, 1]")
        if not 0.0 <= self.exploration_probability <= 1.0:
            raise ValueError("explorationProbability: must be within [0, 1]")
        if self.max_TTFT_penalty_ms < 0:
            raise ValueError("maxTTFTPenaltyMs: must be >= 0")


class PrefixAffinityFilter(ConsumerPlugin):
    """Keeps the sticky candidates (prefix ratio ≥ threshold), in order; else all."""

    def __init__(
        self, typed_name: TypedName, parameters: PrefixAffinityFilterParameters, rng: random.Random
    ) -> None:
        self._typed_name = typed_name
        self.parameters = parameters
        self._rng = rng
        self._threshold = parameters.affinity_threshold
        self._exploration = parameters.exploration_probability

    @property
    def typed_name(self) -> TypedName:
        return self._typed_name

    def consumes(self) -> Sequence[str]:
        return [PREFIX_CACHE_MATCH_INFO]

    def filter(
        self, cycle: CycleState, request: InferenceRequest, candidates: Sequence[Candidate]
    ) -> Sequence[Candidate]:
        if self._exploration > 0.0 and self._rng.random() < self._exploration:
            return candidates
        threshold = self._threshold
        sticky = [c for c in candidates if _ratio(c) >= threshold]
        return sticky if sticky else candidates


def _ratio(candidate: Candidate) -> float:
    info = candidate.attributes.get(PREFIX_CACHE_MATCH_INFO)
    if isinstance(info, PrefixCacheMatchInfo) and info.total_blocks > 0:
        return info.match_blocks / info.total_blocks
    return 0.0


def _factory(name: str, parameters: PrefixAffinityFilterParameters, handle: Handle) -> Plugin:
    return PrefixAffinityFilter(TypedName(TYPE, name), parameters, handle.rng)


def register(registry: PluginRegistry) -> None:
    registry.register(
        TYPE,
        _factory,
        parameters=PrefixAffinityFilterParameters,
        description="keeps endpoints holding most of the request's prompt prefix",
    )
