"""``no-hit-lru-scorer``: spread cold requests over the endpoints that took one longest ago.

A request is cold when no candidate holds any of its prefix blocks (no
``PrefixCacheMatchInfo`` with a match). Cold requests fill a cache from scratch, so they
are spread: endpoints that never took a cold request score highest (1, then lower in
candidate order), then those that took one least recently; with ``n`` candidates the
``r``-th (from 0) scores ``1 - r / (n - 1)``. A request with a hit scores 0.5 everywhere
(neutral). After scheduling, a cold request's primary endpoint (and the ``prefill``
profile's, when it ran) becomes the most recently used. ``lruSize`` (1024, > 0) endpoints
are remembered; deleted endpoints are forgotten.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from domain.datalayer.attributes import PREFIX_CACHE_MATCH_INFO, PrefixCacheMatchInfo
from domain.datastore.endpoint import Endpoint
from domain.plugins.base import Plugin, PluginRegistry, TypedName
from domain.plugins.handle import Handle
from domain.plugins.hooks import ConsumerPlugin, NamedProducerConsumer
from domain.plugins.state import StateKey
from domain.scheduling.interfaces import DISTRIBUTION, CycleState
from domain.scheduling.types import Candidate, InferenceRequest, SchedulingResult
from ports.endpoints import EndpointEvent, EndpointEventKind

__all__ = ["TYPE", "NoHitLRUScorer", "NoHitLRUScorerParameters", "register"]

TYPE = "no-hit-lru-scorer"
PREFILL_PROFILE = "prefill"
_COLD: StateKey[bool] = StateKey("no-hit-lru.cold")


@dataclass(frozen=True, slots=True, kw_only=True)
class NoHitLRUScorerParameters:
    """``lruSize`` (1024, > 0); ``prefixMatchInfoProducerName`` (checked to name a producer
    of the match) and the deprecated ``prefixPluginType``/``prefixPluginName`` are accepted
    (one prefix producer here)."""

    lru_size: int = 1024
    prefix_match_info_producer_name: str = ""
    prefix_plugin_type: str = ""
    prefix_plugin_name: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.lru_size, bool) or self.lru_size <= 0:
            raise ValueError(f"lruSize: must be > 0, got {self.lru_size}")


class NoHitLRUScorer(ConsumerPlugin, NamedProducerConsumer):
    """Scorer + PreRequest; see the module docstring."""

    category = DISTRIBUTION

    def __init__(
        self, typed_name: TypedName, parameters: NoHitLRUScorerParameters, handle: Handle
    ) -> None:
        self._typed_name = typed_name
        self._size = parameters.lru_size
        self._producer = parameters.prefix_match_info_producer_name
        #: endpoint name -> None, least recently used first.
        self._lru: OrderedDict[str, None] = OrderedDict()
        handle.datastore.subscribe(self._on_endpoint_event)

    @property
    def typed_name(self) -> TypedName:
        return self._typed_name

    def consumes(self) -> Sequence[str]:
        return [PREFIX_CACHE_MATCH_INFO]

    def producer_names(self) -> Mapping[str, str]:
        return {PREFIX_CACHE_MATCH_INFO: self._producer}

    def score(
        self, cycle: CycleState, request: InferenceRequest, candidates: Sequence[Candidate]
    ) -> Sequence[float]:
        cold = not any(_hit(c) for c in candidates)
        request.state.put(self._typed_name.name, _COLD, cold)
        n = len(candidates)
        if not cold:
            return [0.5] * n
        if n == 1:
            return [1.0]
        lru = self._lru
        positions = {name: i for i, name in enumerate(lru)}
        never = [i for i, c in enumerate(candidates) if c.info.name not in positions]
        scores = [0.0] * n
        for rank, i in enumerate(never):
            scores[i] = 1.0 - rank / (n - 1)
        offset = len(never)
        for i, c in enumerate(candidates):
            position = positions.get(c.info.name)
            if position is not None:
                scores[i] = max(0.0, 1.0 - (offset + position) / (n - 1))
        return scores

    async def pre_request(self, request: InferenceRequest, result: SchedulingResult) -> None:
        if not request.state.pop(self._typed_name.name, _COLD):
            return
        for name in (result.primary_profile_name, PREFILL_PROFILE):
            run = result.profile_results.get(name)
            if run is not None and run.target_endpoints:
                self._touch(run.target_endpoints[0].info.name)

    def _touch(self, name: str) -> None:
        lru = self._lru
        lru[name] = None
        lru.move_to_end(name)
        while len(lru) > self._size:
            lru.popitem(last=False)

    def _on_endpoint_event(self, event: EndpointEvent, endpoint: Endpoint) -> None:
        if event.kind is EndpointEventKind.DELETE:
            self._lru.pop(endpoint.name, None)


def _hit(candidate: Candidate) -> bool:
    info = candidate.attributes.get(PREFIX_CACHE_MATCH_INFO)
    return isinstance(info, PrefixCacheMatchInfo) and info.match_blocks > 0


def _factory(name: str, parameters: NoHitLRUScorerParameters, handle: Handle) -> Plugin:
    return NoHitLRUScorer(TypedName(TYPE, name), parameters, handle)


def register(registry: PluginRegistry) -> None:
    registry.register(
        TYPE,
        _factory,
        parameters=NoHitLRUScorerParameters,
        description="spreads requests without a prefix hit over the least recently used",
    )
