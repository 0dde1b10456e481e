"""``token-load-scorer``: prefer endpoints with fewer tokens to work through.

An endpoint's load is its in-flight tokens (the ``InFlightLoad`` attribute: the uncached
tokens the pool's EPP processes have sent it and not seen finish) plus the look-ahead: the
part of this request's prompt the endpoint does not hold cached (its
``PrefixCacheMatchInfo``; the whole prompt when no prefix producer runs). A warm endpoint
therefore costs this request less than a cold one with the same queue, in the same units.

With ``reportedRequestTokens`` N > 0 the load also counts what the server itself reports:
when its scraped waiting plus running requests exceed the requests in flight there from
this EPP (the pool's, when shared), each request beyond adds N tokens. Load the EPP did
not send (another pool, a batch job, a client that bypasses the gateway) then shows, while
a server whose reported requests are this EPP's own scores as without it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from domain.datalayer.attributes import (
    IN_FLIGHT_LOAD,
    PREFIX_CACHE_MATCH_INFO,
    InFlightLoad,
    PrefixCacheMatchInfo,
)
from domain.plugins.base import Plugin, PluginRegistry, TypedName
from domain.plugins.handle import Handle
from domain.plugins.hooks import ConsumerPlugin
from domain.scheduling.interfaces import DISTRIBUTION, CycleState
from domain.scheduling.load import (
    check_reported_request_tokens,
    input_tokens,
    reported_excess_tokens,
)
from domain.scheduling.types import Candidate, InferenceRequest
from ports.codec import JsonCodec

__all__ = ["TYPE", "TokenLoadScorer", "TokenLoadScorerParameters", "register"]

TYPE = "token-load-scorer"


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenLoadScorerParameters:
    """``queueThresholdTokens``: the load in tokens at which an endpoint scores 0
    (default 4,194,304: 128 requests * 32K tokens). Must be > 0. ``reportedRequestTokens``
    (0: off): tokens counted per request the server reports waiting or running beyond the
    in-flight requests this EPP knows of, an integer >= 0."""

    queue_threshold_tokens: int = 4_194_304
    reported_request_tokens: int = 0

    def __post_init__(self) -> None:
        value = self.queue_threshold_tokens
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"queueThresholdTokens: must be an integer, got {value!r}")
        if value <= 0:
            raise ValueError(f"queueThresholdTokens: must be > 0, got {value}")
        check_reported_request_tokens(self.reported_request_tokens)


class TokenLoadScorer(ConsumerPlugin):
    """Scores ``1 - min(load, threshold) / threshold`` where load is the in-flight tokens
    plus this prompt's uncached tokens on the endpoint; a candidate without an
    ``InFlightLoad`` counts as nothing in flight.

    Consumes the ``InFlightLoad`` data key, so its default producer is created with it.
    """

    __slots__ = ("_codec", "_per_reported", "_threshold", "typed_name")

    category = DISTRIBUTION

    def __init__(
        self, typed_name: TypedName, parameters: TokenLoadScorerParameters, codec: JsonCodec
    ) -> None:
        self.typed_name = typed_name
        self._threshold = parameters.queue_threshold_tokens
        self._per_reported = parameters.reported_request_tokens
        self._codec = codec

    def consumes(self) -> Sequence[str]:
        return [IN_FLIGHT_LOAD]

    def score(
        self, cycle: CycleState, request: InferenceRequest, candidates: Sequence[Candidate]
    ) -> Sequence[float]:
        threshold = self._threshold
        per_reported = self._per_reported
        prompt = input_tokens(request, self._codec)
        scores: list[float] = []
        append = scores.append
        for c in candidates:  # inlined: this runs for every candidate of every request
            attributes = c.attributes
            tokens = prompt
            info = attributes.get(PREFIX_CACHE_MATCH_INFO)
            if info.__class__ is PrefixCacheMatchInfo:
                cached = info.match_blocks * info.block_size_tokens
                tokens = prompt - cached if cached < prompt else 0
            load = attributes.get(IN_FLIGHT_LOAD)
            own = 0
            if load.__class__ is InFlightLoad:
                own = load.requests
                if load.tokens > 0:
                    tokens += load.tokens
            if per_reported:
                tokens += reported_excess_tokens(c.metrics, own, per_reported)
            append(1.0 - tokens / threshold if tokens < threshold else 0.0)
        return scores


def _factory(name: str, parameters: TokenLoadScorerParameters, handle: Handle) -> Plugin:
    return TokenLoadScorer(TypedName(TYPE, name), parameters, handle.codec)


def register(registry: PluginRegistry) -> None:
    registry.register(
        TYPE,
        _factory,
        parameters=TokenLoadScorerParameters,
        description="prefers endpoints with fewer in-flight plus uncached prompt tokens",
    )
