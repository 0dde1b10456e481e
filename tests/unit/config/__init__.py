"""Tests of the EndpointPickerConfig loader, and the plugin doubles they share.

The doubles fill the extension points through the same Protocols as real plugins and are
registered under the in-tree type names the loader defaults to (``max-score-picker``,
``single-profile-handler``, ``openai-parser``, ...), so the generic loader rules are tested
without depending on the in-tree plugin implementations.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from domain.plugins.base import (
    EmptyParameters,
    Plugin,
    PluginConfigError,
    PluginRegistry,
    TypedName,
    class_factory,
)
from domain.plugins.handle import Handle
from domain.requestcontrol.interfaces import ResponseInfo
from domain.requesthandling.openai import ParsedRequest
from domain.scheduling.interfaces import CycleState
from domain.scheduling.profile import SchedulerProfile
from domain.scheduling.types import (
    Candidate,
    InferenceRequest,
    ProfileRunResult,
    SchedulingResult,
    ScoredCandidate,
)
from ports.endpoints import EndpointInfo
from tests.support.scheduling import plugin_handle

PREFIX_KEY = "PrefixCacheMatchInfo"
LOAD_KEY = "InFlightLoad"


class Double:
    """A plugin double that keeps the parameters it was built with."""

    def __init__(self, typed_name: TypedName, parameters: Any) -> None:
        self.typed_name = typed_name
        self.parameters = parameters

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.typed_name})"


@dataclass(frozen=True, slots=True, kw_only=True)
class PickerParameters:
    max_num_of_endpoints: int = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefixParameters:
    """Shared by the prefix scorer double and its producer, as in the reference."""

    auto_tune: bool = True
    block_size_tokens: int = 16
    max_prefix_blocks_to_match: int = 256
    lru_capacity_per_server: int = 31250

    def __post_init__(self) -> None:
        if self.block_size_tokens <= 0:
            raise ValueError("blockSizeTokens: must be > 0")


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadParameters:
    """The in-flight load producer double's one parameter."""

    add_estimated_output_tokens: bool = True


@dataclass(frozen=True, slots=True, kw_only=True)
class ChainParameters:
    """What a configurable producer/consumer double declares."""

    produces: tuple[str, ...] = ()
    consumes: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerParameters:
    peer: str = ""


class FilterDouble(Double):
    def filter(
        self, cycle: CycleState, request: InferenceRequest, candidates: Sequence[Candidate]
    ) -> Sequence[Candidate]:
        return candidates


class ScorerDouble(Double):
    category = "Distribution"

    def score(
        self, cycle: CycleState, request: InferenceRequest, candidates: Sequence[Candidate]
    ) -> Sequence[float]:
        return [1.0] * len(candidates)


class PickerDouble(Double):
    def pick(
        self, cycle: CycleState, request: InferenceRequest, scored: Sequence[ScoredCandidate]
    ) -> ProfileRunResult:
        return ProfileRunResult(tuple(s.candidate for s in scored[:1]))


class HandlerDouble(Double):
    def pick_profiles(
        self,
        request: InferenceRequest,
        profiles: Mapping[str, SchedulerProfile],
        results: Mapping[str, ProfileRunResult | None],
    ) -> Mapping[str, SchedulerProfile]:
        return {} if results else profiles

    def process_results(
        self, request: InferenceRequest, results: Mapping[str, ProfileRunResult | None]
    ) -> SchedulingResult:
        return SchedulingResult(profile_results=results, primary_profile_name=next(iter(results)))


class DisaggHandlerDouble(HandlerDouble):
    """Needs its ``decode`` and ``prefill`` profiles."""

    def validate_profiles(self, names: Sequence[str]) -> None:
        for needed in ("decode", "prefill"):
            if needed not in names:
                raise ValueError(f'no scheduling profile named "{needed}"')


class ParserDouble(Double):
    def parse(self, body: bytes, headers: Mapping[str, str]) -> ParsedRequest:
        raise NotImplementedError


class DetectorDouble(FilterDouble):
    """A saturation detector that is also a filter, like ``utilization-detector``."""

    def saturation(self, candidates: Sequence[Candidate]) -> float:
        return 0.0


class PrefixScorerDouble(ScorerDouble):
    category = "Affinity"

    def consumes(self) -> Sequence[str]:
        return (PREFIX_KEY,)

    def producer_parameters(self) -> PrefixParameters:
        parameters: PrefixParameters = self.parameters
        return parameters


class PrefixFilterDouble(FilterDouble):
    """Consumes the prefix key and takes the producer's parameters, without saying so."""

    def consumes(self) -> Sequence[str]:
        return (PREFIX_KEY,)


class ProducerDouble(Double):
    """A DataProducer (and PreRequest) whose keys come from its parameters or class."""

    produced: tuple[str, ...] = ()
    consumed: tuple[str, ...] = ()

    def produces(self) -> Sequence[str]:
        if isinstance(self.parameters, ChainParameters):
            return self.parameters.produces
        return self.produced

    def consumes(self) -> Sequence[str]:
        if isinstance(self.parameters, ChainParameters):
            return self.parameters.consumes
        return self.consumed

    async def prepare_request_data(
        self, request: InferenceRequest, candidates: Sequence[Candidate]
    ) -> None:
        return None

    async def pre_request(self, request: InferenceRequest, result: SchedulingResult) -> None:
        return None


