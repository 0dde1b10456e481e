"""The inbound port: what the gateway adapter hands the domain and what it gets back."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from ports.endpoints import EndpointAddress
from ports.errors import RequestError
from ports.observer import Span

__all__ = [
    "SYSTEM_REQUEST_HEADERS",
    "InboundRequest",
    "Metadata",
    "RequestExchange",
    "RequestProcessor",
    "ResponseBodyReply",
    "ResponseHeadersReply",
    "RoutingDecision",
]

#: Filter metadata by namespace, as plain JSON-like values.
Metadata = Mapping[str, Mapping[str, object]]

#: Request headers owned by the gateway/EPP protocol; never forwarded as-is (lower case).
SYSTEM_REQUEST_HEADERS = frozenset(
    {
        "x-gateway-inference-fairness-id",
        "x-gateway-inference-objective",
        "x-gateway-model-name-rewrite",
        "x-gateway-destination-endpoint-subset",
        "x-gateway-destination-endpoint",
        "x-gateway-destination-endpoint-served",
        "content-length",
    }
)


@dataclass(frozen=True, slots=True, kw_only=True)
class InboundRequest:
    """One HTTP request as the gateway saw it.

    ``headers`` has lower-case names (pseudo-headers such as ``:path`` included) and
    always holds ``x-request-id``. ``body`` is ``None`` for a headers-only request
    (end of stream on the headers), else the complete body. ``span`` is the gateway's
    span for the whole exchange, the parent of the domain's spans (``None``: no tracing).
    """

    request_id: str
    headers: Mapping[str, str]
    body: bytes | None
    metadata: Metadata = field(default_factory=dict)
    span: Span | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class RoutingDecision:
    """Where the request goes, or why it does not.

    On success ``endpoints`` is non-empty: the first is the primary destination, the rest
    ordered fallbacks; ``body`` is the (possibly rewritten) body to forward; ``headers``
    are extra request headers to set; ``dynamic_metadata`` is merged into the reply.
    On failure ``error`` is set and everything else is ignored.
    """

    endpoints: tuple[EndpointAddress, ...] = ()
    body: bytes = b""
    headers: tuple[tuple[str, str], ...] = ()
    dynamic_metadata: Metadata = field(default_factory=dict)
    error: RequestError | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ResponseHeadersReply:
    """Extra response headers to set, and whether the body is streamed (SSE)."""

    headers: tuple[tuple[str, str], ...] = ()
    streaming: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class ResponseBodyReply:
    """The response bytes to send on, and dynamic metadata for the last reply."""

    body: bytes
    dynamic_metadata: Metadata | None = None


class RequestExchange(Protocol):
    """The domain's side of one request/response exchange.

    Calls come in protocol order from one task: ``route`` once, then on success
    ``response_headers`` once and ``response_body`` zero or more times (the last with
    ``end_of_stream=True`` when the response completes), or ``response_ended`` once when
    the gateway sends no response body. Streaming responses get one
    call per chunk; non-streaming responses are buffered by the caller and passed whole
    in one call with ``end_of_stream=True``. ``close`` is always called last, also when the
    gateway drops the stream or ``route`` is cancelled; it is idempotent and frees
    everything the request held. None of the methods raise for request-level problems:
    errors travel in ``RoutingDecision.error``.
    """

    async def route(self) -> RoutingDecision: ...

    async def response_headers(
        self, headers: Mapping[str, str], metadata: Metadata
    ) -> ResponseHeadersReply: ...

    async def response_body(self, chunk: bytes, end_of_stream: bool) -> ResponseBodyReply: ...

    async def response_ended(self) -> None:
        """The response has ended without its body passing through the EPP: the gateway
        sends none (Envoy's ``response_body_mode: NONE``), only the response headers and
        then the end of the stream or the response trailers. Called at most once, after
        ``response_headers``, in place of the ``response_body`` calls; what needs only the
        response's end (releasing load, state, completion metrics) happens as at a body's
        end of stream; what reads the body (token usage, first-token time) has nothing."""
        ...

    async def close(self) -> None: ...


class RequestProcessor(Protocol):
    """Inbound port: opens one exchange per gateway stream. ``open`` does no I/O."""

    def open(self, request: InboundRequest) -> RequestExchange: ...

    def ready(self) -> bool:
        """True once the endpoint set is known (drives gRPC readiness)."""
        ...
