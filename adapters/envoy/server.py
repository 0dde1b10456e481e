"""The two gRPC servers: ext_proc (optionally TLS) and health (plaintext)."""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from grpc_health.v1 import health_pb2, health_pb2_grpc

from adapters.envoy.extproc import (
    EXTPROC_SERVICE,
    ExtProcServicer,
    StreamLimits,
    add_extproc_servicer,
    serialize_reply,
)
from adapters.envoy.h2 import H2GrpcServer, H2Limits, MethodHandler
from adapters.envoy.health import HealthServicer
from adapters.envoy.tls import (
    CertificateReloader,
    ServerCertificate,
    reloading_ssl_context,
    server_credentials,
    ssl_context,
)
from ports.observer import Observer
from ports.requests import RequestProcessor

__all__ = ["TRANSPORTS", "GrpcServers"]

#: ``--extproc-transport``: what serves the ext_proc port. ``grpcio`` is grpc.aio;
#: ``native`` is ``adapters.envoy.h2``, a third of its CPU per message (docs/decisions/0020).
TRANSPORTS = ("grpcio", "native")

logger = logging.getLogger(__name__)

_OPTIONS = [
    ("grpc.so_reuseport", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
# Workers of one pod share the ext_proc port. Connections, not streams, go to workers, and a
# gateway keeps few long-lived HTTP/2 connections: each connection is asked to reconnect
# (GOAWAY, in-flight streams finish; the age is jittered by 10 %) after
# SHARED_PORT_CONNECTION_AGE_MS, so the gateway's streams are re-spread over the workers.
# The cost is one TLS handshake per gateway connection per period, and the move of its
# streams to another process, which grows with how often they move: on the 2-core bench
# machine 2 workers used a median 18 % more CPU per request than one at 250 ms, 15-39 % at
# 500 ms and 3-12 % at 1 s (docs/decisions/0023).
SHARED_PORT_CONNECTION_AGE_MS = 1000
_SHARED_PORT_OPTIONS = [
    *((k, 1 if k == "grpc.so_reuseport" else v) for k, v in _OPTIONS),
    ("grpc.max_connection_age_ms", SHARED_PORT_CONNECTION_AGE_MS),
]


class GrpcServers:
    """Serves ext_proc on ``grpc_port`` and health on ``health_port``.

    ``start`` binds both (raising ``OSError`` naming the port if it cannot);
    ``drain`` turns readiness to NOT_SERVING, refuses new streams and waits up to
    ``grace`` seconds for in-flight streams before cancelling them. ``limits`` bound each
    stream; past ``max_concurrent_streams`` ext_proc streams (0: no limit) a new one is
    refused with ``RESOURCE_EXHAUSTED``. With ``reload_certificate_from`` (a directory of
    ``tls.crt`` and ``tls.key``) a renewed certificate is served to new connections
    (``CertificateReloader``). With ``client_ca`` (PEM CA certificates) a client must present
    a certificate signed by one of them (mTLS): a peer without one fails the handshake,
    before gRPC makes a call of its streams. The message size limits apply to the ext_proc
    server. With ``leader`` (leader election), readiness also needs ``leader()``
    (``HealthServicer``). ``shared_port``: the ext_proc port is shared with the pod's other
    workers, so each connection is asked to reconnect now and then; with ``handoff`` (the
    native transport) the server takes the connections the pod's supervisor accepts and
    hands over on that unix socket, without listening itself, else it binds with
    ``SO_REUSEPORT``; ``health_port`` None serves no health port (a worker: its
    supervisor serves the pod's). One HTTP/2 connection may open at most
    ``max_streams_per_connection`` ext_proc streams at once (SETTINGS_MAX_CONCURRENT_STREAMS;
    0: no limit): a peer holding many streams on a few connections cannot flood the queue of
    calls gRPC holds before the server takes them, where past its hard limit (3,000) every
    new stream, Envoy's too, is cancelled; Envoy opens more connections when one is full.
    ``transport`` picks the ext_proc server (``TRANSPORTS``); the health port is grpc.aio.
    ``cipher_suites`` (OpenSSL names) limit the native transport's TLS 1.2 suites (grpc.aio
    reads ``GRPC_SSL_CIPHER_SUITES`` instead).
    """

    def __init__(
        self,
        *,
        processor: RequestProcessor,
        host: str,
        grpc_port: int,
        health_port: int | None,
        certificate: ServerCertificate | None,
        health_on_extproc_port: bool = False,
        observer: Observer | None = None,
        limits: StreamLimits | None = None,
        max_concurrent_streams: int = 0,
        reload_certificate_from: Path | None = None,
        max_receive_message_length: int = 64 * 1024 * 1024,
        max_send_message_length: int = 64 * 1024 * 1024,
        leader: Callable[[], bool] | None = None,
        shared_port: bool = False,
        handoff: socket.socket | None = None,
        max_streams_per_connection: int = 0,
        client_ca: bytes | None = None,
        transport: str = "native",
        cipher_suites: tuple[str, ...] = (),
        stream_metrics: bool = False,
    ) -> None:
        self._ciphers = cipher_suites
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, not {transport!r}")
        self._transport_kind = transport
        self._shared_port = shared_port
        self._handoff = handoff
        self._max_receive = max_receive_message_length
        self._max_send = max_send_message_length
        self._host = host
        self._grpc_port = grpc_port
        self._health_port = health_port
        self._certificate = certificate
        self.reloader: CertificateReloader | None = None
        if certificate is not None and reload_certificate_from is not None:
            self.reloader = CertificateReloader(reload_certificate_from, certificate, client_ca)
        self._client_ca = client_ca
        self._extproc_options = [
            *(_SHARED_PORT_OPTIONS if shared_port else _OPTIONS),
            ("grpc.max_receive_message_length", max_receive_message_length),
            ("grpc.max_send_message_length", max_send_message_length),
        ]
        self.health = HealthServicer(processor.ready, leader)
        self._extproc = ExtProcServicer(processor, observer, limits, stream_metrics=stream_metrics)
        self._max_concurrent_streams = max_concurrent_streams or None
        self._max_streams_per_connection = max_streams_per_connection
        self._health_on_extproc_port = health_on_extproc_port
        self._servers: list[Any] = []
        self.bound_grpc_port = 0
        self.bound_health_port = 0

    def _native_server(self) -> H2GrpcServer:
        handlers = {
            f"/{EXTPROC_SERVICE}/Process": MethodHandler(
                self._extproc.Process,
                pb.ProcessingRequest.FromString,
                serialize_reply,
                streaming=True,
            )
        }
        if self._health_on_extproc_port:
            for method, request in (
                ("Check", health_pb2.HealthCheckRequest),
                ("List", health_pb2.HealthListRequest),
                ("Watch", health_pb2.HealthCheckRequest),
            ):
                handlers[f"/grpc.health.v1.Health/{method}"] = MethodHandler(
                    getattr(self.health, method),
                    request.FromString,
                    _serialize_message,
                    streaming=False,
                )
        if self.reloader is not None:
            context = reloading_ssl_context(self.reloader, self._ciphers)
        elif self._certificate is not None:
            context = ssl_context(self._certificate, self._client_ca, self._ciphers)
        else:
            context = None
        limits = H2Limits(
            max_concurrent_rpcs=self._max_concurrent_streams or 0,
            max_streams_per_connection=self._max_streams_per_connection,
            max_receive_message_length=self._max_receive,
            max_send_message_length=self._max_send,
            max_connection_age=SHARED_PORT_CONNECTION_AGE_MS / 1000 if self._shared_port else 0.0,
        )
        return H2GrpcServer(
            handlers, limits=limits, ssl_context=context, reuse_port=self._shared_port
        )

    async def _start_native(self) -> Any:
        server = self._native_server()
        if self._handoff is not None:
            server.start_handed(self._handoff)
            self.bound_grpc_port = self._grpc_port
            return server
        address = f"{self._host}:{self._grpc_port}"
        try:
            self.bound_grpc_port = await server.start(self._host, self._grpc_port)
        except OSError as exc:
            raise OSError(f"--grpc-port: cannot listen on {address}: {exc}") from exc
        return server

    async def start(self) -> None:
        if self._transport_kind == "native":
            extproc_server = await self._start_native()
            await self._start_health(extproc_server)
            return
        options = list(self._extproc_options)
        if self._max_streams_per_connection:
            options.append(("grpc.max_concurrent_streams", self._max_streams_per_connection))
        extproc_server = grpc.aio.server(
            options=options, maximum_concurrent_rpcs=self._max_concurrent_streams
        )
        add_extproc_servicer(self._extproc, extproc_server)
        if self._health_on_extproc_port:
            health_pb2_grpc.add_HealthServicer_to_server(self.health, extproc_server)
        address = f"{self._host}:{self._grpc_port}"
        try:
            if self.reloader is not None:
                credentials = self.reloader.credentials()
                self.bound_grpc_port = extproc_server.add_secure_port(address, credentials)
            elif self._certificate is not None:
                credentials = server_credentials(self._certificate, self._client_ca)
                self.bound_grpc_port = extproc_server.add_secure_port(address, credentials)
            else:
                self.bound_grpc_port = extproc_server.add_insecure_port(address)
        except RuntimeError as exc:
            raise OSError(f"--grpc-port: cannot listen on {address}: {exc}") from exc
        if self.bound_grpc_port == 0:
            raise OSError(f"--grpc-port: cannot listen on {address}")
        await self._start_health(extproc_server)

    async def _start_health(self, extproc_server: Any) -> None:
        if self._health_port is None:
            if isinstance(extproc_server, grpc.aio.Server):
                await extproc_server.start()
            self._servers = [extproc_server]
            logger.info(
                "ext_proc serving on %s:%d (%s, shared port)",
                self._host,
                self.bound_grpc_port,
                self._transport(),
            )
            return
        health_server = grpc.aio.server(options=_OPTIONS)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, health_server)
        health_address = f"{self._host}:{self._health_port}"
        try:
            self.bound_health_port = health_server.add_insecure_port(health_address)
        except RuntimeError as exc:
            raise OSError(f"--grpc-health-port: cannot listen on {health_address}: {exc}") from exc
        if self.bound_health_port == 0:
            raise OSError(f"--grpc-health-port: cannot listen on {health_address}")

        if isinstance(extproc_server, grpc.aio.Server):
            await extproc_server.start()
        await health_server.start()
        self._servers = [extproc_server, health_server]
        logger.info(
            "ext_proc serving on %s:%d (%s), health on %s:%d",
            self._host,
            self.bound_grpc_port,
            self._transport(),
            self._host,
            self.bound_health_port,
        )

    def handed_connections(self) -> tuple[int, int, int] | None:
        """With ``handoff``: the connections taken off it so far, those open that still take
        new streams, and the ext_proc calls started so far (what the supervisor weighs when
        it hands the next connection); else None."""
        if self._handoff is None or not self._servers:
            return None
        server = self._servers[0]
        if not isinstance(server, H2GrpcServer):
            return None
        return server.handed_received, server.accepting_connections(), server.calls_started

    def _transport(self) -> str:
        native = ["native transport"] if self._transport_kind == "native" else []
        if self._certificate is None:
            return ", ".join(("plaintext", *native))
        return ", ".join(
            (
                "TLS",
                *native,
                *(["client certificates required"] if self._client_ca is not None else []),
                *(["certificate reloaded when renewed"] if self.reloader else []),
            )
        )

    async def drain(self, grace: float) -> None:
        if not self._servers:
            return
        self.health.start_draining()
        extproc_server, *health_server = self._servers
        await extproc_server.stop(grace)
        for server in health_server:
            await server.stop(0)
        self._servers = []


def _serialize_message(message: Any) -> bytes:
    return bytes(message.SerializeToString())
