"""``precise-prefix-cache-producer``: which endpoints *really* hold a request's prompt prefix.

Where ``approx-prefix-cache-producer`` remembers where prompts were sent, this producer
reads the model servers' own KV-cache events: the app subscribes to every endpoint's event
publisher and feeds a ``KVBlockIndex`` (block hash → endpoints). Before scheduling, the
prompt is tokenized with the model's tokenizer and its full blocks are hashed the way the
engine hashes them (``domain.prefixcache.engine_hash``), so the keys equal the events'
keys; every candidate gets a ``PrefixCacheMatchInfo`` with the leading blocks it holds,
which ``prefix-cache-scorer`` turns into a score.

After scheduling, the chosen endpoint is credited with the prompt's blocks for
``speculativeTtl`` seconds (until its events confirm them), so a burst of one prefix
does not scatter before the first events arrive. Those speculative entries are shared
by the EPP processes of a pool through the Handle's ``PrefixIndex`` (on Redis with
``--redis-url``; in memory otherwise): a request whose prompt no candidate holds a block
of (cold everywhere) looks its keys up there too (``match``: where another process just
sent it), and when nobody did, claims them for the endpoint it picked
(``claim_placement``, as ``approx-prefix-cache-producer`` does; the first claim wins and
the others follow its endpoint). The keys are mixed there with a constant of this
producer and a window of ``speculativeTtl / 2`` seconds of wall-clock time (the current
window is claimed; the current and previous ones are matched), so they never meet the
approximate producer's keys in the same index and are forgotten after at most
``speculativeTtl``, as the local speculative entries are.

The keys carry what the engine adds to its block hashes: a request to a LoRA adapter is
hashed with the adapter's name on every block (an adapter is a model name the servers'
events give as ``lora_name``, or that a candidate's metrics report running or waiting:
``LoraAdapterNames``; any other model is the base model, hashed without), and the
request's ``cache_salt`` goes with its first block.

A chat request's messages are rendered with the model's chat template (the request's
``chat_template_kwargs``, ``add_generation_prompt``, default true) and tokenized without
special tokens unless it sets ``add_special_tokens``, as vLLM does. Requests it cannot key
this way (other APIs, token-id prompts, no chat template, a template that fails on the
conversation, non-text content, ``tools``, a request's own ``chat_template``,
``continue_final_message``, a prompt the tokenizer refuses) are counted
(``inference_extension_precise_prefix_unkeyed_total{reason}``) and fall back to the
approximate path for that request when the app gives a ``fallback`` (an
``approx-prefix-cache-producer`` of its own: where such requests were sent, by the
prompt's characters); without one they get no match (score 0).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from domain.datalayer.attributes import PREFIX_CACHE_MATCH_INFO, PrefixCacheMatchInfo
from domain.datastore.store import Datastore
from domain.plugins.base import Duration, TypedName
from domain.plugins.hooks import BackgroundPlugin, ConsumerPlugin, ProducerPlugin
from domain.plugins.state import StateKey
from domain.prefixcache.engine_hash import HASH_ALGORITHMS
from domain.prefixcache.kv_block_index import InMemoryKVBlockIndex
from domain.prefixcache.precise import LoraAdapterNames, PromptKeyer
from domain.requestcontrol.plugins.prefix_producer import (
    ApproxPrefixCacheProducer,
    PrefixCacheParameters,
    claim_new_prefix,
)
from domain.requesthandling.openai import ApiKind
from domain.scheduling.load import PREFIX_BLOCKS, PREFIX_BLOCKS_OWNER, PrefixBlocks
from domain.scheduling.types import Candidate, InferenceRequest, SchedulingResult
from domain.sharedstate.shared_kv_index import SharedKVBlockIndex
from ports.endpoints import EndpointEvent, EndpointEventKind
from ports.kv_events import DATA_PARALLEL_RANK_HEADER, KVEventFeed, rank_key
from ports.metric_catalogue import KV_KEYS_UNKEYED, PREFIX_INDEXER_HIT_RATIO
from ports.observer import NoopObserver, Observer
from ports.prefix_index import ClaimingPrefixIndex, PrefixIndex
from ports.tokenizer import ChatTemplateError, TokenizerError

__all__ = [
    "TYPE",
    "IndexerConfig",
    "KVEventsConfig",
    "PrecisePrefixCacheParameters",
    "PrecisePrefixCacheProducer",
    "TokenProcessorConfig",
]

logger = logging.getLogger(__name__)

TYPE = "precise-prefix-cache-producer"
_KEYS: StateKey[list[int]] = StateKey("precise-prefix-keys")
_FALLBACK: StateKey[bool] = StateKey("precise-prefix-fallback")
# endpoint -> the engine (data-parallel rank) holding the longest prefix
_RANKS: StateKey[dict[str, int]] = StateKey("precise-prefix-ranks")
# cold everywhere: the keys as the shared prefix index holds them (the current window)
_SHARED_KEYS: StateKey[list[int]] = StateKey("precise-prefix-shared-keys")
# cold everywhere and nobody claimed them: the candidates by name, for claim_placement
_NEW_CHAIN: StateKey[dict[str, Candidate]] = StateKey("precise-prefix-new-chain")
# the endpoint the shared prefix index has the keys for (pre_request does not add them)
_CLAIMED_FOR: StateKey[str] = StateKey("precise-prefix-claimed-for")
# mixed into the engine keys in the shared prefix index (see _shared_keys)
_NAMESPACE = 0x5EC0_1A7E_9E37_79B9
_MASK64 = (1 << 64) - 1
_LRU_CAPACITY = PrefixCacheParameters().lru_capacity_per_server
_NO_LABELS: dict[str, str] = {}
INDEX_BACKENDS = ("in-memory", "redis")
_REPLAY_TIMEOUT = Duration(1.0)
_SPECULATIVE_TTL = Duration(2.0)


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenProcessorConfig:
    """How the engine hashes blocks: these must equal the model server's settings.

    - ``blockSizeTokens`` (16): vLLM's ``--block-size``; ``blockSize`` is its older name.
    - ``hashSeed``: the engine's ``PYTHONHASHSEED`` (required: unset, vLLM seeds randomly).
    - ``hashAlgorithm`` (``sha256``): vLLM's ``--prefix-caching-hash-algo`` (``sha256``,
      ``sha256_cbor``, ``xxhash``, ``xxhash_cbor``).
    - ``tokenizerPath``: the model's ``tokenizer.json`` (or a directory holding it).
    - ``chatTemplatePath``: a Jinja file with the model's chat template (vLLM's
      ``--chat-template``); unset: ``chat_template.jinja`` beside the tokenizer, else the
      ``chat_template`` of the ``tokenizer_config.json`` beside it.
    """

    block_size_tokens: int | None = None
    block_size: int | None = None
    hash_seed: str = ""
    hash_algorithm: str = "sha256"
    tokenizer_path: str = ""
    chat_template_path: str = ""

    def __post_init__(self) -> None:
        for key, value in (
            ("blockSizeTokens", self.block_size_tokens),
            ("blockSize", self.block_size),
        ):
            if value is not None and value < 1:
                raise ValueError(f"{key}: must be >= 1")
        if not self.hash_seed:
            raise ValueError(
                "hashSeed: required: the model servers' PYTHONHASHSEED (without one, vLLM "
                "seeds its block hashes randomly and no one else can compute them)"
            )
        if self.hash_algorithm not in HASH_ALGORITHMS:
            raise ValueError(f"hashAlgorithm: must be one of {', '.join(HASH_ALGORITHMS)}")
        if not self.tokenizer_path:
            raise ValueError("tokenizerPath: required: the model's tokenizer.json")

    @property
    def tokens_per_block(self) -> int:
        if self.block_size_tokens is not None:
            return self.block_size_tokens
        return self.block_size if self.block_size is not None else 16


@dataclass(frozen=True, slots=True, kw_only=True)
class KVEventsConfig:
    """Where the events come from: each endpoint's publisher at ``tcp://<ip>:socketPort``
    (vLLM's ``--kv-events-config`` ``endpoint``), its replay socket at ``replayPort``
    (``null``: none), messages whose topic starts with ``topicFilter``.

    Data parallelism: each engine (DP rank) has its own KV cache and publishes on the
    ports plus its rank. An endpoint ``<pod>-rank-<i>`` (one engine per target port) is
    engine ``i``. ``dataParallelSize`` (1) is the number of engines behind each endpoint's
    one port (vLLM's internal load balancing): each is indexed on its own, an endpoint's
    match is its best engine's, and the request is pinned to that engine with the
    ``x-data-parallel-rank`` header."""

    socket_port: int = 5557
    replay_port: int | None = None
    topic_filter: str = ""
    replay_timeout: Duration = _REPLAY_TIMEOUT
    data_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.data_parallel_size < 1:
            raise ValueError("dataParallelSize: must be >= 1")
        last = self.data_parallel_size - 1
        for key, port in (("socketPort", self.socket_port), ("replayPort", self.replay_port)):
            if port is not None and not 0 < port <= 65535 - last:
                raise ValueError(f"{key}: must be within 1..{65535 - last}")


@dataclass(frozen=True, slots=True, kw_only=True)
class IndexerConfig:
    """The index: ``backend`` and ``maxBlocksPerEndpoint`` (1,048,576), the most blocks
    remembered per endpoint. ``backend``: ``in-memory`` (this process only) or ``redis``
    (the pool's processes share one copy on the ``--redis-url`` store, so a new one starts
    warm; docs/shared-state.md); unset: ``redis`` when ``--redis-url`` is given, as the
    approximate index does."""

    backend: str | None = None
    max_blocks_per_endpoint: int = 1 << 20

    def __post_init__(self) -> None:
        if self.backend is not None and self.backend not in INDEX_BACKENDS:
            raise ValueError(f"backend: must be one of {', '.join(INDEX_BACKENDS)}")
        if self.max_blocks_per_endpoint < 1:
            raise ValueError("maxBlocksPerEndpoint: must be >= 1")


@dataclass(frozen=True, slots=True, kw_only=True)
class PrecisePrefixCacheParameters:
    """``tokenProcessorConfig`` (required), ``kvEventsConfig``, ``indexerConfig``,
    ``speculativeTtl`` (2s; 0 turns speculative entries off), ``maxPrefixBlocksToMatch``
    (8192), ``tokenizationCacheChars`` (32 Mi characters of recent prompts) and
    ``tokenizeInThreadChars`` (4096: a prompt at least this long that is not cached is
    tokenized and hashed in a worker thread, so the event loop serves other requests
    meanwhile; a chat request whose body is at least this many bytes is also rendered
    there; 0: always on the event loop)."""

    token_processor_config: TokenProcessorConfig
    kv_events_config: KVEventsConfig = field(default_factory=KVEventsConfig)
    indexer_config: IndexerConfig = field(default_factory=IndexerConfig)
    speculative_ttl: Duration = _SPECULATIVE_TTL
    max_prefix_blocks_to_match: int = 8192
    tokenization_cache_chars: int = 32 * 1024 * 1024
    tokenize_in_thread_chars: int = 4096

    def __post_init__(self) -> None:
        if self.tokenize_in_thread_chars < 0:
            raise ValueError("tokenizeInThreadChars: must be >= 0")
        if self.max_prefix_blocks_to_match < 1:
            raise ValueError("maxPrefixBlocksToMatch: must be >= 1")
        if self.tokenization_cache_chars < 0:
            raise ValueError("tokenizationCacheChars: must be >= 0")


_ADD_OR_UPDATE = EndpointEventKind.ADD_OR_UPDATE


class PrecisePrefixCacheProducer(ProducerPlugin, ConsumerPlugin, BackgroundPlugin):
    """DataProducer + PlacementClaimer + PreRequest writing ``PrefixCacheMatchInfo`` from
    the events' index (and, for a prompt cold everywhere, the pool's shared speculative
    entries: ``shared``, the Handle's prefix index; ``None`` or ``speculativeTtl`` 0: none).

    Its background work is its own (the app calls ``start``/``stop``): ``start`` subscribes
    the ``feed`` to the endpoints' events and starts the shared index (its warm load from
    the store); ``stop`` ends the subscriptions and releases the shared index's writer
    leases. ``ready``: the shared index loaded
    its copy of the endpoints known so far (at once with the in-memory index)."""

    def __init__(
        self,
        typed_name: TypedName,
        parameters: PrecisePrefixCacheParameters,
        *,
        keyer: PromptKeyer,
        index: InMemoryKVBlockIndex | SharedKVBlockIndex,
        observer: Observer | None = None,
        feed: KVEventFeed | None = None,
        fallback: ApproxPrefixCacheProducer | None = None,
        adapters: LoraAdapterNames | None = None,
        shared: PrefixIndex | None = None,
        datastore: Datastore | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._typed_name = typed_name
        self.parameters = parameters
        self.keyer = keyer
        self.index = index
        self._observer = observer if observer is not None else NoopObserver()
        self._block = keyer.block_size
        self._warned: set[str] = set()
        self._feed = feed
        self._started = feed is None  # nothing to start without one
        self._stopped = False
        self.fallback = fallback
        self.adapters = adapters if adapters is not None else LoraAdapterNames()
        # speculative entries shared by the pool's processes (None: this process only)
        self.shared = shared if parameters.speculative_ttl > 0 else None
        self._datastore = datastore
        self._clock = clock  # wall-clock time: the windows are the same in every process
        self._window = parameters.speculative_ttl / 2

    def on_endpoint_event(self, event: EndpointEvent, _endpoint: object = None) -> None:
        """A datastore listener (owned by this plugin, so a config reload drops it): the
        feed follows the pool, and the shared index warms a new endpoint from the store's
        copy before any of its events."""
        if self._feed is None or self._stopped:
            return
        self._feed.on_endpoint_event(event)
        if isinstance(self.index, SharedKVBlockIndex) and event.kind is _ADD_OR_UPDATE:
            for key in self._feed.keys(event.endpoint.name):
                self.index.follow(key)

    @property
    def typed_name(self) -> TypedName:
        return self._typed_name

    def produces(self) -> Sequence[str]:
        return [PREFIX_CACHE_MATCH_INFO]

    def consumes(self) -> Sequence[str]:
        return []

    def _unkeyed(self, reason: str, detail: object = None) -> list[int] | None:
        """Count a request that cannot be keyed (it falls back); log each reason once."""
        self._observer.counter(KV_KEYS_UNKEYED, {"reason": reason})
        if detail is not None and reason not in self._warned:
            self._warned.add(reason)
            logger.warning("%s: a request could not be keyed: %s", self._typed_name, detail)
        return None

    def _lora_name(self, model: str, candidates: Sequence[Candidate]) -> str | None:
        """``model`` when the servers serve it as a LoRA adapter (their events named it, or
        a candidate's metrics report it running or waiting), else ``None`` (the base)."""
        adapters = self.adapters
        if not model:
            return None
        if model in adapters:
            return model
        for candidate in candidates:
            metrics = candidate.metrics
            if metrics is not None and (
                model in metrics.active_models or model in metrics.waiting_models
            ):
                adapters.add(model)
                return model
        return None

    async def _keys(
        self, request: InferenceRequest, candidates: Sequence[Candidate]
    ) -> list[int] | None:
        """The prompt's block keys; ``None``: this request cannot be keyed (counted)."""
        body = request.body
        if body is None:
            return []
        if body.opaque:
            return self._unkeyed("api")
        keyer = self.keyer
        max_blocks = self.parameters.max_prefix_blocks_to_match
        threshold = self.parameters.tokenize_in_thread_chars
        special = True
        if body.api is ApiKind.COMPLETIONS:
            prompt = body.payload.get("prompt")
            if not isinstance(prompt, str):
                return self._unkeyed("prompt")
            text = prompt
        elif body.api is ApiKind.CHAT_COMPLETIONS:
            chat = self._chat(body.payload)
            if isinstance(chat, str):
                return self._unkeyed(chat)
            render, special = chat
            try:
                if threshold and request.request_size_bytes >= threshold:
                    text = await asyncio.to_thread(render)
                else:
                    text = render()
            except ChatTemplateError as exc:
                return self._unkeyed("chat_template", exc)
        else:
            return self._unkeyed("api")
        if not text:
            return []
        salt = body.payload.get("cache_salt")
        hashing = functools.partial(
            keyer.keys_for_tokens,
            lora_name=self._lora_name(request.target_model, candidates),
            cache_salt=salt if isinstance(salt, str) and salt else None,
            max_blocks=max_blocks,
        )
        text = keyer.prefix_text(text, keyer.block_size, max_blocks)
        cached = keyer.cached(text, special=special)
        if cached is not None:
            return hashing(cached)
        try:
            if threshold and len(text) >= threshold:
                ids, keys = await asyncio.to_thread(self._encode_and_hash, text, special, hashing)
            else:
                ids, keys = self._encode_and_hash(text, special, hashing)
        except TokenizerError as exc:
            return self._unkeyed("tokenizer", exc)
        keyer.remember(text, ids, special=special)
        return keys

    def _chat(self, payload: Mapping[str, object]) -> tuple[Callable[[], str], bool] | str:
        """How to render a chat request's prompt text (a thread may call it), and whether
        special tokens are added when tokenizing it; or why it cannot be keyed."""
        template = self.keyer.chat
        if template is None:
            return "no_chat_template"
        messages = payload.get("messages")
        options = payload.get("chat_template_kwargs") or {}
        add_generation_prompt = payload.get("add_generation_prompt", True)
        special = payload.get("add_special_tokens", False)
        if (
            not isinstance(messages, list)
            or not isinstance(options, dict)
            or not isinstance(add_generation_prompt, bool)
            or not isinstance(special, bool)
        ):
            return "chat_options"
        # rendered from what only the server knows: tools and documents (its own schema of
        # each), a template of the request's own, a continued final message
        if (
            payload.get("tools") is not None
            or payload.get("documents") is not None
            or payload.get("chat_template")
            or payload.get("continue_final_message")
        ):
            return "chat_options"
        return (
            functools.partial(
                template.render,
                messages,
                add_generation_prompt=add_generation_prompt,
                options=options,
            ),
            special,
        )

    def _encode_and_hash(
        self, text: str, special: bool, hashing: Callable[[Sequence[int]], list[int]]
    ) -> tuple[tuple[int, ...], list[int]]:
        """Token ids and block keys of ``text``; touches no shared state (a worker thread
        may run it)."""
        ids = self.keyer.encode(text, special=special)
        return ids, hashing(ids)

    async def start(self) -> None:
        """Starts the shared index (its warm load of the endpoints known so far) and
        subscribes to the events of every endpoint: those seen before the event loop ran,
        and any that joined meanwhile."""
        if self._started or self._stopped or self._feed is None:
            return
        self._started = True
        feed = self._feed
        endpoints = self._datastore.endpoints() if self._datastore is not None else ()
        if isinstance(self.index, SharedKVBlockIndex):
            self.index.start()
            for endpoint in endpoints:
                for key in feed.keys(endpoint.name):
                    self.index.follow(key)
        feed.start_pending()
        for endpoint in endpoints:
            feed.add(endpoint.info)  # idempotent for one already subscribed

    async def stop(self) -> None:
        """Ends the subscriptions, then releases the shared index's writer leases (another
        process takes over). A stopped producer does not start again."""
        if self._stopped:
            return
        self._stopped = True
        if self._feed is not None:
            await self._feed.close()
        if isinstance(self.index, SharedKVBlockIndex):
            await self.index.stop()

    def ready(self) -> bool:
        index = self.index
        return index.warmed if isinstance(index, SharedKVBlockIndex) else True

    async def prepare_request_data(
        self, request: InferenceRequest, candidates: Sequence[Candidate]
    ) -> None:
        if not self._started:  # not started by the app (a test, a reload race)
            await self.start()
        keys = await self._keys(request, candidates)
        if keys is None and self.fallback is not None:
            request.state.put(self._typed_name.name, _FALLBACK, True)
            await self.fallback.prepare_request_data(request, candidates)
            return
        if not keys:
            none = PrefixCacheMatchInfo(0, 0, self._block)
            for candidate in candidates:
                candidate.attributes[PREFIX_CACHE_MATCH_INFO] = none
            return
        request.state.put(self._typed_name.name, _KEYS, keys)
        request.state.put(PREFIX_BLOCKS_OWNER, PREFIX_BLOCKS, PrefixBlocks(keys, self._block))
        total = len(keys)
        names = [c.info.name for c in candidates]
        ranks = self.parameters.kv_events_config.data_parallel_size
        if ranks == 1:
            matches = self.index.match(keys, names)
        else:
            matches, winners = self._match_engines(keys, names, ranks)
            request.state.put(self._typed_name.name, _RANKS, winners)
        if self.shared is not None and not any(matches.get(name) for name in names):
            matches = await self._speculated(request, keys, candidates)
        best = 0
        for candidate in candidates:
            matched = matches.get(candidate.info.name, 0)
            best = max(best, matched)
            candidate.attributes[PREFIX_CACHE_MATCH_INFO] = PrefixCacheMatchInfo(
                matched, total, self._block
            )
        self._observer.histogram(PREFIX_INDEXER_HIT_RATIO, _NO_LABELS, best / total)

    async def _speculated(
        self, request: InferenceRequest, keys: list[int], candidates: Sequence[Candidate]
    ) -> Mapping[str, int]:
        """A prompt no candidate holds a block of: where the pool's processes sent it in
        the last ``speculativeTtl`` (the shared prefix index's current and previous
        windows, matched at once). Nowhere: the request claims it after the pick."""
        shared = self.shared
        assert shared is not None
        window = int(self._clock() // self._window)
        current = _shared_keys(keys, window)
        now, before = await asyncio.gather(
            shared.match(current), shared.match(_shared_keys(keys, window - 1))
        )
        if now or before:
            found = dict(before)
            for name, matched in now.items():
                found[name] = max(matched, found.get(name, 0))
            return found
        state = request.state
        state.put(self._typed_name.name, _SHARED_KEYS, current)
        if isinstance(shared, ClaimingPrefixIndex):
            state.put(self._typed_name.name, _NEW_CHAIN, {c.info.name: c for c in candidates})
        return now

    async def claim_placement(
        self, request: InferenceRequest, result: SchedulingResult
    ) -> Candidate | None:
        """``PlacementClaimer``: a prompt cold everywhere is claimed in the shared prefix
        index for the pick; if another process claimed it first, the request follows that
        process's endpoint when it is one of its candidates. A request on the approximate
        path is claimed by the fallback (its own keys), never twice."""
        name = self._typed_name.name
        state = request.state
        if state.get(name, _FALLBACK):
            if self.fallback is None:
                return None
            return await self.fallback.claim_placement(request, result)
        claim = await claim_new_prefix(
            self.shared,
            state.get(name, _SHARED_KEYS),
            state.get(name, _NEW_CHAIN),
            result,
            datastore=self._datastore,
            capacity=_capacity,
            tokens_per_block=self._block,
            request_id=request.request_id,
        )
        if claim is None:
            return None
        state.put(name, _CLAIMED_FOR, claim.owner)
        return claim.follow

    def _match_engines(
        self, keys: list[int], names: list[str], ranks: int
    ) -> tuple[dict[str, int], dict[str, int]]:
        """Each endpoint's best engine: its match, and which rank it is. Engines hold their
        own caches: a prefix split over two engines is a match on neither."""
        engine_names = [rank_key(name, rank) for name in names for rank in range(ranks)]
        found = self.index.match(keys, engine_names)
        matches: dict[str, int] = {}
        winners: dict[str, int] = {}
        for name in names:
            for rank in range(ranks):
                matched = found.get(rank_key(name, rank), 0)
                if matched > matches.get(name, 0):
                    matches[name] = matched
                    winners[name] = rank
        return matches, winners

    async def pre_request(self, request: InferenceRequest, result: SchedulingResult) -> None:
        if self.fallback is not None and request.state.get(self._typed_name.name, _FALLBACK):
            await self.fallback.pre_request(request, result)
            return
        primary = result.primary
        if primary is None or not primary.target_endpoints:
            return
        target = primary.target_endpoints[0]
        chosen = target.info.name
        await self._share(request, target)
        engine = chosen
        if self.parameters.kv_events_config.data_parallel_size > 1:
            winners = request.state.get(self._typed_name.name, _RANKS) or {}
            rank = winners.get(chosen)
            if rank is None:
                return  # no engine holds the prefix: the server balances its engines
            request.add_upstream_header(DATA_PARALLEL_RANK_HEADER, str(rank))
            engine = rank_key(chosen, rank)
        ttl = self.parameters.speculative_ttl
        keys = request.state.get(self._typed_name.name, _KEYS)
        if ttl > 0 and keys:
            self.index.speculate(engine, keys, ttl)

    async def _share(self, request: InferenceRequest, target: Candidate) -> None:
        """A prompt cold everywhere that the claim did not record for ``target`` (an owner
        not among the candidates, an index that cannot claim): recorded for it in the shared
        prefix index, for the other processes."""
        state = request.state
        name = self._typed_name.name
        keys = state.get(name, _SHARED_KEYS)
        shared = self.shared
        endpoint = target.info.name
        if not keys or shared is None or state.get(name, _CLAIMED_FOR) == endpoint:
            return
        if self._datastore is not None and self._datastore.get(endpoint) is None:
            return  # deleted since scheduling: not resurrected in the index
        await shared.add(keys, endpoint, _capacity(target))


def _capacity(target: Candidate) -> int:
    """The most entries the shared prefix index keeps for ``target``: its KV-cache blocks
    when its metrics report them (one entry per block), else the approximate default."""
    metrics = target.metrics
    if metrics is not None and metrics.cache_num_blocks > 0:
        return metrics.cache_num_blocks
    return _LRU_CAPACITY


def _shared_keys(keys: Sequence[int], window: int) -> list[int]:
    """``keys`` as the shared prefix index holds them in time window ``window``: each XORed
    with a 64-bit mask derived (SplitMix64) from this producer's constant and the window.
    A bijection within a window (distinct keys stay distinct, a chain stays a chain);
    another window's keys, and the approximate producer's character hashes in the same
    index, are other 64-bit values (meeting one is a 1-in-2**64 coincidence, as for any
    two prompts)."""
    z = (_NAMESPACE + window * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    mask = z ^ (z >> 31)
    return [key ^ mask for key in keys]
