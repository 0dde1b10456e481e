"""``inflight-load-producer``: the requests and tokens this EPP has in flight per endpoint.

A DataProducer, PreRequest and ResponseBodyProcessor in one plugin, and the default
producer of the ``InFlightLoad`` attribute (the config loader creates it when a configured
plugin, such as ``concurrency-detector``, consumes that key and nothing produces it).

Contract:

- ``pre_request`` adds one request and the request's estimated tokens to the FIRST
  endpoint of every profile result that is not ``None``, and remembers in the request
  state what it added, per profile (endpoint name and tokens);
- ``response_body`` releases the ``"prefill"`` profile's share on its first call (the
  start of the response stream: prefill is done once the response starts) and every other
  share on the ``end_of_stream`` call, whatever the outcome (completed, failed, client
  gone). Each share is released exactly once, however many ``end_of_stream`` calls come;
- ``prepare_request_data`` sets ``candidate.attributes[IN_FLIGHT_LOAD]`` to an
  ``InFlightLoad(requests, tokens)`` on every candidate. The same value is also kept on
  the live datastore endpoint's ``attributes`` whenever it changes, so a candidate
  snapshot taken before PrepareData (for instance by admission) already carries it;
- when the datastore deletes an endpoint its counters are dropped; a release that comes
  later for that endpoint changes nothing (it neither goes negative nor brings the
  endpoint back, even if an endpoint of the same name has been added since).

Several EPP processes (the Handle's ``shared_load``, a ``SharedLoad``): the counters above
stay this process's own, exact and synchronous. After each change of an endpoint's
counters the producer publishes its totals for that endpoint, and the ``InFlightLoad`` it
writes, on candidates and on live endpoints, is its own load plus ``others()`` for that
endpoint: the pool's load, which is what ``token-load-scorer`` and ``concurrency-detector``
read. (``utilization-detector`` reads the model servers' own metrics, pool-wide already.)
How stale the others' share is:

- on candidates: ``others()`` as of this request's PrepareData (the shared load's own
  ``staleness``);
- on live endpoints (what admission and flow control snapshot before PrepareData): re-read
  at every PrepareData, PreRequest and response of this process, and every
  ``max(staleness, 20 ms)`` by a timer started with the first request, so a queued request
  sees others' releases within that period even while nothing else runs here.

With the default ``LocalSharedLoad`` (one process) ``others()`` is always empty: nothing is
published, no timer runs, and the values are exactly the own counters.

Counters never go below zero. The tokens booked for a request on an endpoint are its
uncached input tokens there, ``input`` minus the tokens of the prefix blocks the endpoint
holds (its ``PrefixCacheMatchInfo``, when a prefix producer runs), plus, with
``addEstimatedOutputTokens`` (the default), ``round(input * 1.5)`` expected output tokens.
``input`` is ``domain.scheduling.load.input_tokens``: the request size in bytes / 4 (at
least 1) when the size is known, else the number of token ids of a completions prompt given
as token ids, else round(characters / 4) of the request's prefix input. Rounding is half
away from zero.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from domain.datalayer.attributes import IN_FLIGHT_LOAD, InFlightLoad
from domain.datastore.endpoint import Endpoint
from domain.plugins.base import Plugin, PluginRegistry, TypedName
from domain.plugins.handle import Handle
from domain.plugins.hooks import ConsumerPlugin, ProducerPlugin
from domain.plugins.state import StateKey
from domain.requestcontrol.interfaces import ResponseInfo
from domain.scheduling.load import input_tokens, round_half_up, uncached_tokens
from domain.scheduling.types import Candidate, InferenceRequest, SchedulingResult
from domain.sharedstate.load import LocalSharedLoad
from ports.codec import JsonCodec
from ports.endpoints import EndpointEvent, EndpointEventKind, EndpointInfo
from ports.shared_state import EndpointLoad

__all__ = [
    "TYPE",
    "InFlightLoadParameters",
    "InFlightLoadProducer",
    "estimate_tokens",
    "register",
]

logger = logging.getLogger(__name__)

TYPE = "inflight-load-producer"
#: The profile whose share is released as soon as the response starts.
PREFILL_PROFILE = "prefill"

_IDLE = InFlightLoad(0, 0)
_OUTPUT_FACTOR = 1.5
#: The shortest period of the live endpoints' refresh from ``others()``, in seconds.
MIN_REFRESH_INTERVAL = 0.02
_NOBODY: Mapping[str, EndpointLoad] = {}


class _Counter:
    """The load of one endpoint. Detached (no longer in the producer's map) once the
    endpoint is deleted or its load drops to zero; releases then only touch this object."""

    __slots__ = ("endpoint", "load", "name")

    def __init__(self, name: str, endpoint: Endpoint) -> None:
        self.name = name
        self.endpoint = endpoint
        self.load = _IDLE


@dataclass(frozen=True, slots=True)
class _Share:
    """What ``pre_request`` added to one endpoint for one profile."""

    counter: _Counter
    tokens: int


#: profile name → share, for the shares this request still holds.
_HELD: StateKey[dict[str, _Share]] = StateKey("inflight-load.held")


def _pool_load(own: InFlightLoad, other: EndpointLoad | None) -> InFlightLoad:
    if other is None:
        return own
    if own is _IDLE:
        return InFlightLoad(other.requests, other.tokens)
    return InFlightLoad(own.requests + other.requests, own.tokens + other.tokens)


def estimate_tokens(request: InferenceRequest, codec: JsonCodec, *, output: bool = True) -> int:
    """Input plus (with ``output``) expected output tokens of ``request`` (see the module
    docstring)."""
    tokens = input_tokens(request, codec)
    if output:
        tokens += round_half_up(tokens * _OUTPUT_FACTOR)
    return tokens


@dataclass(frozen=True, slots=True, kw_only=True)
class InFlightLoadParameters:
    """``addEstimatedOutputTokens`` (true): book the expected output tokens
    (1.5 x input) with each request besides its uncached input tokens."""

    add_estimated_output_tokens: bool = True


class InFlightLoadProducer(ProducerPlugin, ConsumerPlugin):
    """Tracks per-endpoint in-flight requests and tokens; see the module docstring."""

    def __init__(
        self,
        typed_name: TypedName,
        handle: Handle,
        parameters: InFlightLoadParameters | None = None,
    ) -> None:
        self._typed_name = typed_name
        self._add_output = (parameters or InFlightLoadParameters()).add_estimated_output_tokens
        self._codec = handle.codec
        self._datastore = handle.datastore
        self._counters: dict[str, _Counter] = {}
        #: endpoint name → the pool's load (own + others) when not idle: what is shown.
        self._shown: dict[str, InFlightLoad] = {}
        shared = handle.shared_load
        self._shared = shared
        #: False for ``LocalSharedLoad``: nothing to publish, nobody else to read.
        self._pooled = not isinstance(shared, LocalSharedLoad)
        self._others: Mapping[str, EndpointLoad] = _NOBODY
        self._refresh_interval = max(shared.staleness, MIN_REFRESH_INTERVAL)
        self._timer: asyncio.TimerHandle | None = None
        handle.datastore.subscribe(self._on_endpoint_event)

    @property
    def typed_name(self) -> TypedName:
        return self._typed_name

    # DataProducer
    def produces(self) -> Sequence[str]:
        return (IN_FLIGHT_LOAD,)

    def consumes(self) -> Sequence[str]:
        return ()

    async def prepare_request_data(
        self, request: InferenceRequest, candidates: Sequence[Candidate]
    ) -> None:
        if self._pooled:
            # The pool's load as of now (one round trip, joined by concurrent requests,
            # within the shared state's budget): a decision taken on a copy up to a refresh
            # period old would not see what other processes placed meanwhile.
            await self._shared.refresh()
            self._refresh()
        shown = self._shown
        for candidate in candidates:
            candidate.attributes[IN_FLIGHT_LOAD] = shown.get(candidate.info.name, _IDLE)

    # PreRequest
    async def pre_request(self, request: InferenceRequest, result: SchedulingResult) -> None:
        if self._pooled:
            self._refresh()
        owner = self._typed_name.name
        held = request.state.get(owner, _HELD)
        if held is None:
            held = {}
            request.state.put(owner, _HELD, held)
        prompt = -1
        for profile, run in result.profile_results.items():
            if run is None or not run.target_endpoints or profile in held:
                continue
            if prompt < 0:
                prompt = input_tokens(request, self._codec)
            target = run.target_endpoints[0]
            tokens = uncached_tokens(target, prompt)
            if self._add_output:
                tokens += round_half_up(prompt * _OUTPUT_FACTOR)
            counter = self._counters.get(target.info.name)
            if counter is None:
                counter = _Counter(target.info.name, target.endpoint)
                self._counters[counter.name] = counter
            self._change(counter, 1, tokens)
            held[profile] = _Share(counter, tokens)

    # ResponseBodyProcessor: the first chunk (a prefill share) and the end only
    reads_response_chunks = False

    async def response_body(
        self, request: InferenceRequest, response: ResponseInfo, target: EndpointInfo | None
    ) -> None:
        held = request.state.get(self._typed_name.name, _HELD)
        if not held:
            return
        if self._pooled:
            self._refresh()
        share = held.pop(PREFILL_PROFILE, None)
        if share is not None:
            self._release(share)
        if response.end_of_stream:
            for share in held.values():
                self._release(share)
            held.clear()

    def _release(self, share: _Share) -> None:
        counter = share.counter
        self._change(counter, -1, -share.tokens)
        if counter.load is _IDLE and self._counters.get(counter.name) is counter:
            del self._counters[counter.name]

    def _change(self, counter: _Counter, requests: int, tokens: int) -> None:
        new_requests = max(0, counter.load.requests + requests)
        new_tokens = max(0, counter.load.tokens + tokens)
        if new_requests == 0 and new_tokens == 0:
            load = _IDLE
        else:
            load = InFlightLoad(new_requests, new_tokens)
        counter.load = load
        name = counter.name
        if self._counters.get(name) is not counter:  # endpoint deleted: shown nowhere
            counter.endpoint.attributes[IN_FLIGHT_LOAD] = load
            return
        if self._pooled:
            self._shared.publish(name, EndpointLoad(new_requests, new_tokens))
            load = _pool_load(load, self._others.get(name))
        if load is _IDLE:
            self._shown.pop(name, None)
        else:
            self._shown[name] = load
        counter.endpoint.attributes[IN_FLIGHT_LOAD] = load

    # The others' load
    def _refresh(self) -> None:
        """Show the current ``others()`` on every endpoint whose share changed."""
        others = self._shared.others()
        if self._timer is None:
            self._arm()
        if others is self._others:
            return
        before = self._others
        self._others = others
        counters = self._counters
        shown = self._shown
        datastore = self._datastore
        for name in {*before, *others}:
            other = others.get(name)
            if before.get(name) == other:
                continue
            counter = counters.get(name)
            load = _pool_load(counter.load if counter is not None else _IDLE, other)
            if load is _IDLE:
                shown.pop(name, None)
            else:
                shown[name] = load
            endpoint = counter.endpoint if counter is not None else datastore.get(name)
            if endpoint is not None:
                endpoint.attributes[IN_FLIGHT_LOAD] = load

    def _arm(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._timer = loop.call_later(self._refresh_interval, self._tick)

    def _tick(self) -> None:
        self._timer = None
        self._refresh()

    def close(self) -> None:
        """Stop the refresh timer (it restarts with the next request)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _on_endpoint_event(self, event: EndpointEvent, endpoint: Endpoint) -> None:
        name = endpoint.name
        if event.kind is not EndpointEventKind.DELETE:
            load = self._shown.get(name)
            if load is not None and endpoint.attributes.get(IN_FLIGHT_LOAD) is not load:
                endpoint.attributes[IN_FLIGHT_LOAD] = load  # others' load on a new entry
            return
        self._shown.pop(name, None)
        if self._pooled:
            self._shared.remove_endpoint(name)
        if self._counters.pop(name, None) is not None:
            logger.debug("in-flight counters of deleted endpoint %s dropped", name)


def _factory(name: str, parameters: InFlightLoadParameters, handle: Handle) -> Plugin:
    return InFlightLoadProducer(TypedName(TYPE, name), handle, parameters)


def register(registry: PluginRegistry) -> None:
    registry.register(
        TYPE,
        _factory,
        parameters=InFlightLoadParameters,
        default_for=(IN_FLIGHT_LOAD,),
        description="tracks the requests and tokens in flight per endpoint",
    )
