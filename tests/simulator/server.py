"""One simulated vLLM instance: an aiohttp server bound to its own address."""

from __future__ import annotations

import hashlib
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self

from aiohttp import web
from aiohttp.typedefs import Handler

from tests.simulator.config import SimulatorConfig
from tests.simulator.engine import SimulatedEngine
from tests.simulator.kvevents import KVEventPublisher
from tests.simulator.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from tests.simulator.metrics import render_metrics
from tests.simulator.protocol import (
    SSE_DONE,
    ApiError,
    Endpoint,
    GenerationRequest,
    ResponseBuilder,
    encode_json,
    parse_request,
    sse_event,
)
from tests.simulator.scheduler import RequestState
from tests.simulator.stats import EngineStats

INSTANCE_HEADER = "x-simulator-instance"
REQUEST_ID_HEADER = "x-request-id"
#: The prompt tokens this server held cached when the request arrived (before queueing):
#: what a prefix index predicting this server's cache should have said.
CACHED_ON_ARRIVAL_HEADER = "x-simulator-cached-on-arrival"
_CACHED_ON_ARRIVAL = web.RequestKey("cached_on_arrival", int)
RECEIVED_BYTES_HEADER = "x-simulator-received-bytes"
BODY_SHA256_HEADER = "x-simulator-body-sha256"
#: The ``x-gateway-destination-endpoint`` request header this instance received, echoed.
DESTINATION_SEEN_HEADER = "x-simulator-destination-endpoint"
#: The ``x-prefiller-host-port`` request header (P/D disaggregation) this instance received.
PREFILLER_SEEN_HEADER = "x-simulator-prefiller-host-port"
#: Response header echoing the W3C ``traceparent`` the request arrived with.
TRACEPARENT_SEEN_HEADER = "x-simulator-traceparent"
#: The ``x-data-parallel-rank`` the request arrived with (the engine it was pinned to).
RANK_SEEN_HEADER = "x-simulator-data-parallel-rank"


@dataclass(frozen=True, slots=True)
class _BodyInfo:
    length: int
    sha256: str


_BODY_INFO = web.RequestKey("body_info", _BodyInfo)


