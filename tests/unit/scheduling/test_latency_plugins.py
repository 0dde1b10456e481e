"""``latency-scorer``, ``slo-headroom-tier-filter`` and ``prefix-cache-affinity-filter``'s
``ttftSource: latencyPredictor``: what they keep and prefer, given predictions."""

from __future__ import annotations

import random

import pytest

from domain.datalayer.attributes import (
    LATENCY_PREDICTION_INFO,
    PREFIX_CACHE_MATCH_INFO,
    LatencyPredictionInfo,
    PrefixCacheMatchInfo,
)
from domain.plugins.base import TypedName
from domain.scheduling.plugins.latency_scorer import LatencyScorer, LatencyScorerParameters
from domain.scheduling.plugins.prefix_affinity_filter import (
    PrefixAffinityFilter,
    PrefixAffinityFilterParameters,
)
from domain.scheduling.plugins.slo_headroom_tier_filter import (
    SloHeadroomTierFilter,
    SloHeadroomTierFilterParameters,
)
from domain.scheduling.types import Candidate
from tests.support.scheduling import CODEC, candidate, cycle, inference_request


def predicted(
    name: str,
    ttft: float,
    tpot: float = 0.0,
    *,
    slo_ttft: float = 0.0,
    slo_tpot: float | None = None,
    dispatched: int = 1,
    prefix: float | None = None,
) -> Candidate:
    c = candidate(name, waiting_queue_size=0, kv_cache_usage_percent=0.5)
    tpot_headroom = 0.0 if slo_tpot is None else slo_tpot - tpot
    c.attributes[LATENCY_PREDICTION_INFO] = LatencyPredictionInfo(
        ttft,
        tpot,
        slo_ttft - ttft,
        tpot_headroom,
        ttft < slo_ttft,
        tpot_headroom >= 0,
        dispatched,
        "endpoint",
    )
    if prefix is not None:
        c.attributes[PREFIX_CACHE_MATCH_INFO] = PrefixCacheMatchInfo(int(prefix * 10), 10, 16)
    return c


def scores(candidates: list[Candidate], **parameters: object) -> dict[str, float]:
    scorer = LatencyScorer(TypedName("latency-scorer", "s"), LatencyScorerParameters(**parameters))  # type: ignore[arg-type]
    request = inference_request({"model": "m", "prompt": "hi"})
    values = scorer.score(cycle(request), request, candidates)
    return {c.name: v for c, v in zip(candidates, values, strict=True)}


def test_without_slos_the_lowest_predicted_ttft_scores_highest() -> None:
    got = scores([predicted("a", 100), predicted("b", 300), predicted("c", 500)])
    assert got == {"a": 1.01, "b": 0.51, "c": 0.01}


def test_an_idle_endpoint_is_preferred_when_every_headroom_is_negative() -> None:
    got = scores([predicted("busy", 100), predicted("idle", 400, dispatched=0)])
    assert got["busy"] == 0.0
    assert got["idle"] > 0


def test_with_slos_only_the_endpoints_within_them_score_least_closest_to_the_slo() -> None:
    candidates = [
        predicted("tight", 450, slo_ttft=500),
        predicted("roomy", 100, slo_ttft=500),
        predicted("late", 900, slo_ttft=500),
    ]
    least = scores(candidates)
    assert least["late"] == 0.0
    assert least["tight"] > least["roomy"]
    most = scores(candidates, headroom_selection_strategy="most")
    assert most["roomy"] > most["tight"]


def test_no_prediction_falls_back_to_the_composite_score() -> None:
    free = candidate("free", waiting_queue_size=0, kv_cache_usage_percent=0.0)
    full = candidate("full", waiting_queue_size=10, kv_cache_usage_percent=1.0)
    assert scores([free, full]) == {"free": pytest.approx(0.67), "full": 0.0}


def test_bad_scorer_parameters_name_the_key() -> None:
    with pytest.raises(ValueError, match="headroomSelectionStrategy"):
        LatencyScorerParameters(headroom_selection_strategy="fastest")
    with pytest.raises(ValueError, match="ttftWeight"):
        LatencyScorerParameters(ttft_weight=-1)


def test_the_tier_filter_keeps_the_endpoints_within_the_slo_and_explores_the_others() -> None:
    within = predicted("within", 100, slo_ttft=500)
    late = predicted("late", 900, slo_ttft=500)
    request = inference_request({"model": "m", "prompt": "hi"})
    kept = SloHeadroomTierFilter(
        TypedName("slo-headroom-tier-filter", "t"),
        SloHeadroomTierFilterParameters(),
        random.Random(1),
    )
    runs = [kept.filter(cycle(request), request, [within, late]) for _ in range(1000)]
    negative = sum(1 for r in runs if r == [late])
    assert sum(1 for r in runs if r == [within]) + negative == 1000
    assert 1 <= negative <= 30  # epsilonExploreNeg 0.01
    # no SLO: every headroom negative, everyone passes
    a, b = predicted("a", 100), predicted("b", 900)
    assert list(kept.filter(cycle(request), request, [a, b])) == [a, b]


def test_the_affinity_filter_breaks_stickiness_on_predicted_ttft() -> None:
    parameters = PrefixAffinityFilterParameters(
        affinity_threshold=0.8, ttft_source="latencyPredictor", max_TTFT_penalty_ms=5000
    )
    gate = PrefixAffinityFilter(TypedName("t", "t"), parameters, random.Random(0), CODEC)
    request = inference_request({"model": "m", "prompt": "hi"})
    sticky_fast = predicted("warm", 2000, prefix=1.0)
    cold = predicted("cold", 500, prefix=0.0)
    assert list(gate.filter(cycle(request), request, [sticky_fast, cold])) == [sticky_fast]
    sticky_slow = predicted("warm", 9000, prefix=1.0)
    assert list(gate.filter(cycle(request), request, [sticky_slow, cold])) == [sticky_slow, cold]
    assert "LatencyPredictionInfo" in gate.consumes()
