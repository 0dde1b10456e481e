"""``kv-capacity-gate``: hold a scheduled request in the EPP until its endpoint has KV-cache
room for it, then let the held requests in cache hits first.

Why. A model server admits waiting requests in arrival order and stops at the first one
whose blocks do not fit (vLLM's FCFS scheduler: head-of-line blocking). When prefixes are
sticky, most requests an endpoint gets reuse a prefix it holds and need a few blocks, while
a request with a new prefix needs many; queued behind the latter, the former wait, and the
cached prefixes they would have reused age out meanwhile. The gate keeps that queue in the
EPP instead and, each time room frees up, sends the held requests that fit, those with the
longest cached prefix on the endpoint first. ``tests.bench.routing_quality`` measures it
(README "Routing quality").

How room is counted, per endpoint, for the requests this plugin let through and has not
seen end (and other processes' load, see the end):

- a request's *footprint* is its prompt's prefix blocks (the ``PrefixBlocks`` the prefix
  producer, approximate or precise, leaves in the request's state; a block shared by
  several requests counts once, as in the server's cache) plus its blocks that are not
  shared: the rest of its prompt (input tokens beyond the hashed blocks, rounded up to
  blocks) and one block for its output. Without ``PrefixBlocks`` the whole prompt counts
  as not shared (input tokens as ``inflight-load-producer`` estimates them);
- the endpoint's *capacity* is its KV cache as scraped: ``cache_num_blocks`` x
  ``cache_block_size`` tokens, in the footprint's blocks. An endpoint whose metrics give no
  cache size is never held for;
- a request *fits* when the blocks of every counted request plus its own new ones stay
  within the capacity. The first request on an endpoint always fits.

The rules:

- ``pre_request`` (the primary profile's first endpoint): a request that fits, with
  nothing held for that endpoint that fits better, goes on at once. Otherwise it waits,
  at most ``maxHoldMs``; past that it goes on regardless (the server queues it as it
  would without the gate). ``maxHoldMs: 0`` never holds (the footprints are still counted);
- the gate holds for an endpoint only while at least ``MIN_HIT_SHARE`` of the requests
  recently scheduled there had a prefix match on it (a moving average, ``HIT_SHARE_WEIGHT``
  per request; it starts at 0). With no cache hits to let pass, holding would only add the
  hand-off from the EPP to the server to the wait: such requests go on at once, and any
  still held go with them;
- when a request the gate let through ends (``response_body`` with ``end_of_stream``,
  whatever the outcome: completed, failed, client gone), its footprint is released and the
  held requests of that endpoint are looked at, best first: the longest prefix match on
  the endpoint at scheduling time (``PrefixCacheMatchInfo``), then arrival order. Each one
  that fits goes on; at most ``MAX_SCAN`` are looked at per release, so a long queue costs
  a bounded amount per release (the rest wait for the next release or their deadline);
- a held request whose client goes away leaves the queue; when the endpoint is deleted,
  its held requests go on at once (to their fallbacks, if any).

Several EPP processes (replicas or workers sharing state):

- with the pool's blocks (the Handle's ``shared_kv_blocks``: ``--redis-url`` and
  ``--redis-shared-admission``, the default), each gate publishes, per endpoint, the prefix
  blocks its counted requests hold and their blocks that are not shared, and counts the
  blocks the other processes' requests hold there beyond its own: a prefix block held by
  requests of several processes counts once, as in the server's cache, so the fit test is
  the one a single process would make, up to ``SharedLoad.staleness`` old and estimated
  from one prefix hash in 16 (``estimate_pool_blocks``: exact when the processes hold the
  same prefixes or different ones);
- otherwise (or for an endpoint no other gate publishes blocks for, or while the pool's
  copy is older than its lease: the store is down) the other processes' in-flight load on
  the endpoint, as the ``inflight-load-producer`` publishes it (their uncached input tokens
  and requests, the Handle's ``shared_load``), counts as that many blocks plus one output
  block per request: an estimate that misses the cached prefix blocks their requests hold.

Their requests end without a release here, so while requests are held the gate looks
again every ``max(staleness, MIN_RECHECK_INTERVAL)``. Where the count is short, the servers
queue the rest, as they would without the gate.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from domain.datalayer.attributes import PREFIX_CACHE_MATCH_INFO, PrefixCacheMatchInfo
from domain.datastore.endpoint import Endpoint
from domain.plugins.base import Plugin, PluginRegistry, TypedName
from domain.plugins.handle import Handle
from domain.plugins.state import StateKey
from domain.requestcontrol.interfaces import ResponseInfo
from domain.scheduling.load import PREFIX_BLOCKS, PREFIX_BLOCKS_OWNER, input_tokens
from domain.scheduling.types import Candidate, InferenceRequest, SchedulingResult
from domain.sharedstate.load import LocalSharedLoad
from ports.codec import JsonCodec
from ports.endpoints import EndpointEvent, EndpointEventKind, EndpointInfo
from ports.metric_catalogue import KV_GATE_HELD, KV_GATE_WAIT
from ports.shared_state import HASH_MASK, SAMPLE_MASK, EndpointLoad, PoolBlocks, SharedKVBlocks

__all__ = [
    "HIT_SHARE_WEIGHT",
    "MAX_SCAN",
    "MIN_HIT_SHARE",
    "MIN_RECHECK_INTERVAL",
    "TYPE",
    "KVCapacityGate",
    "KVCapacityGateParameters",
    "register",
]

TYPE = "kv-capacity-gate"
#: Held requests looked at per release, best first.
MAX_SCAN = 32
#: The gate holds requests for an endpoint only while at least this share of the requests
#: scheduled there lately matched a prefix it holds (a moving average, ``HIT_SHARE_WEIGHT``
#: per request): with no cache hits to let pass, the server's queue does as well.
MIN_HIT_SHARE = 0.1
HIT_SHARE_WEIGHT = 1 / 32
#: The shortest period between looks at the held requests when other processes' requests
#: may have ended (``SharedLoad.staleness`` when longer).
MIN_RECHECK_INTERVAL = 0.02
_NO_LABELS: dict[str, str] = {}
#: Block size (tokens) of a footprint counted without the prefix producer's blocks.
_DEFAULT_BLOCK_TOKENS = 16


@dataclass(frozen=True, slots=True, kw_only=True)
class KVCapacityGateParameters:
    """``maxHoldMs`` (1000, >= 0): the longest a request waits for room; 0 never holds."""

    max_hold_ms: float = 1000.0

    def __post_init__(self) -> None:
        if not 0 <= self.max_hold_ms < float("inf"):
            raise ValueError("maxHoldMs: must be a finite number >= 0")


class _Footprint:
    """What one request occupies on an endpoint: shared prefix blocks and its own."""

    __slots__ = ("hashes", "own", "tokens_per_block")

    def __init__(self, hashes: Sequence[int], own: int, tokens_per_block: int) -> None:
        self.hashes = hashes
        self.own = own
        self.tokens_per_block = tokens_per_block


class _Endpoint:
    """One endpoint's counted requests and held ones."""

    __slots__ = ("capacity_tokens", "held", "hit_share", "own", "refs", "requests")

    def __init__(self) -> None:
        #: moving share of the requests scheduled here with a prefix match
        self.hit_share = 0.0
        #: the KV cache in tokens, as of the last request scheduled here (0: unknown)
        self.capacity_tokens = 0
        #: prefix block hash -> counted requests holding it
        self.refs: dict[int, int] = {}
        #: blocks of the counted requests that are not shared
        self.own = 0
        self.requests = 0
        #: held requests, best first
        self.held: list[_Held] = []

    def fits(self, footprint: _Footprint, others: EndpointLoad | PoolBlocks | None) -> bool:
        """Whether ``footprint`` fits beside the counted requests and the other EPP
        processes' here: the blocks they hold beyond this process's (``PoolBlocks``; the
        prefix blocks of ``footprint`` they hold are not new), or their in-flight load
        (their uncached tokens, in blocks, and one output block per request)."""
        per_block = footprint.tokens_per_block
        capacity = self.capacity_tokens // per_block
        used = len(self.refs) + self.own
        hashes = footprint.hashes
        if isinstance(others, PoolBlocks):
            if others.count > 0:
                used += others.count
                hashes = hashes[_held_elsewhere(hashes, others.sampled) :]
            elif self.requests == 0:
                return True
        elif others is not None and others.requests > 0:
            used += -(-others.tokens // per_block) + others.requests
        elif self.requests == 0:
            return True
        if capacity <= 0:
            return True
        room = capacity - used - footprint.own
        if room < 0:
            return False
        # Stop counting the blocks it would add once they exceed the room: a request that
        # does not fit costs at most the room in lookups, however long its prompt.
        refs = self.refs
        for h in hashes:
            if h not in refs:
                room -= 1
                if room < 0:
                    return False
        return True

    def add(self, footprint: _Footprint) -> list[int]:
        """Count ``footprint``; returns the prefix blocks it is the first to hold."""
        refs = self.refs
        new: list[int] = []
        for h in footprint.hashes:
            held = refs.get(h, 0)
            if not held:
                new.append(h)
            refs[h] = held + 1
        self.own += footprint.own
        self.requests += 1
        return new

    def remove(self, footprint: _Footprint) -> list[int]:
        """Stop counting ``footprint``; returns the prefix blocks no request holds now."""
        refs = self.refs
        freed: list[int] = []
        for h in footprint.hashes:
            left = refs.get(h, 0) - 1
            if left > 0:
                refs[h] = left
            elif refs.pop(h, None) is not None:
                freed.append(h)
        self.own = max(0, self.own - footprint.own)
        self.requests = max(0, self.requests - 1)
        return freed


class _Held:
    """A request waiting for room: its rank (best first) and the future that lets it go."""

    __slots__ = ("footprint", "future", "outcome", "rank")

    def __init__(
        self, rank: tuple[int, int], footprint: _Footprint, future: asyncio.Future[None]
    ) -> None:
        self.rank = rank
        self.footprint = footprint
        self.future = future
        #: how it left the wait when its future was set: let in, or its endpoint deleted
        self.outcome = "let_in"

    def __lt__(self, other: _Held) -> bool:
        return self.rank < other.rank


@dataclass(slots=True)
class _Counted:
    """A request the gate let through and has not seen end."""

    name: str
    endpoint: _Endpoint
    footprint: _Footprint


_COUNTED: StateKey[_Counted] = StateKey("kv-capacity-gate.counted")


class KVCapacityGate:
    """Holds requests until their endpoint has KV room; see the module docstring."""

    def __init__(
        self, typed_name: TypedName, parameters: KVCapacityGateParameters, handle: Handle
    ) -> None:
        self._typed_name = typed_name
        self.parameters = parameters
        self._max_hold = parameters.max_hold_ms / 1000.0
        self._codec: JsonCodec = handle.codec
        self._observer = handle.observer
        self._clock = handle.clock
        self._endpoints: dict[str, _Endpoint] = {}
        #: requests waiting now, on every endpoint (the held-requests gauge)
        self._waiting = 0
        self._arrivals = itertools.count()
        shared = handle.shared_load
        self._shared = shared
        #: False for ``LocalSharedLoad``: no other process's load to read or wait for.
        self._pooled = not isinstance(shared, LocalSharedLoad)
        #: the pool's blocks per endpoint (None: not shared, the load estimate counts)
        self._pool: SharedKVBlocks | None = handle.shared_kv_blocks if self._pooled else None
        self._recheck_interval = max(shared.staleness, MIN_RECHECK_INTERVAL)
        self._timer: asyncio.TimerHandle | None = None
        handle.datastore.subscribe(self._on_endpoint_event)

    @property
    def typed_name(self) -> TypedName:
        return self._typed_name

    def held(self, endpoint: str) -> int:
        """How many requests wait for ``endpoint`` now."""
        state = self._endpoints.get(endpoint)
        return len(state.held) if state is not None else 0

    # PreRequest
    async def pre_request(self, request: InferenceRequest, result: SchedulingResult) -> None:
        primary = result.primary
        if primary is None or not primary.target_endpoints:
            return
        owner = self._typed_name.name
        if request.state.get(owner, _COUNTED) is not None:
            return  # already through
        target = primary.target_endpoints[0]
        name = target.info.name
        state = self._endpoints.get(name)
        if state is None:
            state = self._endpoints[name] = _Endpoint()
        state.capacity_tokens = _capacity_tokens(target)
        footprint = self._footprint(request)
        info = target.attributes.get(PREFIX_CACHE_MATCH_INFO)
        matched = info.match_blocks if isinstance(info, PrefixCacheMatchInfo) else 0
        state.hit_share += ((1.0 if matched else 0.0) - state.hit_share) * HIT_SHARE_WEIGHT
        if self._max_hold <= 0 or state.capacity_tokens <= 0:
            self._count(request, name, state, footprint)
            return
        if state.hit_share < MIN_HIT_SHARE:
            # Nothing to let pass: the server's own queue serves these as well, sooner.
            self._let_all_in(name, state, "let_in")
            self._count(request, name, state, footprint)
            return
        if not state.held and state.fits(footprint, self._others(name)):
            self._count(request, name, state, footprint)
            return
        future = asyncio.get_running_loop().create_future()
        waiter = _Held((-matched, next(self._arrivals)), footprint, future)
        bisect.insort(state.held, waiter)
        self._let_in(name, state)
        if not future.done():
            await self._wait(name, state, waiter)
        if future.done():
            # Let in by a release (or the endpoint's deletion): already counted there.
            self._record(request, name, state, footprint)
            return
        future.cancel()
        _discard(state.held, waiter)  # waited maxHoldMs: goes on regardless
        self._count(request, name, state, footprint)

    async def _wait(self, name: str, state: _Endpoint, waiter: _Held) -> None:
        """Until ``waiter`` is let in or ``maxHoldMs`` has passed; a cancellation (the
        client left) takes it out of the queue, or gives back the room it was let into."""
        future = waiter.future
        started = self._clock()
        self._held(1)
        outcome = "deadline"
        try:
            # Not ``wait_for``: it swallows a cancellation that comes as the future
            # completes, and a client gone must not be forwarded. The shield keeps the
            # deadline from cancelling the future, which means "let in" once done.
            async with asyncio.timeout(self._max_hold):
                await asyncio.shield(future)
        except TimeoutError:
            pass
        except asyncio.CancelledError:
            outcome = "gone"
            if future.done():
                self._remove(name, state, waiter.footprint)
                self._let_in(name, state)
            else:
                future.cancel()
                _discard(state.held, waiter)
            raise
        finally:
            self._held(-1)
            if future.done() and outcome != "gone":
                outcome = waiter.outcome
            self._observer.histogram(KV_GATE_WAIT, {"outcome": outcome}, self._clock() - started)

    def _held(self, change: int) -> None:
        self._waiting += change
        self._observer.gauge(KV_GATE_HELD, _NO_LABELS, self._waiting)

    def _count(
        self, request: InferenceRequest, name: str, state: _Endpoint, footprint: _Footprint
    ) -> None:
        self._add(name, state, footprint)
        self._record(request, name, state, footprint)

    def _add(self, name: str, state: _Endpoint, footprint: _Footprint) -> None:
        new = state.add(footprint)
        if self._pool is not None:
            self._pool.publish_blocks(name, new, (), state.own)

    def _remove(self, name: str, state: _Endpoint, footprint: _Footprint) -> None:
        freed = state.remove(footprint)
        if self._pool is not None:
            self._pool.publish_blocks(name, (), freed, state.own)

    def _record(
        self, request: InferenceRequest, name: str, state: _Endpoint, footprint: _Footprint
    ) -> None:
        """Remember that ``request`` is counted on ``name`` (released at its end)."""
        request.state.put(self._typed_name.name, _COUNTED, _Counted(name, state, footprint))

    def _footprint(self, request: InferenceRequest) -> _Footprint:
        blocks = request.state.get(PREFIX_BLOCKS_OWNER, PREFIX_BLOCKS)
        hashes = blocks.hashes if blocks is not None else ()
        per_block = blocks.block_size_tokens if blocks is not None else _DEFAULT_BLOCK_TOKENS
        rest = max(0, input_tokens(request, self._codec) - len(hashes) * per_block)
        return _Footprint(hashes, -(-rest // per_block) + 1, per_block)

    def _others(self, name: str) -> EndpointLoad | PoolBlocks | None:
        """The other processes' use of endpoint ``name``: the blocks they hold beyond this
        process's when the pool shares them, else their in-flight load (see the module)."""
        if not self._pooled:
            return None
        if self._pool is not None:
            blocks = self._pool.kv_blocks()
            if blocks:
                return blocks.get(name, _NO_POOL_BLOCKS)
        return self._shared.others().get(name)

    def _let_in(self, name: str, state: _Endpoint) -> None:
        """Let the held requests of endpoint ``name`` that fit go on, best first."""
        others = self._others(name)
        held = state.held
        index = 0
        scanned = 0
        while index < len(held) and scanned < MAX_SCAN:
            scanned += 1
            waiter = held[index]
            if waiter.future.done():
                del held[index]
                continue
            if not state.fits(waiter.footprint, others):
                index += 1
                continue
            del held[index]
            # Counted now, so the next fit test sees it; the waiter only records it.
            self._add(name, state, waiter.footprint)
            waiter.future.set_result(None)
        if held and self._pooled and self._timer is None:
            # Other processes' requests end without telling this one: look again later.
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(self._recheck_interval, self._recheck)

    def _recheck(self) -> None:
        self._timer = None
        for name, state in list(self._endpoints.items()):
            if state.held:
                self._let_in(name, state)

    def _let_all_in(self, name: str, state: _Endpoint, outcome: str) -> None:
        """Let every held request of ``state`` go on, room or not."""
        for waiter in state.held:
            if not waiter.future.done():
                self._add(name, state, waiter.footprint)
                waiter.outcome = outcome
                waiter.future.set_result(None)
        state.held.clear()

    # ResponseBodyProcessor: the end only
    reads_response_chunks = False

    async def response_body(
        self, request: InferenceRequest, response: ResponseInfo, target: EndpointInfo | None
    ) -> None:
        if not response.end_of_stream:
            return
        counted = request.state.pop(self._typed_name.name, _COUNTED)
        if counted is None:
            return
        state = counted.endpoint
        self._remove(counted.name, state, counted.footprint)
        if state.held:
            self._let_in(counted.name, state)

    def _on_endpoint_event(self, event: EndpointEvent, endpoint: Endpoint) -> None:
        if event.kind is not EndpointEventKind.DELETE:
            return
        state = self._endpoints.pop(endpoint.name, None)
        if state is None:
            return
        self._let_all_in(endpoint.name, state, "deleted")


_NO_POOL_BLOCKS = PoolBlocks()


def _held_elsewhere(hashes: Sequence[int], sampled: frozenset[int]) -> int:
    """How many of ``hashes`` (a chain) other processes' requests hold, as far as their
    sampled hashes tell: up to the last one of ``hashes`` among them."""
    if not sampled:
        return 0
    for i in range(len(hashes) - 1, -1, -1):
        h = hashes[i] & HASH_MASK
        if not h & SAMPLE_MASK and h in sampled:
            return i + 1
    return 0


def _capacity_tokens(target: Candidate) -> int:
    """The endpoint's KV cache in tokens, as scraped (0: unknown)."""
    metrics = target.metrics
    if metrics is None or metrics.cache_num_blocks <= 0 or metrics.cache_block_size <= 0:
        return 0
    return metrics.cache_num_blocks * metrics.cache_block_size


def _discard(held: list[_Held], waiter: _Held) -> None:
    index = bisect.bisect_left(held, waiter)
    if index < len(held) and held[index] is waiter:
        del held[index]


def _factory(name: str, parameters: KVCapacityGateParameters, handle: Handle) -> Plugin:
    return KVCapacityGate(TypedName(TYPE, name), parameters, handle)


def register(registry: PluginRegistry) -> None:
    registry.register(
        TYPE,
        _factory,
        parameters=KVCapacityGateParameters,
        description="holds a request until its endpoint has KV-cache room, cache hits first",
    )
