"""An OTLP/gRPC trace receiver on loopback, for tests and benchmarks.

Implements OpenTelemetry's ``TraceService.Export`` with ``grpc.aio`` on its own event loop
in a background thread (so blocking test code can run beside it) and keeps every exported
span, flattened with its resource's ``service.name``.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from adapters.envoy.tls import ServerCertificate

__all__ = ["OtlpReceiver", "ReceivedSpan"]

_SERVER = 2  # Span.SpanKind.SPAN_KIND_SERVER


@dataclass(frozen=True, slots=True)
class ReceivedSpan:
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int
    attributes: dict[str, object]
    service_name: str
    status_code: int
    start_ns: int
    end_ns: int
    status_message: str = ""
    trace_state: str = ""
    flags: int = 0


def _value(any_value: Any) -> object:
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


def _attributes(key_values: Any) -> dict[str, object]:
    return {kv.key: _value(kv.value) for kv in key_values}


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, sink: Callable[[Any, dict[str, str]], None]) -> None:
        self._sink = sink

    async def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC name
        self._sink(request, {k: v for k, v in context.invocation_metadata() or ()})
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpReceiver:
    """``start()`` binds 127.0.0.1 on ``port`` (0: a free one; see ``endpoint``), with TLS
    when given a ``certificate``; ``stop()`` shuts down. ``metadata`` holds each export
    call's gRPC metadata."""

    def __init__(
        self,
        *,
        count_only: bool = False,
        port: int = 0,
        certificate: ServerCertificate | None = None,
    ) -> None:
        self.port = port
        self.requests = 0
        self.metadata: list[dict[str, str]] = []
        self._certificate = certificate
        #: Spans received; with ``count_only`` (benchmarks) they are only counted, not kept.
        self.count = 0
        #: Of those, the SERVER spans (one per traced request from the EPP).
        self.server_spans = 0
        self._count_only = count_only
        self._spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    @property
    def endpoint(self) -> str:
        scheme = "https" if self._certificate is not None else "http"
        return f"{scheme}://127.0.0.1:{self.port}"

    def start(self) -> OtlpReceiver:
        self._thread = threading.Thread(target=self._run, name="otlp-receiver", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise TimeoutError("the OTLP receiver did not start")
        if self._error is not None:
            raise RuntimeError("the OTLP receiver failed to start") from self._error
        return self

    def stop(self) -> None:
        """Stop serving and wait (up to 10 s) for the receiver's thread to end."""
        loop, stopping = self._loop, self._stopping
        if loop is not None and stopping is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(stopping.set)
        if self._thread is not None:
            self._thread.join(10)

    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)

    def wait_for(
        self, condition: Callable[[list[ReceivedSpan]], bool], *, timeout: float, what: str
    ) -> list[ReceivedSpan]:
        """Poll the received spans until ``condition`` holds; fail after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            spans = self.spans()
            if condition(spans):
                return spans
            if time.monotonic() > deadline:
                names = sorted({s.name for s in spans})
                raise TimeoutError(f"timed out waiting for {what}; received {names}")
            time.sleep(0.02)

    def _collect(self, request: Any, metadata: dict[str, str]) -> None:
        with self._lock:
            self.metadata.append(metadata)
        if self._count_only:
            count = servers = 0
            for resource_spans in request.resource_spans:
                for scope_spans in resource_spans.scope_spans:
                    count += len(scope_spans.spans)
                    servers += sum(1 for span in scope_spans.spans if span.kind == _SERVER)
            with self._lock:
                self.requests += 1
                self.count += count
                self.server_spans += servers
            return
        received = []
        for resource_spans in request.resource_spans:
            service = str(_attributes(resource_spans.resource.attributes).get("service.name"))
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(
                        ReceivedSpan(
                            name=span.name,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            kind=span.kind,
                            attributes=_attributes(span.attributes),
                            service_name=service,
                            status_code=span.status.code,
                            start_ns=span.start_time_unix_nano,
                            end_ns=span.end_time_unix_nano,
                            status_message=span.status.message,
                            trace_state=span.trace_state,
                            flags=span.flags,
                        )
                    )
        with self._lock:
            self.requests += 1
            self.count += len(received)
            self.server_spans += sum(1 for span in received if span.kind == _SERVER)
            self._spans.extend(received)

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._serve())
        except BaseException as exc:  # reported to start()
            self._error = exc
            self._ready.set()
        finally:
            loop.close()

    async def _serve(self) -> None:
        server = grpc.aio.server()
        add_servicer: Callable[[Any, Any], None] = (
            trace_service_pb2_grpc.add_TraceServiceServicer_to_server
        )
        add_servicer(_TraceService(self._collect), server)
        address = f"127.0.0.1:{self.port}"
        if self._certificate is None:
            self.port = server.add_insecure_port(address)
        else:
            credentials = grpc.ssl_server_credentials(
                [(self._certificate.private_key_pem, self._certificate.certificate_pem)]
            )
            self.port = server.add_secure_port(address, credentials)
        await server.start()
        self._stopping = asyncio.Event()
        self._ready.set()
        await self._stopping.wait()
        await server.stop(0)
