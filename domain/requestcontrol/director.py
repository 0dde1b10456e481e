"""The Director: one request's way from parsed body to routing decision, and back."""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping

from domain.datastore.store import Datastore
from domain.errors import EppError, InternalError, ServiceUnavailableError
from domain.requestcontrol.candidates import locate
from domain.requesthandling.openai import OpenAIParser, ParsedRequest, rewrite_model
from domain.requesthandling.usage import (
    SseUsageScanner,
    Usage,
    rewrite_model_back,
    usage_from_body,
)
from ports.codec import JsonCodec
from ports.requests import (
    InboundRequest,
    Metadata,
    ResponseBodyReply,
    ResponseHeadersReply,
    RoutingDecision,
)

__all__ = ["Director", "RequestExchangeState"]

logger = logging.getLogger(__name__)

MODEL_REWRITE_HEADER = "x-gateway-model-name-rewrite"


class Director:
    """The ``RequestProcessor``: opens one ``RequestExchangeState`` per gateway stream.

    Routing is, for now, a uniformly random pick among the candidates.
    """

    def __init__(
        self,
        *,
        datastore: Datastore,
        codec: JsonCodec,
        rng: random.Random | None = None,
        subset_filter: bool = True,
    ) -> None:
        self._datastore = datastore
        self._codec = codec
        self._parser = OpenAIParser(codec)
        self._rng = rng or random.Random()
        self._subset_filter = subset_filter

    def open(self, request: InboundRequest) -> RequestExchangeState:
        return RequestExchangeState(self, request)

    def ready(self) -> bool:
        return self._datastore.synced

    def _route(self, exchange: RequestExchangeState) -> RoutingDecision:
        request = exchange.request
        all_endpoints = self._datastore.endpoints()
        if request.body is None:
            if not all_endpoints:
                raise InternalError("no pods available in datastore")
            chosen = self._rng.choice(all_endpoints)
            return RoutingDecision(endpoints=(chosen.address,))

        parsed = self._parser.parse(request.body, request.headers)
        exchange.parsed = parsed
        exchange.incoming_model = parsed.model
        target = request.headers.get(MODEL_REWRITE_HEADER) or parsed.model
        exchange.target_model = target
        body = request.body
        if target != parsed.model:
            body = rewrite_model(parsed, target, self._codec)

        candidates = locate(all_endpoints, request.metadata, subset_filter=self._subset_filter)
        if not candidates:
            raise ServiceUnavailableError(
                "failed to find endpoint candidates for serving the request"
            )
        chosen = self._rng.choice(candidates)
        logger.debug(
            "request %s (model %s) routed to %s",
            request.request_id,
            target,
            chosen.name,
        )
        return RoutingDecision(endpoints=(chosen.address,), body=body)


class RequestExchangeState:
    """The domain's state for one request/response exchange (a ``RequestExchange``)."""

    __slots__ = (
        "_closed",
        "_director",
        "_scanner",
        "incoming_model",
        "parsed",
        "request",
        "response_complete",
        "status",
        "streaming",
        "target_model",
        "usage",
    )

    def __init__(self, director: Director, request: InboundRequest) -> None:
        self._director = director
        self.request = request
        self.parsed: ParsedRequest | None = None
        self.incoming_model = ""
        self.target_model = ""
        self.streaming = False
        self.status = ""
        self.usage: Usage | None = None
        self.response_complete = False
        self._scanner: SseUsageScanner | None = None
        self._closed = False

    async def route(self) -> RoutingDecision:
        try:
            return self._director._route(self)
        except EppError as exc:
            return RoutingDecision(error=exc.to_request_error())

    async def response_headers(
        self, headers: Mapping[str, str], metadata: Metadata
    ) -> ResponseHeadersReply:
        self.status = headers.get(":status", "")
        self.streaming = "text/event-stream" in headers.get("content-type", "")
        if self.streaming:
            self._scanner = SseUsageScanner(self._director._codec)
        return ResponseHeadersReply(streaming=self.streaming)

    async def response_body(self, chunk: bytes, end_of_stream: bool) -> ResponseBodyReply:
        codec = self._director._codec
        if self._scanner is not None:
            self._scanner.feed(chunk)
            if end_of_stream:
                self._scanner.flush()
                self.usage = self._scanner.usage
        elif end_of_stream:
            self.usage = usage_from_body(chunk, codec)
        if end_of_stream:
            self.response_complete = True
        if self.target_model and self.target_model != self.incoming_model:
            chunk = rewrite_model_back(chunk, self.target_model, self.incoming_model, codec)
        return ResponseBodyReply(body=chunk)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._scanner = None
        self.parsed = None