class PrefixProducerDouble(ProducerDouble):
    produced = (PREFIX_KEY,)


class LoadProducerDouble(ProducerDouble):
    """Produces the load key and needs the prefix key (to test transitive defaults)."""

    produced = (LOAD_KEY,)
    consumed = (PREFIX_KEY,)


class ConsumerDouble(Double):
    """Consumes the keys of its ``ChainParameters``; produces nothing."""

    def consumes(self) -> Sequence[str]:
        consumed: tuple[str, ...] = self.parameters.consumes
        return consumed


class HooksDouble(Double):
    """Admitter and response hooks."""

    async def admit_request(
        self, request: InferenceRequest, candidates: Sequence[Candidate]
    ) -> str | None:
        return None

    async def response_header(
        self, request: InferenceRequest, response: ResponseInfo, target: EndpointInfo | None
    ) -> None:
        return None

    async def response_body(
        self, request: InferenceRequest, response: ResponseInfo, target: EndpointInfo | None
    ) -> None:
        return None


class GateDouble(Double):
    """A PreRequest and response-body hook (``kv-capacity-gate``)."""

    async def pre_request(self, request: InferenceRequest, result: SchedulingResult) -> None:
        return None

    async def response_body(
        self, request: InferenceRequest, response: ResponseInfo, target: EndpointInfo | None
    ) -> None:
        return None


class InertDouble(Double):
    """Fills no extension point the loader knows (like a flow-control policy)."""


class SourceDouble(Double):
    """A data source that feeds only extractors whose type ends in ``-extractor``."""

    def validate_extractor(self, extractor: Plugin) -> None:
        if not extractor.typed_name.type.endswith("-extractor"):
            raise ValueError(f"{extractor.typed_name.type} does not read metrics")


class FailingDouble(Double):
    pass


def _failing_factory(name: str, parameters: Any, handle: Handle) -> Plugin:
    raise PluginConfigError("peer: the backend is unreachable")


def _peer_factory(name: str, parameters: PeerParameters, handle: Handle) -> Plugin:
    """Finds a plugin configured before it, by name, through the handle."""
    peer = handle.plugins.get(parameters.peer)
    if peer is None:
        raise PluginConfigError(f'peer: no plugin named "{parameters.peer}" before this one')
    return FilterDouble(TypedName("peer-filter", name), peer)


def make_registry(*, data_layer: bool = True, policies: bool = True) -> PluginRegistry:
    """A fresh registry of doubles under the in-tree type names (and a few test types)."""
    registry = PluginRegistry()

    def add(type_name: str, cls: Any, parameters: type[Any] = EmptyParameters, **kw: Any) -> None:
        registry.register(type_name, class_factory(type_name, cls), parameters=parameters, **kw)

    add("max-score-picker", PickerDouble, PickerParameters)
    add("random-picker", PickerDouble, PickerParameters)
    add("single-profile-handler", HandlerDouble)
    add("disagg-profile-handler", DisaggHandlerDouble)
    add("openai-parser", ParserDouble)
    add("passthrough-parser", ParserDouble)
    add("utilization-detector", DetectorDouble)
    add("queue-scorer", ScorerDouble)
    add("kv-cache-utilization-scorer", ScorerDouble)
    add("prefix-cache-scorer", PrefixScorerDouble, PrefixParameters)
    add("approx-prefix-cache-producer", PrefixProducerDouble, PrefixParameters,
        default_for=(PREFIX_KEY,))  # fmt: skip
    add("inflight-load-producer", LoadProducerDouble, LoadParameters, default_for=(LOAD_KEY,))
    add("prefix-cache-affinity-filter", FilterDouble)
    add("metrics-freshness-filter", FilterDouble)
    add("token-load-scorer", ScorerDouble)
    add("header-based-testing-filter", FilterDouble)
    add("prefix-consumer-filter", PrefixFilterDouble, PrefixParameters)
    add("destination-endpoint-served-verifier", HooksDouble)
    add("kv-capacity-gate", GateDouble)
    add("chain-producer", ProducerDouble, ChainParameters)
    add("key-consumer", ConsumerDouble, ChainParameters)
    add("hooks", HooksDouble)
    add("inert", InertDouble)
    registry.register("failing", _failing_factory, parameters=PeerParameters)
    registry.register("peer-filter", _peer_factory, parameters=PeerParameters)
    if data_layer:
        add("metrics-data-source", SourceDouble)
        add("core-metrics-extractor", InertDouble)
        add("other-extractor", InertDouble)
        add("notification-source", InertDouble)
    if policies:
        add("fcfs-ordering-policy", InertDouble)
        add("global-strict-fairness-policy", InertDouble)
        add("static-usage-limit-policy", InertDouble)
        add("round-robin-fairness-policy", InertDouble)
    return registry


def make_handle() -> Handle:
    """The stdlib codec, a fresh datastore, and hasher/index doubles."""
    return plugin_handle()
