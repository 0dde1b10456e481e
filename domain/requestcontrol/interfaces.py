"""Request-control extension points: around scheduling and on the response path."""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from domain.plugins.base import TypedName
from domain.requesthandling.openai import ParsedRequest
from domain.requesthandling.usage import Usage
from domain.scheduling.types import Candidate, InferenceRequest, SchedulingResult
from ports.endpoints import EndpointInfo

__all__ = [
    "Admitter",
    "CapacityDetector",
    "DataProducer",
    "Parser",
    "PlacementClaimer",
    "PreRequest",
    "ResponseBodyProcessor",
    "ResponseHeaderProcessor",
    "ResponseInfo",
    "ResponseOutcome",
    "SaturationDetector",
]


class ResponseOutcome(enum.Enum):
    """How a response ended, told to the final response-body hook."""

    PENDING = "pending"  # not ended yet (intermediate chunks)
    COMPLETED = "completed"  # the model server's response arrived whole with a 2xx status
    FAILED = "failed"  # the model server answered with an error status
    CLIENT_GONE = "client-gone"  # the gateway stream ended before the response completed


@dataclass(slots=True, kw_only=True)
class ResponseInfo:
    """What response hooks see. ``dynamic_metadata`` set by the final hook reaches Envoy."""

    request_id: str
    headers: Mapping[str, str] = field(default_factory=dict)
    status: int = 0
    start_of_stream: bool = False
    end_of_stream: bool = False
    usage: Usage | None = None
    request_metadata: Mapping[str, Mapping[str, object]] = field(default_factory=dict)
    dynamic_metadata: dict[str, dict[str, object]] = field(default_factory=dict)
    outcome: ResponseOutcome = ResponseOutcome.PENDING
    chunk: bytes = b""


@runtime_checkable
class Parser(Protocol):
    """Turns a request body into a ``ParsedRequest``; raises ``BadRequestError``."""

    @property
    def typed_name(self) -> TypedName: ...

    def parse(self, body: bytes, headers: Mapping[str, str]) -> ParsedRequest: ...


@runtime_checkable
class DataProducer(Protocol):
    """Computes per-request data before scheduling (e.g. prefix-cache matches).

    ``produces``/``consumes`` name data keys; producers run in dependency order, under one
    overall timeout. A failure is logged and skipped, never fails the request.
    """

    @property
    def typed_name(self) -> TypedName: ...

    def produces(self) -> Sequence[str]: ...

    def consumes(self) -> Sequence[str]: ...

    async def prepare_request_data(
        self, request: InferenceRequest, candidates: Sequence[Candidate]
    ) -> None: ...


@runtime_checkable
class Admitter(Protocol):
    """Returns ``None`` to admit, or the reason the request is refused (HTTP 500)."""

    @property
    def typed_name(self) -> TypedName: ...

    async def admit_request(
        self, request: InferenceRequest, candidates: Sequence[Candidate]
    ) -> str | None: ...


@runtime_checkable
class PlacementClaimer(Protocol):
    """Runs after scheduling, before the ``PreRequest`` hooks. Returns the candidate the
    primary profile's pick gives way to, or ``None`` to keep it: another EPP process placed
    the same new prompt prefix a moment earlier, and agreeing on its endpoint keeps the
    prefix on one server. The returned candidate goes first; the profile's other picks
    follow it as fallbacks."""

    @property
    def typed_name(self) -> TypedName: ...

    async def claim_placement(
        self, request: InferenceRequest, result: SchedulingResult
    ) -> Candidate | None: ...


@runtime_checkable
class PreRequest(Protocol):
    """Runs after scheduling, before the request is forwarded."""

    @property
    def typed_name(self) -> TypedName: ...

    async def pre_request(self, request: InferenceRequest, result: SchedulingResult) -> None: ...


@runtime_checkable
class ResponseHeaderProcessor(Protocol):
    @property
    def typed_name(self) -> TypedName: ...

    async def response_header(
        self, request: InferenceRequest, response: ResponseInfo, target: EndpointInfo | None
    ) -> None: ...


@runtime_checkable
class ResponseBodyProcessor(Protocol):
    """Called per streamed chunk in order, or once for a buffered body; the call with
    ``end_of_stream`` is the last, and always happens (``outcome`` says how it ended).

    A call before the last may run outside the stream's task until it first waits (the
    native transport answers chunks in its read, docs/decisions/0021): there,
    ``asyncio.current_task()`` is None and ``asyncio.timeout()`` raises; use
    ``asyncio.wait_for``. Context variables (the request id) are the stream's.

    A hook that needs only a response's start and end sets the class attribute
    ``reads_response_chunks = False``: it is then called with the first chunk and the end,
    not with the chunks between (a streamed response's per-chunk cost). Without response
    bodies (Envoy's ``response_body_mode: NONE``) every hook gets only the end, with an
    empty chunk (docs/decisions/0028)."""

    @property
    def typed_name(self) -> TypedName: ...

    async def response_body(
        self, request: InferenceRequest, response: ResponseInfo, target: EndpointInfo | None
    ) -> None: ...


@runtime_checkable
class SaturationDetector(Protocol):
    """0 is idle, 1.0 saturated, above 1.0 the depth of overload."""

    @property
    def typed_name(self) -> TypedName: ...

    def saturation(self, candidates: Sequence[Candidate]) -> float: ...


@runtime_checkable
class CapacityDetector(Protocol):
    """A saturation detector that also knows how many requests the candidates can serve at
    once. Flow control then gates on the requests it has in flight over the pool (counted
    when it lets them go, so without the lag of a count booked after scheduling) divided
    by that capacity, or the detector's saturation when higher."""

    def capacity(self, candidates: Sequence[Candidate]) -> float | None:
        """Requests the candidates can serve at once (``inf``: no limit known); None when
        this detector does not count requests (then only ``saturation`` is used)."""
        ...
