"""``prefix-cache-affinity-filter``: keep only the endpoints that hold most of the prefix,
until they are saturated.

"Sticky" endpoints are those whose ``PrefixCacheMatchInfo`` ratio is at least
``affinityThreshold``. When some exist, only they pass; when none does, every candidate
passes.

The TTFT gate breaks stickiness when the sticky endpoints are saturated. Each candidate's
time to first token is estimated as ``(inFlightTokens + uncachedPromptTokens) /
peakPrefillThroughput * 1000`` ms: the tokens in flight on it (its ``InFlightLoad``, which
counts uncached tokens and is pool-wide when a shared store is configured) plus the part
of this request's prompt it does not hold cached. When the best sticky endpoint's estimate
exceeds the best non-sticky one's by more than ``maxTTFTPenaltyMs``, every candidate passes
and the scorers after the filter choose. ``maxTTFTPenaltyMs: 0`` turns the gate off (always
stick). When either side has no candidate with an ``InFlightLoad`` the gate has no signal
and every candidate passes.

With probability ``explorationProbability`` the filter passes everything, so cold
endpoints still receive some traffic for popular prefixes (the draw uses the Handle's
random generator, seeded in tests).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from domain.datalayer.attributes import IN_FLIGHT_LOAD, PREFIX_CACHE_MATCH_INFO
from domain.datalayer.attributes import PrefixCacheMatchInfo as _MatchInfo
from domain.plugins.base import Plugin, PluginRegistry, TypedName
from domain.plugins.handle import Handle
from domain.plugins.hooks import ConsumerPlugin
from domain.scheduling.interfaces import CycleState
from domain.scheduling.load import in_flight_tokens, input_tokens, uncached_tokens
from domain.scheduling.types import Candidate, InferenceRequest
from ports.codec import JsonCodec

__all__ = ["TYPE", "PrefixAffinityFilter", "PrefixAffinityFilterParameters", "register"]

TYPE = "prefix-cache-affinity-filter"
PREFILL_THROUGHPUT = "prefillThroughput"
LATENCY_PREDICTOR = "latencyPredictor"


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefixAffinityFilterParameters:
    """``affinityThreshold`` (0.80) and ``explorationProbability`` (0), both in [0, 1];
    ``maxTTFTPenaltyMs`` (18000, >= 0; 0 = always stick); ``peakPrefillThroughput``
    (15928 tokens/s, > 0); ``ttftSource`` (``prefillThroughput``, the only source here)."""

    affinity_threshold: float = 0.80
    exploration_probability: float = 0.0
    # Spelled so that the camelCase config key is exactly ``maxTTFTPenaltyMs``.
    max_TTFT_penalty_ms: float = 18000.0  # noqa: N815
    peak_prefill_throughput: float = 15928.0
    ttft_source: str = PREFILL_THROUGHPUT

    def __post_init__(self) -> None:
        if not 0.0 <= self.affinity_threshold <= 1.0:
            raise ValueError("affinityThreshold: must be within [0, 1]")
        if not 0.0 <= self.exploration_probability <= 1.0:
            raise ValueError("explorationProbability: must be within [0, 1]")
        if not self.max_TTFT_penalty_ms >= 0:
            raise ValueError("maxTTFTPenaltyMs: must be >= 0")
        if not self.peak_prefill_throughput > 0 or self.peak_prefill_throughput == float("inf"):
            raise ValueError("peakPrefillThroughput: must be a finite number > 0")
        if self.ttft_source == LATENCY_PREDICTOR:
            raise ValueError(
                "ttftSource: latencyPredictor needs a latency predictor, which this EPP does "
                "not have; use prefillThroughput"
            )
        if self.ttft_source != PREFILL_THROUGHPUT:
            raise ValueError(f"ttftSource: must be {PREFILL_THROUGHPUT!r}")


class PrefixAffinityFilter(ConsumerPlugin):
    """Keeps the sticky candidates (prefix ratio >= threshold), in order, unless they are
    saturated (the TTFT gate) or the request explores; else all."""

    def __init__(
        self,
        typed_name: TypedName,
        parameters: PrefixAffinityFilterParameters,
        rng: random.Random,
        codec: JsonCodec,
    ) -> None:
        self._typed_name = typed_name
        self.parameters = parameters
        self._rng = rng
        self._codec = codec
        self._threshold = parameters.affinity_threshold
        self._exploration = parameters.exploration_probability
        self._penalty_ms = parameters.max_TTFT_penalty_ms
        self._ms_per_token = 1000.0 / parameters.peak_prefill_throughput

    @property
    def typed_name(self) -> TypedName:
        return self._typed_name

    def consumes(self) -> Sequence[str]:
        return [PREFIX_CACHE_MATCH_INFO, IN_FLIGHT_LOAD]

    def filter(
        self, cycle: CycleState, request: InferenceRequest, candidates: Sequence[Candidate]
    ) -> Sequence[Candidate]:
        if self._exploration > 0.0 and self._rng.random() < self._exploration:
            return candidates
        threshold = self._threshold
        sticky: list[Candidate] = []
        others: list[Candidate] = []
        for c in candidates:
            (sticky if _ratio(c) >= threshold else others).append(c)
        if not sticky:
            return candidates
        if not others or self._penalty_ms <= 0:
            return sticky
        prompt = input_tokens(request, self._codec)
        best_sticky = self._best_ttft_ms(sticky, prompt)
        best_other = self._best_ttft_ms(others, prompt)
        if best_sticky is None or best_other is None:
            return candidates  # no load signal: the gate cannot tell, keep everyone
        if best_sticky - best_other > self._penalty_ms:
            return candidates
        return sticky

    def _best_ttft_ms(self, candidates: Sequence[Candidate], prompt: int) -> float | None:
        best: int | None = None
        for c in candidates:
            flight = in_flight_tokens(c)
            if flight is None:
                continue
            tokens = flight + uncached_tokens(c, prompt)
            if best is None or tokens < best:
                best = tokens
        return None if best is None else best * self._ms_per_token


def _ratio(candidate: Candidate) -> float:
    info = candidate.attributes.get(PREFIX_CACHE_MATCH_INFO)
    if isinstance(info, _MatchInfo) and info.total_blocks > 0:
        return info.match_blocks / info.total_blocks
    return 0.0


def _factory(name: str, parameters: PrefixAffinityFilterParameters, handle: Handle) -> Plugin:
    return PrefixAffinityFilter(TypedName(TYPE, name), parameters, handle.rng, handle.codec)


def register(registry: PluginRegistry) -> None:
    registry.register(
        TYPE,
        _factory,
        parameters=PrefixAffinityFilterParameters,
        description="keeps endpoints holding most of the prompt prefix until they saturate",
    )
