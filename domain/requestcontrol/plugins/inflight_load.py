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

Counters never go below zero. The token estimate of a request (see ``estimate_tokens``) is
``input + round(input * 1.5)`` where ``input`` is the request size in bytes / 4 (at least
1) when the size is known, else the number of token ids of a completions prompt given as
token ids, else round(characters / 4) of the request's prefix input. Rounding is half away
from zero.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from domain.datalayer.attributes import IN_FLIGHT_LOAD, InFlightLoad
from domain.datastore.endpoint import Endpoint
from domain.plugins.base import EmptyParameters, Plugin, PluginRegistry, TypedName
from domain.plugins.handle import Handle
from domain.plugins.hooks import ConsumerPlugin, ProducerPlugin
from domain.plugins.state import StateKey
from domain.requestcontrol.interfaces import ResponseInfo
from domain.requesthandling.openai import ApiKind, ParsedRequest
from domain.scheduling.types import Candidate, InferenceRequest, SchedulingResult
from ports.codec import JsonCodec
from ports.endpoints import EndpointEvent, EndpointEventKind, EndpointInfo

__all__ = ["TYPE", "InFlightLoadProducer", "estimate_tokens", "register"]

logger = logging.getLogger(__name__)

TYPE = "inflight-load-producer"
#: The profile whose share is released as soon as the response starts.
PREFILL_PROFILE = "prefill"

_IDLE = InFlightLoad(0, 0)
_OUTPUT_FACTOR = 1.5


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


def _round_half_up(value: float) -> int:
    return int(value + 0.5)


def _token_id_count(body: ParsedRequest) -> int:
    """The number of token ids of a completions prompt given as token ids, else 0."""
    if body.api is not ApiKind.COMPLETIONS or body.opaque:
        return 0
    prompt: Any = body.payload.get("prompt")
    if not isinstance(prompt, list) or not prompt:
        return 0
    first = prompt[0]
    if isinstance(first, list):
        return sum(len(item) for item in prompt if isinstance(item, list))
    if isinstance(first, int | float) and not isinstance(first, bool):
        return len(prompt)
    return 0


def estimate_tokens(request: InferenceRequest, codec: JsonCodec) -> int:
    """Input plus expected output tokens of ``request`` (see the module docstring)."""
    if request.request_size_bytes > 0:
        input_tokens = max(1, request.request_size_bytes // 4)
    elif request.body is None:
        input_tokens = 0
    else:
        input_tokens = _token_id_count(request.body)
        if input_tokens == 0:
            text = request.body.prefix_input(codec).decode("utf-8", errors="replace")
            input_tokens = _round_half_up(len(text) / 4)
    return input_tokens + _round_half_up(input_tokens * _OUTPUT_FACTOR)


class InFlightLoadProducer(ProducerPlugin, ConsumerPlugin):
    """Tracks per-endpoint in-flight requests and tokens; see the module docstring."""

    def __init__(self, typed_name: TypedName, handle: Handle) -> None:
        self._typed_name = typed_name
        self._codec = handle.codec
        self._counters: dict[str, _Counter] = {}
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
        counters = self._counters
        for candidate in candidates:
            counter = counters.get(candidate.info.name)
            candidate.attributes[IN_FLIGHT_LOAD] = counter.load if counter else _IDLE

    # PreRequest
    async def pre_request(self, request: InferenceRequest, result: SchedulingResult) -> None:
        owner = self._typed_name.name
        held = request.state.get(owner, _HELD)
        if held is None:
            held = {}
            request.state.put(owner, _HELD, held)
        tokens = -1
        for profile, run in result.profile_results.items():
            if run is None or not run.target_endpoints or profile in held:
                continue
            if tokens < 0:
                tokens = estimate_tokens(request, self._codec)
            target = run.target_endpoints[0]
            counter = self._counters.get(target.info.name)
            if counter is None:
                counter = _Counter(target.info.name, target.endpoint)
                self._counters[counter.name] = counter
            self._change(counter, 1, tokens)
            held[profile] = _Share(counter, tokens)

    # ResponseBodyProcessor
    async def response_body(
        self, request: InferenceRequest, response: ResponseInfo, target: EndpointInfo | None
    ) -> None:
        held = request.state.get(self._typed_name.name, _HELD)
        if not held:
            return
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

    @staticmethod
    def _change(counter: _Counter, requests: int, tokens: int) -> None:
        new_requests = max(0, counter.load.requests + requests)
        new_tokens = max(0, counter.load.tokens + tokens)
        if new_requests == 0 and new_tokens == 0:
            load = _IDLE
        else:
            load = InFlightLoad(new_requests, new_tokens)
        counter.load = load
        counter.endpoint.attributes[IN_FLIGHT_LOAD] = load

    def _on_endpoint_event(self, event: EndpointEvent, endpoint: Endpoint) -> None:
        if event.kind is not EndpointEventKind.DELETE:
            return
        if self._counters.pop(endpoint.name, None) is not None:
            logger.debug("in-flight counters of deleted endpoint %s dropped", endpoint.name)


def _factory(name: str, parameters: Any, handle: Handle) -> Plugin:
    return InFlightLoadProducer(TypedName(TYPE, name), handle)


def register(registry: PluginRegistry) -> None:
    registry.register(
        TYPE,
        _factory,
        parameters=EmptyParameters,
        default_for=(IN_FLIGHT_LOAD,),
        description="tracks the requests and tokens in flight per endpoint",
    )
