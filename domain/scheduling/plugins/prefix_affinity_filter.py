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
and the scorers after the filter choose. ``maxTokensInFlightPenalty`` is the same gate in
tokens (the llm-d guides' τ, ``peakPrefillThroughput * maxTTFTPenaltyMs / 1000``): it opens
when the best sticky endpoint has more than that many tokens ahead of this prompt beyond the
best non-sticky one's. Either gate opening lets every candidate pass; both at 0 turn the
gate off (always stick). When either side has no candidate with an ``InFlightLoad`` the
gate has no signal and every candidate passes.

With ``ttftSource: latencyPredictor`` the gate compares predicted TTFTs instead (each
candidate's ``LatencyPredictionInfo``, from ``predicted-latency-producer``, which the loader
adds when nothing produces it), as the llm-d router does: a candidate without a prediction
is never the fastest of its side, so stickiness breaks when no sticky candidate has one
and holds when no other candidate has one.

With ``reportedRequestTokens`` N > 0 the prefill-throughput gate also counts what a
server reports: each request its scrape shows waiting or running beyond the requests in
flight there from this EPP adds N tokens ahead (as in ``token-load-scorer``).

With ``excludeSaturated`` the gate applies to every candidate, not only between the two
sides: a candidate whose estimate exceeds the fastest candidate's by more than the penalty
is saturated and does not pass; of the others, the sticky ones pass if there are any,
else all. A request then leaves saturated sticky endpoints for the unsaturated others (the
reference passes every candidate when the gate opens, so that a scorer that prefers the
warm endpoint may keep it there), and a new prefix does not go to a saturated endpoint.
A candidate without an ``InFlightLoad`` is never saturated; one without a prediction is
saturated when another has one (never the fastest, as in the gate).

With ``leaveByReportedQueue`` a request that leaves its sticky endpoints (they exist, but
the gate opened, or with ``excludeSaturated`` none of them passed) goes only to the
endpoints, among those the filter would pass, whose scrape reports the shortest waiting
queue (a candidate without metrics only when none has any); the scorers after the filter
choose among them. A request with no sticky endpoint (a new prefix) and one that stays are
not affected, so new prefixes are still placed by the scorers alone: the servers' own view
of their queues, which includes load this EPP did not send, decides only where a request
has to move.

With ``queuedStickyPenaltyMs`` M (``ttftSource: latencyPredictor`` and
``excludeSaturated``), a sticky candidate whose scrape reports a longer waiting queue than
the shortest among the candidates keeps the request only when its prediction is within M
ms of the fastest, not ``maxTTFTPenaltyMs``: a prefix leaves a server that queues behind
the others sooner, and keeps the wider band where the queues are even.

With probability ``explorationProbability`` the filter passes everything, so cold
endpoints still receive some traffic for popular prefixes (the draw uses the Handle's
random generator, seeded in tests).
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from domain.datalayer.attributes import (
    IN_FLIGHT_LOAD,
    LATENCY_PREDICTION_INFO,
    PREFIX_CACHE_MATCH_INFO,
    InFlightLoad,
    LatencyPredictionInfo,
)
from domain.datalayer.attributes import PrefixCacheMatchInfo as _MatchInfo
from domain.plugins.base import Plugin, PluginRegistry, TypedName
from domain.plugins.handle import Handle
from domain.plugins.hooks import ConsumerPlugin, NamedProducerConsumer
from domain.scheduling.interfaces import CycleState
from domain.scheduling.load import (
    check_reported_request_tokens,
    input_tokens,
    reported_excess_tokens,
)
from domain.scheduling.types import Candidate, InferenceRequest
from ports.codec import JsonCodec

__all__ = ["TYPE", "PrefixAffinityFilter", "PrefixAffinityFilterParameters", "register"]

TYPE = "prefix-cache-affinity-filter"
PREFILL_THROUGHPUT = "prefillThroughput"
LATENCY_PREDICTOR = "latencyPredictor"


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefixAffinityFilterParameters:
    """``affinityThreshold`` (0.80) and ``explorationProbability`` (0), both in [0, 1];
    ``maxTTFTPenaltyMs`` (18000, >= 0; 0: that gate off); ``maxTokensInFlightPenalty`` (0,
    >= 0; 0: that gate off); ``peakPrefillThroughput`` (15928 tokens/s, > 0); ``ttftSource``
    (``prefillThroughput`` or ``latencyPredictor``); ``reportedRequestTokens`` (0, an
    integer >= 0: tokens per request a server reports beyond the EPP's own);
    ``excludeSaturated`` (false: an open gate passes every candidate; true: no candidate
    beyond the penalty from the fastest passes, then the sticky ones among the rest);
    ``leaveByReportedQueue`` (false; true: a request leaving its sticky endpoints passes
    only to those with the shortest scraped waiting queue); ``queuedStickyPenaltyMs``
    (unset; with ``ttftSource: latencyPredictor`` and ``excludeSaturated``: the narrower
    band, within [0, ``maxTTFTPenaltyMs``], for a sticky candidate whose scrape reports a
    longer waiting queue than the shortest); ``prefixMatchInfoProducerName``
    and ``inFlightLoadProducerName``: the plugins whose data it reads (checked to produce
    it; "": whichever does)."""

    affinity_threshold: float = 0.80
    exploration_probability: float = 0.0
    # Spelled so that the camelCase config key is exactly ``maxTTFTPenaltyMs``.
    max_TTFT_penalty_ms: float = 18000.0  # noqa: N815
    max_tokens_in_flight_penalty: int = 0
    peak_prefill_throughput: float = 15928.0
    ttft_source: str = PREFILL_THROUGHPUT
    reported_request_tokens: int = 0
    exclude_saturated: bool = False
    leave_by_reported_queue: bool = False
    queued_sticky_penalty_ms: float | None = None
    prefix_match_info_producer_name: str = ""
    in_flight_load_producer_name: str = ""

    def __post_init__(self) -> None:
        penalty = self.max_tokens_in_flight_penalty
        if isinstance(penalty, bool) or not isinstance(penalty, int) or penalty < 0:
            raise ValueError(f"maxTokensInFlightPenalty: must be an integer >= 0, got {penalty!r}")
        if not 0.0 <= self.affinity_threshold <= 1.0:
            raise ValueError("affinityThreshold: must be within [0, 1]")
        if not 0.0 <= self.exploration_probability <= 1.0:
            raise ValueError("explorationProbability: must be within [0, 1]")
        if not self.max_TTFT_penalty_ms >= 0:
            raise ValueError("maxTTFTPenaltyMs: must be >= 0")
        if not self.peak_prefill_throughput > 0 or self.peak_prefill_throughput == float("inf"):
            raise ValueError("peakPrefillThroughput: must be a finite number > 0")
        if self.ttft_source not in (PREFILL_THROUGHPUT, LATENCY_PREDICTOR):
            raise ValueError(f"ttftSource: must be {PREFILL_THROUGHPUT!r} or {LATENCY_PREDICTOR!r}")
        check_reported_request_tokens(self.reported_request_tokens)
        if not isinstance(self.exclude_saturated, bool):
            value = self.exclude_saturated
            raise ValueError(f"excludeSaturated: must be true or false, got {value!r}")
        if not isinstance(self.leave_by_reported_queue, bool):
            value = self.leave_by_reported_queue
            raise ValueError(f"leaveByReportedQueue: must be true or false, got {value!r}")
        queued = self.queued_sticky_penalty_ms
        if queued is not None and (
            isinstance(queued, bool)
            or not isinstance(queued, int | float)
            or not 0 <= queued <= self.max_TTFT_penalty_ms
        ):
            raise ValueError(
                "queuedStickyPenaltyMs: must be a number within [0, maxTTFTPenaltyMs], "
                f"got {queued!r}"
            )


class PrefixAffinityFilter(ConsumerPlugin, NamedProducerConsumer):
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
        self._penalty_tokens = parameters.max_tokens_in_flight_penalty
        self._ms_per_token = 1000.0 / parameters.peak_prefill_throughput
        self._predicted = parameters.ttft_source == LATENCY_PREDICTOR
        self._per_reported = parameters.reported_request_tokens
        self._exclude = parameters.exclude_saturated
        self._leave_by_queue = parameters.leave_by_reported_queue
        self._queued_penalty_ms = parameters.queued_sticky_penalty_ms

    @property
    def typed_name(self) -> TypedName:
        return self._typed_name

    def consumes(self) -> Sequence[str]:
        if self._predicted and self._penalty_ms > 0:
            return [PREFIX_CACHE_MATCH_INFO, LATENCY_PREDICTION_INFO]
        return [PREFIX_CACHE_MATCH_INFO, IN_FLIGHT_LOAD]

    def producer_names(self) -> Mapping[str, str]:
        return {
            PREFIX_CACHE_MATCH_INFO: self.parameters.prefix_match_info_producer_name,
            IN_FLIGHT_LOAD: self.parameters.in_flight_load_producer_name,
        }

    def filter(
        self, cycle: CycleState, request: InferenceRequest, candidates: Sequence[Candidate]
    ) -> Sequence[Candidate]:
        if self._exploration > 0.0 and self._rng.random() < self._exploration:
            return candidates
        if self._predicted:
            return self._filter_on_predictions(candidates)
        if self._exclude and (self._penalty_ms > 0 or self._penalty_tokens > 0):
            return self._filter_excluding_saturated(request, candidates)
        threshold = self._threshold
        gated = self._penalty_ms > 0 or self._penalty_tokens > 0
        prompt = input_tokens(request, self._codec) if gated else 0
        per_reported = self._per_reported
        sticky: list[Candidate] = []
        # The fewest tokens ahead of this prompt (in flight + its uncached part) on each
        # side; -1: no candidate of that side has an InFlightLoad. One pass, inlined: this
        # runs for every candidate of every request.
        best_sticky = best_other = -1
        others = False
        for c in candidates:
            attributes = c.attributes
            info = attributes.get(PREFIX_CACHE_MATCH_INFO)
            cached = 0
            is_sticky = False
            if info.__class__ is _MatchInfo:
                total = info.total_blocks
                if total > 0:
                    matched = info.match_blocks
                    is_sticky = matched / total >= threshold
                    cached = matched * info.block_size_tokens
            if is_sticky:
                sticky.append(c)
            else:
                others = True
            if not gated:
                continue
            load = attributes.get(IN_FLIGHT_LOAD)
            if load.__class__ is not InFlightLoad:
                continue
            ahead = max(load.tokens, 0) + max(prompt - cached, 0)
            if per_reported:
                ahead += reported_excess_tokens(c.metrics, load.requests, per_reported)
            if is_sticky:
                if best_sticky < 0 or ahead < best_sticky:
                    best_sticky = ahead
            elif best_other < 0 or ahead < best_other:
                best_other = ahead
        if not sticky:
            return candidates
        if not others or not gated:
            return sticky
        if best_sticky < 0 or best_other < 0:
            return candidates  # no load signal: the gate cannot tell, keep everyone
        gap = best_sticky - best_other
        if self._penalty_ms > 0 and gap * self._ms_per_token > self._penalty_ms:
            return self._leaving(candidates)
        if self._penalty_tokens > 0 and gap > self._penalty_tokens:
            return self._leaving(candidates)
        return sticky

    def _saturated(self, gap: float) -> bool:
        """Whether ``gap`` tokens more ahead than the fastest candidate is beyond a
        penalty."""
        if self._penalty_ms > 0 and gap * self._ms_per_token > self._penalty_ms:
            return True
        return self._penalty_tokens > 0 and gap > self._penalty_tokens

    def _filter_excluding_saturated(
        self, request: InferenceRequest, candidates: Sequence[Candidate]
    ) -> Sequence[Candidate]:
        prompt = input_tokens(request, self._codec)
        per_reported = self._per_reported
        # (candidate, sticky, tokens ahead of this prompt; -1: no InFlightLoad)
        rows: list[tuple[Candidate, bool, int]] = []
        best = -1
        for c in candidates:
            attributes = c.attributes
            info = attributes.get(PREFIX_CACHE_MATCH_INFO)
            cached = 0
            is_sticky = False
            if info.__class__ is _MatchInfo and info.total_blocks > 0:
                is_sticky = info.match_blocks / info.total_blocks >= self._threshold
                cached = info.match_blocks * info.block_size_tokens
            ahead = -1
            load = attributes.get(IN_FLIGHT_LOAD)
            if load.__class__ is InFlightLoad:
                ahead = max(load.tokens, 0) + max(prompt - cached, 0)
                if per_reported:
                    ahead += reported_excess_tokens(c.metrics, load.requests, per_reported)
                if best < 0 or ahead < best:
                    best = ahead
            rows.append((c, is_sticky, ahead))
        kept = [row for row in rows if row[2] < 0 or not self._saturated(row[2] - best)]
        return self._sticky_or_leaving(rows, kept)

    def _filter_on_predictions(self, candidates: Sequence[Candidate]) -> Sequence[Candidate]:
        if self._exclude and self._penalty_ms > 0:
            return self._predictions_excluding_saturated(candidates)
        threshold = self._threshold
        sticky: list[Candidate] = []
        others = False
        best_sticky = best_other = math.inf
        for c in candidates:
            is_sticky, ttft = _sticky_and_ttft(c, threshold)
            if is_sticky:
                sticky.append(c)
                best_sticky = min(best_sticky, ttft)
            else:
                others = True
                best_other = min(best_other, ttft)
        if not sticky:
            return candidates
        if not others or self._penalty_ms <= 0:
            return sticky
        if best_sticky - best_other > self._penalty_ms:  # inf - inf is NaN: sticky
            return self._leaving(candidates)
        return sticky

    def _predictions_excluding_saturated(
        self, candidates: Sequence[Candidate]
    ) -> Sequence[Candidate]:
        threshold = self._threshold
        rows: list[tuple[Candidate, bool, float]] = []
        best = math.inf
        for c in candidates:
            is_sticky, ttft = _sticky_and_ttft(c, threshold)
            best = min(best, ttft)
            rows.append((c, is_sticky, ttft))
        if best == math.inf:  # no prediction at all: stickiness alone
            sticky = [row[0] for row in rows if row[1]]
            return sticky or candidates
        limit = best + self._penalty_ms
        queued_penalty = self._queued_penalty_ms
        if queued_penalty is None:
            kept = [row for row in rows if row[2] <= limit]
        else:
            # a sticky candidate reporting a longer queue than the shortest keeps the
            # request only within the narrower band
            queued = _queued_longer_than_shortest([row[0] for row in rows])
            narrow = best + queued_penalty
            kept = [
                row
                for row, longer in zip(rows, queued, strict=True)
                if row[2] <= (narrow if row[1] and longer else limit)
            ]
        return self._sticky_or_leaving(rows, kept)

    def _sticky_or_leaving(
        self,
        rows: Sequence[tuple[Candidate, bool, float]],
        kept: Sequence[tuple[Candidate, bool, float]],
    ) -> Sequence[Candidate]:
        """The sticky candidates among ``kept`` if any; else all of ``kept``, narrowed by
        ``leaveByReportedQueue`` when some of ``rows`` were sticky (the request leaves)."""
        sticky = [row[0] for row in kept if row[1]]
        if sticky:
            return sticky
        passed = [row[0] for row in kept]
        if self._leave_by_queue and any(row[1] for row in rows):
            return _shortest_reported_queue(passed)
        return passed

    def _leaving(self, candidates: Sequence[Candidate]) -> Sequence[Candidate]:
        """What passes when the gate opens and the request leaves its sticky endpoints."""
        return _shortest_reported_queue(candidates) if self._leave_by_queue else candidates


def _factory(name: str, parameters: PrefixAffinityFilterParameters, handle: Handle) -> Plugin:
    return PrefixAffinityFilter(TypedName(TYPE, name), parameters, handle.rng, handle.codec)


def register(registry: PluginRegistry) -> None:
    registry.register(
        TYPE,
        _factory,
        parameters=PrefixAffinityFilterParameters,
        description="keeps endpoints holding most of the prompt prefix until they saturate",
    )


def _queued_longer_than_shortest(candidates: Sequence[Candidate]) -> list[bool]:
    """For each candidate, whether its scrape reports a longer waiting queue than the
    shortest reported (false without metrics)."""
    queues = [None if c.metrics is None else c.metrics.waiting_queue_size for c in candidates]
    known = [q for q in queues if q is not None]
    shortest = min(known) if known else 0
    return [q is not None and q > shortest for q in queues]


def _shortest_reported_queue(candidates: Sequence[Candidate]) -> Sequence[Candidate]:
    """The candidates whose scrape reports the shortest waiting queue, in order; all of
    them when none has metrics (one without metrics passes only then)."""
    queues = [None if c.metrics is None else c.metrics.waiting_queue_size for c in candidates]
    known = [q for q in queues if q is not None]
    if not known:
        return candidates
    shortest = min(known)
    return [c for c, q in zip(candidates, queues, strict=True) if q == shortest]


def _sticky_and_ttft(candidate: Candidate, threshold: float) -> tuple[bool, float]:
    """Whether ``candidate`` holds at least ``threshold`` of the prompt's blocks, and its
    predicted TTFT in ms (infinite without a prediction)."""
    attributes = candidate.attributes
    info = attributes.get(PREFIX_CACHE_MATCH_INFO)
    is_sticky = (
        info.__class__ is _MatchInfo
        and info.total_blocks > 0
        and info.match_blocks / info.total_blocks >= threshold
    )
    prediction = attributes.get(LATENCY_PREDICTION_INFO)
    ttft = prediction.ttft_ms if prediction.__class__ is LatencyPredictionInfo else math.inf
    return is_sticky, ttft
