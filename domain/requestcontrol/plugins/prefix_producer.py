"""``approx-prefix-cache-producer``: which endpoints likely hold a request's prompt prefix.

Before scheduling, the request's prompt is cut into blocks of ``blockSizeTokens * 4``
characters and hashed as a chain (each hash covers the whole prefix up to its block); the
shared ``PrefixIndex`` says how many of those blocks each endpoint was recently sent, and
every candidate gets a ``PrefixCacheMatchInfo`` attribute (the best match is reported to the
Handle's observer as the prefix indexer's hit ratio and hit bytes). After scheduling, the hashes
are recorded for the chosen endpoint (and for the ``prefill`` profile's endpoint, when that
profile ran), so the next request with the same prefix is steered to it. The hashes are also
left in the request's state as ``PrefixBlocks`` (``domain.scheduling.load``) for the
``kv-capacity-gate``.

It is the default producer of ``PrefixCacheMatchInfo``: configuring ``prefix-cache-scorer``
(or ``prefix-cache-affinity-filter``) creates it, with the scorer's parameters.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from domain.datalayer.attributes import (
    IN_FLIGHT_LOAD,
    PREFIX_CACHE_MATCH_INFO,
    InFlightLoad,
    PrefixCacheMatchInfo,
)
from domain.datastore.endpoint import Endpoint
from domain.datastore.store import Datastore
from domain.plugins.base import Plugin, PluginRegistry, TypedName
from domain.plugins.handle import Handle
from domain.plugins.hooks import ConsumerPlugin, ProducerPlugin
from domain.plugins.state import StateKey
from domain.prefixcache.index import InMemoryPrefixIndex, SupportsSyncEndpointRemoval
from domain.prefixcache.parameters import (
    CHARS_PER_TOKEN,
    DEFAULT_BLOCK_SIZE_TOKENS,
    PrefixCacheParameters,
)
from domain.scheduling.load import PREFIX_BLOCKS, PREFIX_BLOCKS_OWNER, PrefixBlocks
from domain.scheduling.types import Candidate, InferenceRequest, SchedulingResult
from ports.endpoints import EndpointEvent, EndpointEventKind
from ports.metric_catalogue import PREFIX_INDEXER_HIT_BYTES, PREFIX_INDEXER_HIT_RATIO
from ports.prefix_index import ClaimingPrefixIndex, PrefixIndex

__all__ = [
    "BLOCK_HASHES",
    "CHARS_PER_TOKEN",
    "DEFAULT_BLOCK_SIZE_TOKENS",
    "PREFILL_PROFILE",
    "TYPE",
    "ApproxPrefixCacheProducer",
    "Claim",
    "PrefixCacheParameters",
    "claim_new_prefix",
    "new_prefix_alternates",
    "register",
]

logger = logging.getLogger(__name__)

TYPE = "approx-prefix-cache-producer"
#: The profile name whose chosen endpoint is indexed too (prefill/decode disaggregation).
PREFILL_PROFILE = "prefill"
#: The request's block hashes, from ``prepare_request_data`` to ``pre_request``.
BLOCK_HASHES: StateKey[list[int]] = StateKey("prefix-block-hashes")
#: A request whose prefix nobody held: its candidates by name, for ``claim_placement``.
NEW_CHAIN: StateKey[dict[str, Candidate]] = StateKey("prefix-new-chain")
#: The endpoint ``claim_placement`` recorded the chain for (``pre_request`` skips it).
CLAIMED_FOR: StateKey[str] = StateKey("prefix-claimed-for")
_NO_LABELS: dict[str, str] = {}
#: How many prompts of in-flight load above the pick's an endpoint may have and still be
#: an alternate of a new prefix's claim (measured: with one, two new prefixes decided at
#: the same moment by one process both went to its least loaded endpoint; with two, the
#: groups that came after the opening burst of ``tests.bench.replicas`` were often left a
#: single choice, and 3 replicas placed its 20 groups 5-5-5-5 on 4 servers in 5 of 8 runs
#: on one Redis and 1 of 8 on a cluster; with four, in 8 of 8 on each).
NEAR_PROMPTS = 4


class ApproxPrefixCacheProducer(ProducerPlugin, ConsumerPlugin):
    """DataProducer + PlacementClaimer + PreRequest writing ``PrefixCacheMatchInfo`` on
    every candidate.

    A request whose prefix no endpoint holds claims it for the picked endpoint
    (``claim_placement``, when the index is a ``ClaimingPrefixIndex``): if another EPP
    process claimed the same chain since this one matched, the request follows that
    process's endpoint when it is one of its candidates, so a burst of a new prefix through
    several processes lands on one server.

    Requests without a body, or whose prefix input is shorter than one block, get
    ``PrefixCacheMatchInfo(0, 0, block_size_tokens)`` (score 0) and are not indexed. An
    endpoint deleted from the datastore is removed from the index, and hashes are not
    recorded for an endpoint that is no longer in the datastore.
    """

    def __init__(
        self, typed_name: TypedName, parameters: PrefixCacheParameters, handle: Handle
    ) -> None:
        self._typed_name = typed_name
        self.parameters = parameters
        self._codec = handle.codec
        self._hasher = handle.hasher
        self._index = handle.prefix_index
        self._claims = isinstance(handle.prefix_index, ClaimingPrefixIndex)
        self._datastore = handle.datastore
        self._observer = handle.observer
        self._removals: set[asyncio.Task[None]] = set()
        handle.datastore.subscribe(self._on_endpoint_event)

    @property
    def typed_name(self) -> TypedName:
        return self._typed_name

    def produces(self) -> Sequence[str]:
        return [PREFIX_CACHE_MATCH_INFO]

    def consumes(self) -> Sequence[str]:
        return []

    async def prepare_request_data(
        self, request: InferenceRequest, candidates: Sequence[Candidate]
    ) -> None:
        params = self.parameters
        block_tokens = params.tokens_per_block
        if params.auto_tune and candidates:
            metrics = candidates[0].metrics
            if metrics is not None and metrics.cache_block_size > 0:
                block_tokens = metrics.cache_block_size
        body = request.body
        hashes: list[int] = []
        if body is not None:
            seed = (request.target_model + body.cache_salt).encode()
            block_chars = block_tokens * CHARS_PER_TOKEN
            max_blocks = params.max_blocks(block_tokens)
            hashes = self._hasher.chain(
                body.prefix_input(self._codec, limit=block_chars * max_blocks),
                block_chars,
                seed,
                max_blocks,
            )
        if not hashes:
            none = PrefixCacheMatchInfo(0, 0, block_tokens)
            for candidate in candidates:
                candidate.attributes[PREFIX_CACHE_MATCH_INFO] = none
            return
        name = self._typed_name.name
        request.state.put(name, BLOCK_HASHES, hashes)
        request.state.put(PREFIX_BLOCKS_OWNER, PREFIX_BLOCKS, PrefixBlocks(hashes, block_tokens))
        total = len(hashes)
        matches = await self._index.match(hashes)
        if not matches and self._claims:
            request.state.put(name, NEW_CHAIN, {c.info.name: c for c in candidates})
        zero = PrefixCacheMatchInfo(0, total, block_tokens)
        best = 0
        for candidate in candidates:
            matched = matches.get(candidate.info.name, 0)
            if matched:
                best = max(best, matched)
                candidate.attributes[PREFIX_CACHE_MATCH_INFO] = PrefixCacheMatchInfo(
                    matched, total, block_tokens
                )
            else:
                candidate.attributes[PREFIX_CACHE_MATCH_INFO] = zero
        # The best candidate's matched share of the blocks, and its matched length in bytes.
        observer = self._observer
        observer.histogram(PREFIX_INDEXER_HIT_RATIO, _NO_LABELS, best / total)
        observer.histogram(
            PREFIX_INDEXER_HIT_BYTES, _NO_LABELS, best * block_tokens * CHARS_PER_TOKEN
        )

    async def claim_placement(
        self, request: InferenceRequest, result: SchedulingResult
    ) -> Candidate | None:
        name = self._typed_name.name
        state = request.state
        claim = await claim_new_prefix(
            self._index,
            state.get(name, BLOCK_HASHES),
            state.get(name, NEW_CHAIN),
            result,
            datastore=self._datastore,
            capacity=self._capacity,
            tokens_per_block=self.parameters.tokens_per_block,
            request_id=request.request_id,
        )
        if claim is None:
            return None
        if claim.owner == claim.picked:
            state.put(name, CLAIMED_FOR, claim.owner)
        return claim.follow

    async def pre_request(self, request: InferenceRequest, result: SchedulingResult) -> None:
        name = self._typed_name.name
        hashes = request.state.get(name, BLOCK_HASHES)
        if not hashes:
            return
        claimed = request.state.get(name, CLAIMED_FOR)
        targets: list[Candidate] = []
        primary = result.primary
        if primary is not None and primary.target_endpoints:
            targets.append(primary.target_endpoints[0])
        prefill = result.profile_results.get(PREFILL_PROFILE)
        if prefill is not None and prefill.target_endpoints:
            chosen = prefill.target_endpoints[0]
            if not targets or chosen.info.name != targets[0].info.name:
                targets.append(chosen)
        for target in targets:
            endpoint = target.info.name
            if endpoint == claimed:
                continue  # recorded by the claim
            if self._datastore.get(endpoint) is None:
                continue  # deleted since scheduling: do not resurrect it in the index
            await self._index.add(hashes, endpoint, self._capacity(target))

    def _capacity(self, target: Candidate) -> int:
        metrics = target.metrics
        if self.parameters.auto_tune and metrics is not None and metrics.cache_num_blocks > 0:
            return metrics.cache_num_blocks
        return self.parameters.lru_capacity_per_server

    def _on_endpoint_event(self, event: EndpointEvent, endpoint: Endpoint) -> None:
        if event.kind is not EndpointEventKind.DELETE:
            return
        name = endpoint.name
        index = self._index
        if isinstance(index, SupportsSyncEndpointRemoval):
            index.remove_endpoint_sync(name)
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            logger.warning("prefix index entries of deleted endpoint %s not removed", name)
            return
        task = loop.create_task(self._remove(name))
        self._removals.add(task)
        task.add_done_callback(self._removals.discard)

    async def _remove(self, name: str) -> None:
        try:
            await self._index.remove_endpoint(name)
        except Exception:
            logger.exception("removing deleted endpoint %s from the prefix index failed", name)


@dataclass(frozen=True, slots=True)
class Claim:
    """What ``claim_new_prefix`` learnt: the endpoint that owns the new chain now, the
    endpoint this process picked, and the candidate to move the request to (``None``: keep
    the pick; the owner is the pick, or not one of this request's candidates)."""

    owner: str
    picked: str
    follow: Candidate | None


async def claim_new_prefix(
    index: PrefixIndex | None,
    hashes: Sequence[int] | None,
    candidates: Mapping[str, Candidate] | None,
    result: SchedulingResult,
    *,
    datastore: Datastore | None,
    capacity: Callable[[Candidate], int],
    tokens_per_block: int,
    request_id: str,
) -> Claim | None:
    """Claim the new chain ``hashes`` (no endpoint held any of it when the request was
    matched) for the primary profile's pick, with its alternates (``new_prefix_alternates``);
    ``None`` when nothing was claimed: no ``hashes`` or ``candidates`` (the request's
    candidates by name, as they were matched; ``None``: its prefix was not new), an
    ``index`` that cannot claim, no pick, or a pick no longer in ``datastore``. Shared by
    the prefix producers (``PlacementClaimer``)."""
    primary = result.primary
    if (
        not hashes
        or candidates is None
        or not isinstance(index, ClaimingPrefixIndex)
        or primary is None
        or not primary.target_endpoints
    ):
        return None
    picked = primary.target_endpoints[0]
    name = picked.info.name
    if datastore is not None and datastore.get(name) is None:
        return None
    # One process's own index: its load is exact and nothing decides beside it, so the
    # pick stands (measured: spreading there made a Zipf workload's p90 worse).
    alternates = (
        []
        if isinstance(index, InMemoryPrefixIndex)
        else new_prefix_alternates(
            picked, primary.alternates, candidates, len(hashes), tokens_per_block
        )
    )
    owner = await index.claim(hashes, name, capacity(picked), alternates)
    if owner == name:
        return Claim(owner, name, None)
    chosen = candidates.get(owner)
    if chosen is not None:
        logger.debug("request %s: new prefix already placed on %s, not %s", request_id, owner, name)
    return Claim(owner, name, chosen)


def new_prefix_alternates(
    picked: Candidate,
    passed: Sequence[Candidate],
    candidates: Mapping[str, Candidate],
    blocks: int,
    tokens_per_block: int,
) -> list[str]:
    """The endpoints as good as ``picked`` for a new prefix of ``blocks`` blocks: those
    that passed the filters with an in-flight load (the pool's, as this process last
    read it) at most ``NEAR_PROMPTS`` such prompts above the pick's. The decisions of the
    last moments, other processes' and this one's still awaiting their claim, are missing
    from that load, so within that margin the claim prefers the endpoint the fewest new
    prefixes went to lately, pool-wide. Without the ``InFlightLoad`` attribute (no
    ``inflight-load-producer``): none."""
    load = picked.attributes.get(IN_FLIGHT_LOAD)
    if not passed or not isinstance(load, InFlightLoad):
        return []
    limit = load.tokens + NEAR_PROMPTS * blocks * tokens_per_block
    near: list[str] = []
    for other in passed:
        name = other.info.name
        theirs = other.attributes.get(IN_FLIGHT_LOAD)
        if isinstance(theirs, InFlightLoad) and theirs.tokens <= limit and name in candidates:
            near.append(name)
    return near


def _factory(name: str, parameters: PrefixCacheParameters, handle: Handle) -> Plugin:
    return ApproxPrefixCacheProducer(TypedName(TYPE, name), parameters, handle)


def register(registry: PluginRegistry) -> None:
    registry.register(
        TYPE,
        _factory,
        parameters=PrefixCacheParameters,
        default_for=(PREFIX_CACHE_MATCH_INFO,),
        description="approximate prefix-cache match per endpoint, from recent routing",
    )
