"""``latency-scorer``: prefer endpoints by predicted latency, or by SLO headroom when the
request has SLOs (the llm-d router's type, parameters and scoring).

Reads every candidate's ``LatencyPredictionInfo`` (``predicted-latency-producer``). A
headroom is the SLO minus the prediction (without an SLO, 0 minus it: always negative).

- Candidates with both headrooms >= 0 form the positive group, the others the negative one.
  When any is positive, only the positive ones are scored (the negative score 0).
- All negative: when some have nothing in flight (``dispatched_requests`` 0), only those are
  scored; else only the least bad bucket: TPOT alone negative, then TTFT alone, then both.
- Scoring a group: each headroom's absolute value is normalised to [0, 1] over the group
  (0.5 for all when they are equal) and blended, ``ttftWeight`` and ``tpotWeight`` normalised
  to sum 1 (a dimension whose values are all equal gets weight 0 when the other varies).
  ``headroomSelectionStrategy`` ``least`` (default) scores ``(1 - blend)`` (the candidate
  closest to its SLO, or with the lowest prediction without SLOs, scores highest), ``most``
  scores ``blend`` (positive headroom only; negative always uses ``least``); a score is
  ``(int(value * 100) + 1) / 100``.
- No candidate has a prediction: the composite fallback, ``compositeKVWeight`` x free KV
  cache + ``compositeQueueWeight`` x relative queue (``(maxQ - q) / maxQ``, 1 when no queue)
  + ``compositePrefixWeight`` x prefix match ratio, weights normalised (all 0: KV only),
  rounded to hundredths.

``latencyPredictionInfoProducerName`` and ``prefixMatchInfoProducerName`` are accepted (this
EPP has one producer of each key).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from domain.datalayer.attributes import (
    LATENCY_PREDICTION_INFO,
    PREFIX_CACHE_MATCH_INFO,
    LatencyPredictionInfo,
    PrefixCacheMatchInfo,
)
from domain.plugins.base import Plugin, PluginRegistry, TypedName
from domain.plugins.handle import Handle
from domain.plugins.hooks import ConsumerPlugin
from domain.scheduling.interfaces import CycleState
from domain.scheduling.types import Candidate, InferenceRequest

__all__ = ["TYPE", "LatencyScorer", "LatencyScorerParameters", "register"]

TYPE = "latency-scorer"
LEAST = "least"
MOST = "most"
_W_MAX = 100
_EPS = 1e-9


@dataclass(frozen=True, slots=True, kw_only=True)
class LatencyScorerParameters:
    """See the module docstring; every weight is a finite number >= 0."""

    ttft_weight: float = 0.8
    tpot_weight: float = 0.2
    headroom_selection_strategy: str = LEAST
    composite_KV_weight: float = 1.0  # noqa: N815 (the key is ``compositeKVWeight``)
    composite_queue_weight: float = 1.0
    composite_prefix_weight: float = 1.0
    latency_prediction_info_producer_name: str = ""
    prefix_match_info_producer_name: str = ""

    def __post_init__(self) -> None:
        for key, value in (
            ("ttftWeight", self.ttft_weight),
            ("tpotWeight", self.tpot_weight),
            ("compositeKVWeight", self.composite_KV_weight),
            ("compositeQueueWeight", self.composite_queue_weight),
            ("compositePrefixWeight", self.composite_prefix_weight),
        ):
            if not 0.0 <= value < math.inf:
                raise ValueError(f"{key}: must be a finite number >= 0")
        if self.headroom_selection_strategy not in (LEAST, MOST):
            raise ValueError(f"headroomSelectionStrategy: must be {LEAST!r} or {MOST!r}")


class LatencyScorer(ConsumerPlugin):
    """See the module docstring."""

    __slots__ = ("_most", "_parameters", "typed_name")

    category = "Balance"

    def __init__(self, typed_name: TypedName, parameters: LatencyScorerParameters) -> None:
        self.typed_name = typed_name
        self._parameters = parameters
        self._most = parameters.headroom_selection_strategy == MOST

    def consumes(self) -> Sequence[str]:
        return (LATENCY_PREDICTION_INFO, PREFIX_CACHE_MATCH_INFO)

    def score(
        self, cycle: CycleState, request: InferenceRequest, candidates: Sequence[Candidate]
    ) -> Sequence[float]:
        infos: list[LatencyPredictionInfo | None] = []
        any_prediction = False
        for c in candidates:
            info = c.attributes.get(LATENCY_PREDICTION_INFO)
            if info.__class__ is LatencyPredictionInfo:
                infos.append(info)
                any_prediction = True
            else:
                infos.append(None)
        if not any_prediction:
            return self._composite(candidates)
        scores = [0.0] * len(candidates)
        positive = [
            i
            for i, info in enumerate(infos)
            if info is None or (info.ttft_headroom_ms >= 0 and info.tpot_headroom_ms >= 0)
        ]
        if positive:
            self._score_group(positive, infos, scores, force_least=False)
            return scores
        idle = [
            i for i, info in enumerate(infos) if info is not None and info.dispatched_requests == 0
        ]
        if idle:
            self._score_group(idle, infos, scores, force_least=True)
            return scores
        tpot_only: list[int] = []
        ttft_only: list[int] = []
        both: list[int] = []
        for i, info in enumerate(infos):
            assert info is not None
            ttft_negative = info.ttft_headroom_ms < 0
            tpot_negative = info.tpot_headroom_ms < 0
            if ttft_negative and not tpot_negative:
                ttft_only.append(i)
            elif tpot_negative and not ttft_negative:
                tpot_only.append(i)
            else:
                both.append(i)
        for bucket in (tpot_only, ttft_only, both):
            if bucket:
                self._score_group(bucket, infos, scores, force_least=True)
                break
        return scores

    def _score_group(
        self,
        group: Sequence[int],
        infos: Sequence[LatencyPredictionInfo | None],
        scores: list[float],
        *,
        force_least: bool,
    ) -> None:
        p = self._parameters
        total = p.ttft_weight + p.tpot_weight
        alpha, beta = (p.ttft_weight / total, p.tpot_weight / total) if total > 0 else (1.0, 0.0)
        ttft = [abs(infos[i].ttft_headroom_ms) if infos[i] else 0.0 for i in group]  # type: ignore[union-attr]
        tpot = [abs(infos[i].tpot_headroom_ms) if infos[i] else 0.0 for i in group]  # type: ignore[union-attr]
        ttft_low, ttft_range = min(ttft), max(ttft) - min(ttft)
        tpot_low, tpot_range = min(tpot), max(tpot) - min(tpot)
        if ttft_range <= _EPS < tpot_range:
            alpha, beta = 0.0, 1.0
        elif tpot_range <= _EPS < ttft_range:
            alpha, beta = 1.0, 0.0
        most = self._most and not force_least
        for k, i in enumerate(group):
            n_ttft = (ttft[k] - ttft_low) / ttft_range if ttft_range > _EPS else 0.5
            n_tpot = (tpot[k] - tpot_low) / tpot_range if tpot_range > _EPS else 0.5
            blend = alpha * n_ttft + beta * n_tpot
            value = blend if most else 1.0 - blend
            scores[i] = (int(value * _W_MAX) + 1) / _W_MAX

    def _composite(self, candidates: Sequence[Candidate]) -> list[float]:
        p = self._parameters
        w_kv, w_queue, w_prefix = (
            p.composite_KV_weight,
            p.composite_queue_weight,
            p.composite_prefix_weight,
        )
        total = w_kv + w_queue + w_prefix
        if total <= 0:
            w_kv, w_queue, w_prefix, total = 1.0, 0.0, 0.0, 1.0
        w_kv, w_queue, w_prefix = w_kv / total, w_queue / total, w_prefix / total
        queues = [c.metrics.waiting_queue_size if c.metrics is not None else 0 for c in candidates]
        highest = max(queues, default=0)
        scores: list[float] = []
        for c, queue in zip(candidates, queues, strict=True):
            relative = (highest - queue) / highest if highest > 0 else 1.0
            kv_free = 1.0 - (c.metrics.kv_cache_usage_percent if c.metrics is not None else 0.0)
            prefix = 0.0
            info = c.attributes.get(PREFIX_CACHE_MATCH_INFO)
            if isinstance(info, PrefixCacheMatchInfo) and info.total_blocks > 0:
                prefix = info.match_blocks / info.total_blocks
            value = w_kv * kv_free + w_queue * relative + w_prefix * prefix
            scores.append(round(value * _W_MAX) / _W_MAX)
        return scores


def _factory(name: str, parameters: LatencyScorerParameters, handle: Handle) -> Plugin:
    return LatencyScorer(TypedName(TYPE, name), parameters)


def register(registry: PluginRegistry) -> None:
    registry.register(
        TYPE,
        _factory,
        parameters=LatencyScorerParameters,
        description="prefers endpoints by predicted latency, or SLO headroom with SLO headers",
    )
