"""Envoy ext_proc (FULL_DUPLEX_STREAMED) translated to and from the ``RequestProcessor`` port.

One gRPC ``Process`` stream carries one HTTP request and its response. The request-header
reply is held until the body's end of stream, then the routing decision goes back as a
header mutation (``x-gateway-destination-endpoint``, ``Content-Length``, the re-set request
headers), ``envoy.lb`` dynamic metadata, and the body as ``streamed_response`` chunks.
A gateway whose filter sends the request body ``BUFFERED`` (Envoy's ``protocol_config``
says so) waits for the headers' reply before it sends the body: the headers are answered at
once, unchanged, and the decision goes back in the body's reply (the same header mutation,
the body whole). ``NONE`` and ``STREAMED`` would leave the EPP without the body before the
headers go on: such a request is answered 500 naming the mode, never left hanging.

A stream carries exactly one request: a message out of that protocol (a second
``request_headers``, a body before the headers, a response message before the request was
routed, response headers twice) ends the stream with ``FAILED_PRECONDITION``, and a header
name or value holding CR, LF or NUL with ``INVALID_ARGUMENT``; the details say which. No
gateway does either, so on the native transport the peer's connection is then not read for a
while (``RpcContext.penalize_peer``, at most ``protocol_error_pause``): a peer that does it in
a loop gets little of the EPP. The
exchange opened for the request is closed exactly once, however the stream ends. Once the
response has ended (its end of stream, or its trailers, answered), the stream ends with OK
at once, without waiting for Envoy to half-close it: Envoy resets a stream still open when its
HTTP request is over, and grpc.aio leaks the operations of a status sent on a call already
reset (80 bytes a stream, which in a long run also keeps heap pages from being returned).

Each stream is one ``gateway.request`` server span, continuing the trace of the request
headers' ``traceparent`` and handed to the domain as the parent of its spans; the stream's
request id is set in ``REQUEST_ID`` so every log record of the request carries it.

``StreamLimits`` bound what one stream may hold: a request body beyond
``max_request_body_bytes`` is answered 413 as soon as the limit is crossed (or at once when
its ``Content-Length`` says so), without buffering more; a non-streamed response beyond
``max_response_buffer_bytes`` stops being buffered and goes on chunk by chunk as it comes
(the exchange still sees every byte, but token usage is not read from that response and the
model name is rewritten back only where it lies within one chunk); a stream with no message
from Envoy for ``idle_timeout`` seconds, while the EPP is waiting for one, is ended with
``DEADLINE_EXCEEDED``. Envoy's streams carry their whole request within moments of opening;
streams whose request has not yet been routed ("unrouted": no request headers yet, or a body
still coming) are bounded on their own by ``max_unrouted_streams``: past it, the oldest
unrouted stream is ended with ``RESOURCE_EXHAUSTED``, so streams held open without a request
cannot fill the server and keep newer ones (Envoy's) out.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
import uuid
from collections.abc import AsyncIterator, Coroutine, Generator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, cast

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from adapters.envoy.h2 import RpcContext
from adapters.envoy.loglimit import LogLimiter
from adapters.envoy.messages import (
    DESTINATION_ENDPOINT_HEADER,
    DESTINATION_METADATA_NAMESPACE,
    HTTP_STATUS_BY_CODE,
    MAX_BODY_CHUNK_BYTES,
    StreamAbortedError,
    StreamProtocolError,
    body_chunks,
    fill_struct,
    headers_of,
    immediate_response,
    metadata_of,
    out_of_order,
    payload_too_large,
    request_body_response,
    response_body_response,
    serialize_reply,
    set_headers,
)
from ports.errors import ErrorCode, RequestError
from ports.metric_catalogue import (
    EXTPROC_STREAM_DURATION,
    EXTPROC_STREAMS,
    EXTPROC_STREAMS_INFLIGHT,
)
from ports.observer import REQUEST_ID, NoopObserver, Observer, Span
from ports.requests import (
    SYSTEM_REQUEST_HEADERS,
    InboundRequest,
    RequestExchange,
    RequestProcessor,
    RoutingDecision,
)

__all__ = [
    "DESTINATION_ENDPOINT_HEADER",
    "HTTP_STATUS_BY_CODE",
    "MAX_BODY_CHUNK_BYTES",
    "ExtProcServicer",
    "StreamLimits",
    "add_extproc_servicer",
    "serialize_reply",
]

logger = logging.getLogger(__name__)

REQUEST_ID_HEADER = "x-request-id"
GATEWAY_SPAN = "gateway.request"

_NO_LABELS: Mapping[str, str] = MappingProxyType({})
# ext_proc's ProcessingMode.BodySendMode, as Envoy reports it in ``protocol_config``
_BUFFERED_BODY_MODES = frozenset({2, 3})  # BUFFERED, BUFFERED_PARTIAL
# NONE never sends the body; STREAMED forwards the headers before the body is seen
_UNSUPPORTED_BODY_MODES: Mapping[int, str] = MappingProxyType({0: "NONE", 1: "STREAMED"})
# response bodies: one reply per message (STREAMED, BUFFERED, BUFFERED_PARTIAL)
_CHUNK_REPLY_BODY_MODES = frozenset({1, 2, 3})


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamLimits:
    """What one ext_proc stream may hold (``--max-request-body-bytes``,
    ``--max-response-buffer-bytes``, ``--stream-idle-timeout``), how many streams may
    wait for their request at once (``--max-unrouted-streams``), and the longest a connection
    is not read after a stream broke the protocol (``--protocol-error-pause``); 0 means no
    limit (no pause)."""

    max_request_body_bytes: int = 16 * 1024 * 1024
    max_response_buffer_bytes: int = 16 * 1024 * 1024
    idle_timeout: float = 600.0
    max_unrouted_streams: int = 1000
    protocol_error_pause: float = 1.0


class _Stream:
    """The state of one ext_proc stream (one HTTP request and its response)."""

    __slots__ = (
        "_body_bytes",
        "_body_chunks",
        "_body_done",
        "_bodyless",
        "_buffered",
        "_chunk_replies",
        "_context",
        "_exchange",
        "_finished",
        "_headers",
        "_headers_seen",
        "_limits",
        "_log",
        "_metadata",
        "_observer",
        "_processor",
        "_raw_headers",
        "_request_id",
        "_response_buffered",
        "_response_chunks",
        "_response_done",
        "_response_passthrough",
        "_response_started",
        "_span",
        "_streaming",
        "unsupported_body_mode",
        "watch",
    )

    def __init__(
        self,
        processor: RequestProcessor,
        observer: Observer,
        limits: StreamLimits,
        log: LogLimiter,
    ) -> None:
        self._processor = processor
        self._observer = observer
        self._log = log
        self._limits = limits
        self._body_bytes = 0
        self._response_buffered = 0
        self._response_passthrough = False
        self._span: Span | None = None
        self._headers: dict[str, str] = {}
        self._headers_seen = False
        self._raw_headers: dict[str, bytes] = {}  # request header values that are not UTF-8
        self._response_started = False
        self._context: contextvars.Context | None = None  # the task's, for ``inline``
        self.watch: _IdleWatch | None = None  # the stream's idle watch, for ``inline``
        self._metadata: dict[str, dict[str, object]] = {}
        self._body_chunks: list[bytes] = []
        self._body_done = False
        self._exchange: RequestExchange | None = None
        self._streaming = False
        self._response_chunks: list[bytes] = []
        self._response_done = False
        self._request_id = ""
        self._finished = False
        #: Envoy sends no response body on this stream (its ``protocol_config`` says
        #: ``response_body_mode: NONE``): the response ends at its trailers or at the
        #: stream's half-close.
        self._bodyless = False
        #: Envoy sends the request body whole (``request_body_mode: BUFFERED``, or
        #: ``BUFFERED_PARTIAL``) after the request headers' reply: the headers are answered
        #: at once and the decision goes in the body's reply.
        self._buffered = False
        #: the name of a request body mode the EPP cannot route with (``NONE``,
        #: ``STREAMED``): the request is answered 500 saying so.
        self.unsupported_body_mode: str | None = None
        #: Envoy sends the response body ``STREAMED``, ``BUFFERED`` or ``BUFFERED_PARTIAL``:
        #: each body message gets exactly one reply, in order, as a plain body response (a
        #: streamed response is for ``FULL_DUPLEX_STREAMED`` only), so the response goes
        #: through chunk by chunk as it comes.
        self._chunk_replies = False

    @property
    def finished(self) -> bool:
        """An immediate response was sent: nothing more will be processed."""
        return self._finished

    @property
    def complete(self) -> bool:
        """The response has ended (its end of stream or its trailers answered): Envoy has
        nothing more to send on this stream."""
        return self._response_done

    @property
    def bodyless(self) -> bool:
        """Envoy said it sends no response body on this stream."""
        return self._bodyless

    @property
    def unrouted(self) -> bool:
        """No request routed or refused yet: the stream still waits for its request."""
        return self._exchange is None and not self._finished

    async def handle(self, request: Any) -> list[Any]:
        """The replies to one message; ``StreamProtocolError`` when it breaks the protocol."""
        kind = request.WhichOneof("request")
        if kind == "response_body" and self._response_started:
            # The most frequent message (one per SSE chunk) first. Its metadata is not
            # read: nothing after the response headers uses it.
            return await self._on_response_body(request.response_body)
        if kind != "response_trailers" and request.HasField("metadata_context"):
            # A new dict each time: a request handed to the domain keeps what it was given.
            self._metadata = {**self._metadata, **metadata_of(request)}
        if kind == "request_headers":
            if request.HasField("protocol_config"):
                config = request.protocol_config
                # 0 is NONE: Envoy sends the response headers, then ends the stream when
                # the response has ended (docs/decisions/0028)
                self._bodyless = not config.response_body_mode
                self._chunk_replies = config.response_body_mode in _CHUNK_REPLY_BODY_MODES
                self._response_passthrough = self._chunk_replies
                mode = config.request_body_mode
                self._buffered = mode in _BUFFERED_BODY_MODES
                self.unsupported_body_mode = _UNSUPPORTED_BODY_MODES.get(mode)
            return await self._on_request_headers(request.request_headers)
        if kind == "request_body":
            return await self._on_request_body(request.request_body)
        if kind is not None and kind.startswith("response_"):
            if self._exchange is None:
                raise out_of_order(f"{kind} before the request was routed")
            if kind == "response_headers":
                if self._response_started:
                    raise out_of_order("response_headers twice")
                self._response_started = True
                self._context = contextvars.copy_context()
                return await self._on_response_headers(request.response_headers)
            if not self._response_started:
                raise out_of_order(f"{kind} before response_headers")
            if kind == "response_body":
                return await self._on_response_body(request.response_body)
            return await self._on_response_trailers()
        if kind == "request_trailers" and not self._headers_seen:
            raise out_of_order("request_trailers before request_headers")
        return []  # request trailers (and anything unknown) get no reply

    def inline(self, request: Any) -> Any:
        """``RpcContext.inline``: a response-body chunk (not the last) answered in the
        transport's read, without waking the stream's task: an SSE chunk of a streamed
        response sent on, or a chunk of another response buffered. Its work (the exchange's
        ``response_body``) runs here as far as it goes without waiting; if it must wait, it
        is handed to the task to finish (``_Unfinished``). Any other message, and the end
        of the response, are returned for the task to handle."""
        watch = self.watch
        if watch is not None:  # a message came: one wait for Envoy ends, the next begins
            watch.waiting_since = watch.loop.time()
        if (
            not self._response_started
            or self._response_done
            or request.WhichOneof("request") != "response_body"
        ):
            return request
        message = request.response_body
        if message.end_of_stream or self._context is None:
            return request
        work = self._on_response_body(message)
        try:
            # in the task's context variables (the request id log records carry, the span)
            waiting = self._context.run(work.send, None)
        except StopIteration as done:
            return done.value
        except Exception as exc:  # raised in the task instead, as ``handle`` would
            return _Unfinished(None, None, exc)
        return _Unfinished(work, waiting, None)

    async def half_closed(self) -> None:
        """Envoy half-closed (or reset) the stream. Without response bodies (``bodyless``)
        that is the end of the response, once its headers came: Envoy ends the stream when
        the HTTP stream ends, whether the response completed or its client left, which the
        EPP cannot tell apart then. Otherwise, or before the response headers, the response
        did not complete (``close`` says the client went away)."""
        if self._bodyless and self._response_started and not self._response_done:
            self._response_done = True
            if self._exchange is not None:
                await self._exchange.response_ended()

    async def close(self) -> None:
        self._body_chunks.clear()
        self._response_chunks.clear()
        try:
            if self._exchange is not None:
                await self._exchange.close()
        finally:
            if self._span is not None:
                self._span.end()

    # request path

    async def _on_request_headers(self, message: Any) -> list[Any]:
        if self._headers_seen:
            raise out_of_order(
                "a second request_headers message: one request per stream (the first "
                "request's exchange stays with this stream and is closed with it)"
            )
        self._headers_seen = True
        headers = headers_of(message.headers, self._raw_headers)
        request_id = headers.get(REQUEST_ID_HEADER)
        if not request_id:
            request_id = str(uuid.uuid4())
            headers[REQUEST_ID_HEADER] = request_id
        self._headers = headers
        self._request_id = request_id
        REQUEST_ID.set(request_id)
        if self._span is None:
            span = self._observer.start_span(GATEWAY_SPAN, carrier=headers)
            span.set_attribute("request_id", request_id)
            self._span = span
        if message.end_of_stream:
            return await self._route(None)
        if self.unsupported_body_mode is not None:
            return self._unsupported_body_mode(self.unsupported_body_mode)
        limit = self._limits.max_request_body_bytes
        declared = headers.get("content-length", "")
        if limit and declared.isdigit() and int(declared) > limit:
            return self._too_large(limit)
        if self._buffered:
            # Envoy sends the body only once the headers are answered: they go on unchanged
            # for now, and the body's reply carries the decision's header mutation.
            return [pb.ProcessingResponse(request_headers=pb.HeadersResponse())]
        return []

    def _unsupported_body_mode(self, mode: str) -> list[Any]:
        self._finished = True
        message = (
            f"the gateway's ext_proc filter sends the request body in mode {mode}; the EPP "
            "routes on the body and needs FULL_DUPLEX_STREAMED (or BUFFERED)"
        )
        self._log.info("request %s refused: %s", self._request_id, message)
        if self._span is not None:
            self._span.record_error(f"Internal: {message}")
        return [immediate_response(RequestError(code=ErrorCode.INTERNAL, message=message))]

    def _too_large(self, limit: int) -> list[Any]:
        self._finished = True
        self._body_chunks.clear()
        self._log.info("request %s refused: its body exceeds %d bytes", self._request_id, limit)
        if self._span is not None:
            self._span.record_error(f"PayloadTooLarge: the request body exceeds {limit} bytes")
        return [payload_too_large(limit)]

    async def _on_request_body(self, message: Any) -> list[Any]:
        if not self._headers_seen:
            raise out_of_order("request_body before request_headers")
        if self._body_done or self._exchange is not None:
            return []  # a duplicate end-of-stream chunk, or a body after the request ended
        if message.body:
            self._body_bytes += len(message.body)
            limit = self._limits.max_request_body_bytes
            if limit and self._body_bytes > limit:
                return self._too_large(limit)
            self._body_chunks.append(message.body)
        if not message.end_of_stream:
            if self._buffered:
                # BUFFERED_PARTIAL with a body past Envoy's buffer: the rest would go
                # upstream unseen, so the EPP cannot route on it
                return self._too_large(self._body_bytes)
            return []
        self._body_done = True
        body = b"".join(self._body_chunks)
        self._body_chunks.clear()
        return await self._route(body)

    async def _route(self, body: bytes | None) -> list[Any]:
        if self._exchange is not None:  # never two exchanges on one stream
            raise out_of_order("one request per stream")
        inbound = InboundRequest(
            request_id=self._request_id,
            headers=self._headers,
            body=body,
            metadata=self._metadata,
            span=self._span,
        )
        self._exchange = self._processor.open(inbound)
        decision = await self._exchange.route()
        if decision.error is not None:
            self._finished = True
            if self._span is not None:
                self._span.record_error(f"{decision.error.code.value}: {decision.error.message}")
            self._log.info(
                "request %s refused: %s - %s",
                self._request_id,
                decision.error.code.value,
                decision.error.message,
            )
            return [immediate_response(decision.error)]
        if self._buffered and body is not None:
            reply = pb.ProcessingResponse()
            self._fill_decision(reply, reply.request_body.response, decision)
            reply.request_body.response.body_mutation.body = decision.body
            return [reply]
        replies = [self._header_reply(decision)]
        if body is not None:
            chunks = list(body_chunks(decision.body))
            last = len(chunks) - 1
            replies.extend(request_body_response(c, i == last) for i, c in enumerate(chunks))
        return replies

    def _header_reply(self, decision: RoutingDecision) -> Any:
        reply = pb.ProcessingResponse()
        self._fill_decision(reply, reply.request_headers.response, decision)
        return reply

    def _fill_decision(self, reply: Any, common: Any, decision: RoutingDecision) -> None:
        """The routing decision into ``reply``: its dynamic metadata, and the header
        mutation and route cache clearing in ``common`` (the ``CommonResponse`` of the
        request headers' reply, or of a buffered body's)."""
        destination = ",".join(e.host_port() for e in decision.endpoints)
        headers_to_set: list[tuple[str, str | bytes]] = [(DESTINATION_ENDPOINT_HEADER, destination)]
        if decision.body:
            headers_to_set.append(("Content-Length", str(len(decision.body))))
        own = {k.lower() for k, _ in decision.headers}
        raw = self._raw_headers
        headers_to_set.extend(
            (k, raw.get(k, v) if raw else v)  # a value that was not UTF-8 goes on unchanged
            for k, v in self._headers.items()
            if k not in SYSTEM_REQUEST_HEADERS
            and not k.startswith(":")
            and k != "host"
            and k not in own
        )
        # Headers the EPP sets itself come last, so a client cannot override them.
        headers_to_set.extend(decision.headers)
        metadata: dict[str, dict[str, object]] = {
            ns: dict(fields) for ns, fields in decision.dynamic_metadata.items()
        }
        metadata.setdefault(DESTINATION_METADATA_NAMESPACE, {})[DESTINATION_ENDPOINT_HEADER] = (
            destination
        )
        fill_struct(reply.dynamic_metadata, metadata)
        common.clear_route_cache = True
        set_headers(common.header_mutation, headers_to_set)

    # response path

    async def _on_response_headers(self, message: Any) -> list[Any]:
        headers = headers_of(message.headers)
        # The reference also sets every response header again, to the value it has: a no-op
        # for the client, and Envoy refuses (and counts in ext_proc.rejected_header_mutations)
        # the x-envoy-* ones, such as x-envoy-upstream-service-time, on every request.
        headers_to_set: list[tuple[str, str | bytes]] = [("x-went-into-resp-headers", "true")]
        if self._exchange is not None:
            reply = await self._exchange.response_headers(headers, self._metadata)
            self._streaming = reply.streaming
            headers_to_set.extend(reply.headers)
        response = pb.ProcessingResponse()
        set_headers(response.response_headers.response.header_mutation, headers_to_set)
        replies = [response]
        if message.end_of_stream and self._exchange is not None:
            self._response_done = True
            await self._exchange.response_body(b"", True)
        return replies

    async def _on_response_body(self, message: Any) -> list[Any]:
        if self._response_done:
            return []
        end_of_stream = bool(message.end_of_stream)
        if self._exchange is None:
            if self._chunk_replies:
                return [self._plain_body_reply(message.body, message.body, None)]
            return [response_body_response(message.body, end_of_stream)]
        if self._streaming or self._response_passthrough:
            self._response_done = end_of_stream
            reply = await self._exchange.response_body(message.body, end_of_stream)
            if self._chunk_replies:
                return [self._plain_body_reply(message.body, reply.body, reply.dynamic_metadata)]
            return [response_body_response(reply.body, end_of_stream, reply.dynamic_metadata)]
        if message.body:
            self._response_chunks.append(message.body)
            self._response_buffered += len(message.body)
            limit = self._limits.max_response_buffer_bytes
            if limit and self._response_buffered > limit and not end_of_stream:
                return await self._start_passthrough(limit)
        if not end_of_stream:
            return []
        return await self._flush_buffered_response(end_of_stream=True)

    @staticmethod
    def _plain_body_reply(
        received: bytes, body: bytes, metadata: Mapping[str, Mapping[str, object]] | None
    ) -> Any:
        """In the modes with a reply per message (``_chunk_replies``), the reply to a
        response body message whose chunk was ``received`` and goes on as ``body``: a body
        response replacing the chunk only when it changed."""
        reply = pb.ProcessingResponse()
        common = reply.response_body.response
        common.SetInParent()
        if body != received:
            common.body_mutation.body = body
        if metadata:
            fill_struct(reply.dynamic_metadata, metadata)
        return reply

    async def _start_passthrough(self, limit: int) -> list[Any]:
        """The buffered response outgrew ``limit``: what is buffered goes on now, and the
        rest chunk by chunk as it comes."""
        assert self._exchange is not None
        self._response_passthrough = True
        self._log.info(
            "request %s: response larger than %d bytes passed through unbuffered (no token "
            "usage read from it)",
            self._request_id,
            limit,
        )
        body = b"".join(self._response_chunks)
        self._response_chunks.clear()
        reply = await self._exchange.response_body(body, False)
        return [response_body_response(c, False) for c in body_chunks(reply.body)]

    async def _flush_buffered_response(self, *, end_of_stream: bool) -> list[Any]:
        assert self._exchange is not None
        self._response_done = True
        body = b"".join(self._response_chunks)
        self._response_chunks.clear()
        reply = await self._exchange.response_body(body, True)
        chunks = list(body_chunks(reply.body))
        last = len(chunks) - 1
        return [
            response_body_response(
                c, end_of_stream and i == last, reply.dynamic_metadata if i == last else None
            )
            for i, c in enumerate(chunks)
        ]

    async def _on_response_trailers(self) -> list[Any]:
        replies: list[Any] = []
        if not self._response_done and self._exchange is not None:
            if self._bodyless:
                self._response_done = True
                await self._exchange.response_ended()
            elif self._streaming or self._response_passthrough:
                self._response_done = True
                await self._exchange.response_body(b"", True)
            else:
                replies = await self._flush_buffered_response(end_of_stream=False)
        replies.append(pb.ProcessingResponse(response_trailers=pb.TrailersResponse()))
        return replies


class _Unfinished:
    """A message's work ``_Stream.inline`` began and could not finish without waiting:
    awaited by the stream's task, it goes on from where it stopped (or raises what it
    raised)."""

    __slots__ = ("_error", "_waiting", "_work")

    def __init__(
        self,
        work: Coroutine[Any, Any, list[Any]] | None,
        waiting: Any,
        error: Exception | None,
    ) -> None:
        self._work = work
        self._waiting = waiting
        self._error = error

    def __await__(self) -> Generator[Any, Any, list[Any]]:
        if self._error is not None:
            raise self._error
        work = self._work
        assert work is not None
        waiting = self._waiting
        while True:
            # what ``await work`` would do from here: pass the task's wake-ups (and
            # cancellation) on to the coroutine until it returns
            try:
                try:
                    sent = yield waiting
                except BaseException as exc:  # thrown in by the task (its cancellation)
                    waiting = work.throw(exc)
                else:
                    waiting = work.send(sent)
            except StopIteration as done:
                return cast(list[Any], done.value)


class ExtProcServicer(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """The ``envoy.service.ext_proc.v3.ExternalProcessor`` service."""

    def __init__(
        self,
        processor: RequestProcessor,
        observer: Observer | None = None,
        limits: StreamLimits | None = None,
        *,
        stream_metrics: bool = False,
    ) -> None:
        self._processor = processor
        self._observer: Observer = observer if observer is not None else NoopObserver()
        self._limits = limits if limits is not None else StreamLimits()
        # --enable-grpc-stream-metrics: streams open, their duration, their ending code
        self._stream_metrics = stream_metrics
        self._open_streams = 0
        #: the status each stream was ended with (absent: OK, or the client went away)
        self._status: dict[_Stream, grpc.StatusCode] = {}
        # unrouted streams, oldest first: the task serving each (dicts keep insertion order)
        self._unrouted: dict[_Stream, asyncio.Task[Any]] = {}
        self._evicted: set[_Stream] = set()
        # the lines a peer causes once per stream or request, at a bounded rate
        self._log = LogLimiter(logger)
        self._bodyless_noted = False
        self._body_mode_noted = False

    @property
    def unrouted_streams(self) -> int:
        """Streams open whose request has not been routed yet."""
        return len(self._unrouted)

    def _admit_unrouted(self, stream: _Stream) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._unrouted[stream] = task
        limit = self._limits.max_unrouted_streams
        while limit and len(self._unrouted) > limit:
            oldest = next(iter(self._unrouted))
            oldest_task = self._unrouted.pop(oldest)
            if oldest.unrouted:  # else it is being routed: it leaves the set on its own
                self._evicted.add(oldest)
                oldest_task.cancel()

    async def Process(  # noqa: N802 - the gRPC method name
        self, request_iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any]
    ) -> None:
        # A coroutine handler on grpc.aio's reader/writer API: ``context.read()`` and
        # ``context.write()`` skip the two async generators of the iterator API, and one
        # idle watch per stream replaces a timeout per message (docs/decisions/0013).
        stream = _Stream(self._processor, self._observer, self._limits, self._log)
        self._admit_unrouted(stream)
        started = time.monotonic() if self._stream_metrics else 0.0
        if self._stream_metrics:
            self._open_streams += 1
            self._observer.gauge(EXTPROC_STREAMS_INFLIGHT, _NO_LABELS, self._open_streams)
        code = grpc.StatusCode.OK
        try:
            await self._serve(stream, context)
        except asyncio.CancelledError:
            if stream not in self._evicted:
                code = grpc.StatusCode.CANCELLED
                raise
            current = asyncio.current_task()
            if current is not None:
                current.uncancel()
            limit = self._limits.max_unrouted_streams
            self._log.info(
                "ext_proc stream closed: over %d streams without a routed request", limit
            )
            await self._abort(
                stream,
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"more than {limit} streams without a routed request; the oldest is closed "
                "(--max-unrouted-streams)",
            )
        except BaseException:
            code = grpc.StatusCode.UNKNOWN
            raise
        finally:
            self._unrouted.pop(stream, None)
            self._evicted.discard(stream)
            code = self._status.pop(stream, code)
            if self._stream_metrics:
                self._streamed(code, time.monotonic() - started)
            try:
                if code is grpc.StatusCode.CANCELLED:
                    # Without the graceful-close runtime flag, Envoy resets the stream when
                    # the response has ended: without response bodies, that is its end.
                    await stream.half_closed()
            finally:
                await stream.close()

    def _streamed(self, code: grpc.StatusCode, seconds: float) -> None:
        self._open_streams -= 1
        observer = self._observer
        observer.gauge(EXTPROC_STREAMS_INFLIGHT, _NO_LABELS, self._open_streams)
        observer.histogram(EXTPROC_STREAM_DURATION, _NO_LABELS, seconds)
        observer.counter(EXTPROC_STREAMS, {"code": code.name})

    async def _abort(
        self,
        stream: _Stream,
        context: grpc.aio.ServicerContext[Any, Any],
        code: grpc.StatusCode,
        details: str,
    ) -> None:
        self._status[stream] = code
        await context.abort(code, details)

    async def _serve(self, stream: _Stream, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        idle = self._limits.idle_timeout
        watch = _IdleWatch(idle) if idle else None
        read, write = context.read, context.write
        if isinstance(context, RpcContext):  # the native transport answers chunks inline
            stream.watch = watch
            context.inline = stream.inline
        try:
            while True:
                # Only the wait for Envoy's next message counts as idle, never routing.
                if watch is None:
                    request = await read()
                else:
                    watch.waiting_since = watch.loop.time()
                    try:
                        request = await read()
                    except asyncio.CancelledError:
                        if not watch.expired:
                            raise
                        watch.uncancel()
                        self._log.info(
                            "ext_proc stream closed: no message from Envoy for %gs", idle
                        )
                        await self._abort(
                            stream,
                            context,
                            grpc.StatusCode.DEADLINE_EXCEEDED,
                            f"no message from Envoy for {idle:g}s (--stream-idle-timeout)",
                        )
                        return
                    watch.waiting_since = None
                if request is grpc.aio.EOF:
                    await stream.half_closed()
                    return
                try:
                    if type(request) is _Unfinished:
                        replies = await request
                    else:
                        replies = await stream.handle(request)
                except StreamAbortedError as exc:
                    await self._abort(stream, context, grpc.StatusCode.UNKNOWN, str(exc))
                    return
                except StreamProtocolError as exc:
                    self._log.info("ext_proc stream refused: %s", exc.message)
                    if isinstance(context, RpcContext):  # no gateway does this: slow it down
                        context.penalize_peer(self._limits.protocol_error_pause)
                    await self._abort(stream, context, exc.code, exc.message)
                    return
                if not stream.unrouted and stream in self._unrouted:
                    del self._unrouted[stream]
                    if stream.unsupported_body_mode and not self._body_mode_noted:
                        self._body_mode_noted = True
                        logger.error(
                            "Envoy's ext_proc filter sends request bodies in mode %s: "
                            "requests with a body are refused (500); set "
                            "request_body_mode FULL_DUPLEX_STREAMED (or BUFFERED)",
                            stream.unsupported_body_mode,
                        )
                    if stream.bodyless and not self._bodyless_noted:
                        self._bodyless_noted = True
                        logger.info(
                            "Envoy sends no response bodies (response_body_mode NONE): "
                            "responses are seen by their headers and end only; token "
                            "usage, first-token times and the model name rewritten back "
                            "need FULL_DUPLEX_STREAMED (docs/decisions/0028)"
                        )
                for reply in replies:
                    await write(reply)
                if stream.finished or stream.complete:
                    # Ends the call now, not at Envoy's half-close (see the module doc).
                    return
        finally:
            if watch is not None:
                watch.stop()


class _IdleWatch:
    """Cancels the stream's task once it has waited ``idle`` seconds for Envoy's next
    message. One timer per stream, re-armed only when it fires: a message costs two
    attribute stores, not a timer."""

    __slots__ = ("_handle", "_idle", "_task", "expired", "loop", "waiting_since")

    def __init__(self, idle: float) -> None:
        self.loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        self._idle = idle
        self.waiting_since: float | None = None
        self.expired = False
        self._handle: asyncio.TimerHandle | None = self.loop.call_at(
            self.loop.time() + idle, self._check
        )

    def _check(self) -> None:
        since = self.waiting_since
        now = self.loop.time()
        if since is not None and now - since >= self._idle and self._task is not None:
            self.expired = True
            self._handle = None
            self._task.cancel()
            return
        due = (since if since is not None else now) + self._idle
        self._handle = self.loop.call_at(due, self._check)

    def uncancel(self) -> None:
        """Takes back the cancellation this watch made (the stream handles it)."""
        if self._task is not None:
            self._task.uncancel()

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


EXTPROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"


def add_extproc_servicer(servicer: ExtProcServicer, server: grpc.aio.Server) -> None:
    """Registers ``servicer`` as the generated ``add_ExternalProcessorServicer_to_server``
    does, but with ``serialize_reply`` as the response serializer, so that body replies
    encoded by hand go out as they are."""
    handlers = {
        "Process": grpc.stream_stream_rpc_method_handler(
            servicer.Process,
            request_deserializer=pb.ProcessingRequest.FromString,
            response_serializer=serialize_reply,
        )
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(EXTPROC_SERVICE, handlers),)
    )
    server.add_registered_method_handlers(EXTPROC_SERVICE, handlers)
