"""An OTLP/HTTP (binary protobuf) trace receiver on loopback, for tests.

Serves ``POST /v1/traces`` from a thread with the standard library's HTTP server, decodes
each body (gzip or not) with the OpenTelemetry protos and keeps span names and request
headers. ``fail_next`` answers that many requests with 503 first; a ``certificate`` serves
HTTPS.
"""

from __future__ import annotations

import gzip
import ssl
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from adapters.envoy.tls import ServerCertificate

__all__ = ["OtlpHttpReceiver"]


class OtlpHttpReceiver:
    def __init__(self, *, certificate: ServerCertificate | None = None) -> None:
        self.names: list[str] = []
        self.headers: list[dict[str, str]] = []
        self.paths: list[str] = []
        self.fail_next = 0
        self.refused = 0
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                with receiver._lock:
                    receiver.paths.append(self.path)
                    receiver.headers.append({k.lower(): v for k, v in self.headers.items()})
                    refuse = receiver.fail_next > 0
                    if refuse:
                        receiver.fail_next -= 1
                        receiver.refused += 1
                if refuse:
                    self.send_response(503)
                    self.send_header("content-length", "0")
                    self.end_headers()
                    return
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                request = ExportTraceServiceRequest.FromString(body)
                with receiver._lock:
                    for resource_spans in request.resource_spans:
                        for scope_spans in resource_spans.scope_spans:
                            receiver.names += [s.name for s in scope_spans.spans]
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: object) -> None:
                return None

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.scheme = "http"
        if certificate is not None:
            with tempfile.TemporaryDirectory() as directory:
                cert, key = Path(directory, "tls.crt"), Path(directory, "tls.key")
                cert.write_bytes(certificate.certificate_pem)
                key.write_bytes(certificate.private_key_pem)
                context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
                context.load_cert_chain(cert, key)
            self._server.socket = context.wrap_socket(self._server.socket, server_side=True)
            self.scheme = "https"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def base(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> OtlpHttpReceiver:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)

    def wait_for(self, count: int, *, timeout: float) -> list[str]:
        """The span names received, once there are ``count``; fails after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                names = list(self.names)
            if len(names) >= count:
                return names
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out waiting for {count} spans; received {names}")
            time.sleep(0.02)
