"""A ``RequestProcessor`` whose exchanges do what the test says and remember what they saw.

These are port implementations, not mocks: the adapter drives them through the same
``open`` / ``route`` / ``response_headers`` / ``response_body`` / ``close`` calls as the real
Director, and a test inspects the recorded state afterwards (or waits for it with
``FakeProcessor.wait_until``, which wakes on every state change and gives up at a deadline).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ports.endpoints import EndpointAddress
from ports.observer import REQUEST_ID
from ports.requests import (
    InboundRequest,
    Metadata,
    ResponseBodyReply,
    ResponseHeadersReply,
    RoutingDecision,
)

__all__ = ["DEFAULT_ENDPOINT", "FakeExchange", "FakeProcessor", "ResponseHeadersCall"]

DEFAULT_ENDPOINT = EndpointAddress(ip="10.0.0.1", port=8000)


@dataclass(frozen=True, slots=True)
class ResponseHeadersCall:
    """One ``response_headers`` call as the exchange received it."""

    headers: Mapping[str, str]
    metadata: Metadata


@dataclass(slots=True, eq=False)
class FakeExchange:
    """One exchange: the request it was opened with and every call made on it."""

    processor: FakeProcessor
    request: InboundRequest
    route_calls: int = 0
    route_started: asyncio.Event = field(default_factory=asyncio.Event)
    route_cancelled: bool = False
    response_headers_calls: list[ResponseHeadersCall] = field(default_factory=list)
    response_body_calls: list[tuple[bytes, bool]] = field(default_factory=list)
    #: ``REQUEST_ID`` as each ``response_body`` call saw it
    response_body_request_ids: list[str] = field(default_factory=list)
    response_ended_calls: int = 0
    close_calls: int = 0

    @property
    def closed(self) -> bool:
        return self.close_calls > 0

    async def route(self) -> RoutingDecision:
        self.route_calls += 1
        self.route_started.set()
        self.processor.changed()
        try:
            if self.processor.route_gate is not None:
                await self.processor.route_gate.wait()
        except asyncio.CancelledError:
            self.route_cancelled = True
            self.processor.changed()
            raise
        decision = self.processor.decision
        return decision(self.request) if callable(decision) else decision

    async def response_headers(
        self, headers: Mapping[str, str], metadata: Metadata
    ) -> ResponseHeadersReply:
        self.response_headers_calls.append(ResponseHeadersCall(dict(headers), metadata))
        self.processor.changed()
        streaming = self.processor.streaming
        if streaming is None:
            streaming = "text/event-stream" in headers.get("content-type", "")
        return ResponseHeadersReply(headers=self.processor.response_headers, streaming=streaming)

    async def response_body(self, chunk: bytes, end_of_stream: bool) -> ResponseBodyReply:
        self.response_body_calls.append((chunk, end_of_stream))
        self.response_body_request_ids.append(REQUEST_ID.get())
        self.processor.changed()
        if self.processor.body_gate is not None:
            await self.processor.body_gate.wait()
        metadata = self.processor.response_metadata if end_of_stream else None
        return ResponseBodyReply(body=chunk, dynamic_metadata=metadata)

    async def response_ended(self) -> None:
        self.response_ended_calls += 1
        self.processor.changed()

    async def close(self) -> None:
        self.close_calls += 1
        self.processor.changed()


DecisionSource = RoutingDecision | Callable[[InboundRequest], RoutingDecision]


class FakeProcessor:
    """Opens ``FakeExchange``s that answer with ``decision`` and echo response bodies.

    ``block_route=True`` makes every ``route()`` wait until ``release_route()``.
    ``streaming=None`` decides streaming from the response ``content-type`` like the
    Director; ``response_headers`` are the extra response headers every exchange asks for;
    ``response_metadata`` is the dynamic metadata of the final response-body reply.
    ``block_response_body=True`` makes every ``response_body()`` wait until
    ``release_response_body()``.
    """

    def __init__(
        self,
        decision: DecisionSource | None = None,
        *,
        block_route: bool = False,
        ready: bool = True,
        streaming: bool | None = None,
        response_headers: tuple[tuple[str, str], ...] = (),
        response_metadata: Metadata | None = None,
        block_response_body: bool = False,
    ) -> None:
        self.decision: DecisionSource = decision or (
            lambda request: RoutingDecision(endpoints=(DEFAULT_ENDPOINT,), body=request.body or b"")
        )
        self.route_gate: asyncio.Event | None = asyncio.Event() if block_route else None
        self.body_gate: asyncio.Event | None = asyncio.Event() if block_response_body else None
        self.is_ready = ready
        self.streaming = streaming
        self.response_headers = response_headers
        self.response_metadata = response_metadata
        self.exchanges: list[FakeExchange] = []
        self._changed = asyncio.Event()

    # RequestProcessor

    def open(self, request: InboundRequest) -> FakeExchange:
        exchange = FakeExchange(self, request)
        self.exchanges.append(exchange)
        self.changed()
        return exchange

    def ready(self) -> bool:
        return self.is_ready

    # inspection and control

    @property
    def open_exchanges(self) -> int:
        """Exchanges opened and not yet closed."""
        return sum(1 for e in self.exchanges if not e.closed)

    @property
    def last(self) -> FakeExchange:
        assert self.exchanges, "no exchange was opened"
        return self.exchanges[-1]

    def release_route(self) -> None:
        assert self.route_gate is not None, "route() is not blocked"
        self.route_gate.set()

    def release_response_body(self) -> None:
        assert self.body_gate is not None, "response_body() is not blocked"
        self.body_gate.set()

    def changed(self) -> None:
        self._changed.set()

    async def wait_until(self, condition: Callable[[], bool], within: float = 5.0) -> None:
        """Wait until ``condition()`` holds, re-checking on every state change.

        Fails with ``AssertionError`` when it does not hold ``within`` seconds.
        """
        try:
            async with asyncio.timeout(within):
                while not condition():
                    self._changed.clear()
                    await self._changed.wait()
        except TimeoutError:
            raise AssertionError(f"condition not met within {within}s") from None