@web.middleware
async def _capture_body(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Read the whole body up front so every response can report its size and digest."""
    body = await request.read()
    request[_BODY_INFO] = _BodyInfo(len(body), hashlib.sha256(body).hexdigest())
    return await handler(request)


def _json_response(payload: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=encode_json(payload), content_type="application/json")


class ModelServerSimulator:
    """A vLLM-compatible HTTP server simulating one model-server instance.

    Serves ``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST /v1/messages``
    (the Anthropic Messages API, non-streaming only), ``GET /v1/models``,
    ``GET /health``, ``GET /metrics`` (vLLM's metric names) and ``GET /sim/stats`` (the
    engine's counters and latency summaries as JSON; ``?samples=1`` adds every TTFT and
    end-to-end latency). A request whose client disconnects is aborted.

    ``port=0`` binds a free port; :attr:`port` and :attr:`url` report it once started.
    Usable as an async context manager (start on enter, stop on exit).
    """

    def __init__(
        self,
        config: SimulatorConfig | None = None,
        *,
        name: str = "sim-0",
        host: str = "127.0.0.2",
        port: int = 8000,
    ) -> None:
        if not 0 <= port <= 65535:
            raise ValueError(f"port must be within 0..65535, got {port}")
        self._config = config if config is not None else SimulatorConfig()
        self._name = name
        self._host = host
        self.metrics_scrapes = 0
        self._requested_port = port
        self._bound_port: int | None = None
        self._engine = SimulatedEngine(self._config)
        self._runner: web.AppRunner | None = None
        self._kv_events: KVEventPublisher | None = None

    @property
    def name(self) -> str:
        return self._name

    @property
    def config(self) -> SimulatorConfig:
        return self._config

    @property
    def address(self) -> str:
        """The IP address the instance listens on."""
        return self._host

    @property
    def port(self) -> int:
        """The listening port (the bound one once started)."""
        if self._bound_port is not None:
            return self._bound_port
        if self._requested_port == 0:
            raise RuntimeError(f"{self._name}: port 0 is only resolved once started")
        return self._requested_port

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.2:8000``."""
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"http://{host}:{self.port}"

    @property
    def kv_events(self) -> KVEventPublisher | None:
        """The KV-event publisher while running with ``config.kv_events``."""
        return self._kv_events

    @property
    def kv_events_topic(self) -> str:
        """The topic of the KV-event messages: ``kv@<address>@<model>``."""
        return f"kv@{self._host}@{self._config.model_name}"

    @property
    def running(self) -> bool:
        return self._runner is not None

    def stats(self, *, with_samples: bool = True) -> EngineStats:
        """The engine's counters, gauges and latency records (simulated seconds)."""
        return self._engine.stats(with_samples=with_samples)

    def stats_document(self, *, include_samples: bool = False) -> dict[str, Any]:
        """The JSON document of ``GET /sim/stats`` (``?samples=1``: ``include_samples``)."""
        config = self._config
        document: dict[str, Any] = {
            "name": self._name,
            "model": config.model_name,
            "time_scale": config.time_scale,
            "block_size": config.block_size,
            "num_gpu_blocks": config.num_gpu_blocks,
            "max_num_seqs": config.max_num_seqs,
            "max_loras": config.max_loras,
            # GET /metrics answered so far: what the EPP's scrapers cost this server.
            "metrics_scrapes": self.metrics_scrapes,
        }
        document.update(self.stats().document(include_samples=include_samples))
        return document

    async def start(self) -> None:
        if self._runner is not None:
            raise RuntimeError(f"{self._name} is already running")
        runner = web.AppRunner(
            self._build_app(),
            access_log=None,
            shutdown_timeout=self._config.shutdown_timeout,
            # like vLLM, abort a request whose client went away
            handler_cancellation=True,
        )
        await runner.setup()
        try:
            site = web.TCPSite(runner, self._host, self._requested_port)
            await site.start()
            self._bound_port = int(runner.addresses[0][1])
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        if self._config.kv_events:
            host = f"[{self._host}]" if ":" in self._host else self._host
            publisher = KVEventPublisher(
                endpoint=f"tcp://{host}:{self._config.kv_events_port or '*'}",
                replay_endpoint=f"tcp://{host}:{self._config.kv_events_replay_port or '*'}",
                topic=self.kv_events_topic,
                block_size=self._config.block_size,
            )
            publisher.start()
            self._kv_events = publisher
            self._engine.scheduler.kv_cache.listener = publisher

    async def stop(self) -> None:
        """Stop listening and close every connection within ``shutdown_timeout``."""
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
        publisher, self._kv_events = self._kv_events, None
        if publisher is not None:
            self._engine.scheduler.kv_cache.listener = None
            await publisher.stop()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    def __repr__(self) -> str:
        port = self._bound_port if self._bound_port is not None else self._requested_port
        return f"ModelServerSimulator(name={self._name!r}, host={self._host!r}, port={port})"

    def _build_app(self) -> web.Application:
        app = web.Application(
            client_max_size=self._config.max_request_bytes, middlewares=[_capture_body]
        )
        app.on_response_prepare.append(self._stamp_headers)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat_completions)
        app.router.add_post("/v1/messages", self._messages)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_post("/reset_prefix_cache", self._reset_prefix_cache)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/sim/stats", self._sim_stats)
        app.router.add_post("/sim/kv-events/drop", self._drop_kv_events)
        return app

    async def _stamp_headers(self, request: web.BaseRequest, response: web.StreamResponse) -> None:
        response.headers[INSTANCE_HEADER] = self._name
        request_id = request.headers.get(REQUEST_ID_HEADER)
        if request_id is not None:
            response.headers[REQUEST_ID_HEADER] = request_id
        destination = request.headers.get("x-gateway-destination-endpoint")
        if destination is not None:
            response.headers[DESTINATION_SEEN_HEADER] = destination
        prefiller = request.headers.get("x-prefiller-host-port")
        if prefiller is not None:
            response.headers[PREFILLER_SEEN_HEADER] = prefiller
        traceparent = request.headers.get("traceparent")
        if traceparent is not None:
            response.headers[TRACEPARENT_SEEN_HEADER] = traceparent
        rank = request.headers.get("x-data-parallel-rank")
        if rank is not None:
            response.headers[RANK_SEEN_HEADER] = rank
        cached_on_arrival = request.get(_CACHED_ON_ARRIVAL)
        if cached_on_arrival is not None:
            response.headers[CACHED_ON_ARRIVAL_HEADER] = str(cached_on_arrival)
        body_info = request.get(_BODY_INFO)
        if body_info is not None:
            response.headers[RECEIVED_BYTES_HEADER] = str(body_info.length)
            response.headers[BODY_SHA256_HEADER] = body_info.sha256

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve_generation(request, Endpoint.COMPLETIONS)

    async def _chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve_generation(request, Endpoint.CHAT)

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        """An Anthropic Messages response (not streamed), generated like a chat request;
        usage in Anthropic's fields (cached prompt tokens as ``cache_read_input_tokens``)."""
        try:
            parsed = parse_request(
                Endpoint.CHAT, await request.read(), self._config.default_max_tokens
            )
        except ApiError as exc:
            return _json_response(exc.body(), status=exc.status)
        message_id = request.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex
        state = self._engine.new_request(message_id, parsed.model, parsed.prompt, parsed.max_tokens)
        async with aclosing(self._engine.generate(state)) as tokens:
            text = "".join([token async for token in tokens])
        cached = state.first_cached_tokens or 0
        return _json_response(
            {
                "id": f"msg_{message_id}",
                "type": "message",
                "role": "assistant",
                "model": parsed.model,
                "content": [{"type": "text", "text": text}],
                "stop_reason": "max_tokens",
                "usage": {
                    "input_tokens": parsed.prompt_tokens - cached,
                    "cache_read_input_tokens": cached,
                    "output_tokens": state.generated_tokens,
                },
            }
        )

    async def _serve_generation(
        self, request: web.Request, endpoint: Endpoint
    ) -> web.StreamResponse:
        try:
            parsed = parse_request(endpoint, await request.read(), self._config.default_max_tokens)
        except ApiError as exc:
            return _json_response(exc.body(), status=exc.status)
        builder = ResponseBuilder(
            parsed, request.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex
        )
        try:
            state = self._engine.new_request(
                builder.response_id, parsed.model, parsed.prompt, parsed.max_tokens
            )
        except ValueError as exc:
            error = ApiError(f"This model's maximum context length is exceeded: {exc}.")
            return _json_response(error.body(), status=error.status)
        request[_CACHED_ON_ARRIVAL] = self._engine.cached_prefix_tokens(state)
        if parsed.stream:
            return await self._stream(request, parsed, builder, state)
        async with aclosing(self._engine.generate(state)) as tokens:
            text = "".join([token async for token in tokens])
        return _json_response(
            builder.full_response(text, state.generated_tokens, self._cached_tokens(state))
        )

    def _cached_tokens(self, state: RequestState) -> int | None:
        if not self._config.enable_prompt_tokens_details:
            return None
        return state.first_cached_tokens or 0

    async def _stream(
        self,
        request: web.Request,
        parsed: GenerationRequest,
        builder: ResponseBuilder,
        state: RequestState,
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream; charset=utf-8",
                "Cache-Control": "no-cache",
            }
        )
        await response.prepare(request)
        role_chunk = builder.role_chunk()
        async with aclosing(self._engine.generate(state)) as tokens:
            async for token in tokens:
                if role_chunk is not None:
                    await response.write(sse_event(role_chunk))
                    role_chunk = None
                last = state.generated_tokens == state.max_tokens
                await response.write(sse_event(builder.token_chunk(token, last=last)))
        if parsed.include_usage:
            chunk = builder.usage_chunk(state.generated_tokens, self._cached_tokens(state))
            await response.write(sse_event(chunk))
        await response.write(SSE_DONE)
        await response.write_eof()
        return response

    async def _models(self, request: web.Request) -> web.Response:
        created = int(time.time())
        parents: list[tuple[str, str | None]] = [
            (name, None) for name in self._config.served_model_names
        ]
        parents += [(name, self._config.model_name) for name in self._config.lora_adapters]
        data = [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": name,
                "parent": parent,
            }
            for name, parent in parents
        ]
        return _json_response({"object": "list", "data": data})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _reset_prefix_cache(self, request: web.Request) -> web.Response:
        """vLLM's dev endpoint: drop every cached block; 409 while requests hold blocks."""
        if self._engine.scheduler.kv_cache.reset():
            return web.Response(status=200)
        return web.Response(status=409, text="requests are running")

    async def _metrics(self, request: web.Request) -> web.Response:
        self.metrics_scrapes += 1
        text = render_metrics(self._config, self._engine.stats(), time.time())
        return web.Response(body=text.encode(), headers={"Content-Type": METRICS_CONTENT_TYPE})

    async def _drop_kv_events(self, request: web.Request) -> web.Response:
        """Lose the next ``count`` KV-event batches (a sequence gap the subscribers see);
        ``replayable=false``: from the replay buffer too."""
        publisher = self._kv_events
        if publisher is None:
            return web.Response(status=409, text="no KV events")
        try:
            count = int(request.query.get("count", "1"))
        except ValueError:
            return web.Response(status=400, text="count: not an integer")
        replayable = request.query.get("replayable", "true").lower() not in {"0", "false", "no"}
        publisher.drop_next(count, replayable=replayable)
        return web.Response(status=200)

    async def _sim_stats(self, request: web.Request) -> web.Response:
        samples = request.query.get("samples", "").lower() in {"1", "true", "yes"}
        return _json_response(self.stats_document(include_samples=samples))
