"""The two gRPC servers: ext_proc (optionally TLS) and health (plaintext)."""

from __future__ import annotations

import logging
from typing import Any

import grpc
from grpc_health.v1 import health_pb2_grpc

from adapters.envoy.extproc import ExtProcServicer, StreamLimits, add_extproc_servicer
from adapters.envoy.health import HealthServicer
from adapters.envoy.tls import ServerCertificate
from ports.observer import Observer
from ports.requests import RequestProcessor

__all__ = ["GrpcServers"]

logger = logging.getLogger(__name__)

_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.so_reuseport", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]


class GrpcServers:
    """Serves ext_proc on ``grpc_port`` and health on ``health_port``.

    ``start`` binds both (raising ``OSError`` naming the port if it cannot);
    ``drain`` turns readiness to NOT_SERVING, refuses new streams and waits up to
    ``grace`` seconds for in-flight streams before cancelling them. ``limits`` bound each
    stream; past ``max_concurrent_streams`` ext_proc streams (0: no limit) a new one is
    refused with ``RESOURCE_EXHAUSTED``.
    """

    def __init__(
        self,
        *,
        processor: RequestProcessor,
        host: str,
        grpc_port: int,
        health_port: int,
        certificate: ServerCertificate | None,
        health_on_extproc_port: bool = False,
        observer: Observer | None = None,
        limits: StreamLimits | None = None,
        max_concurrent_streams: int = 0,
    ) -> None:
        self._host = host
        self._grpc_port = grpc_port
        self._health_port = health_port
        self._certificate = certificate
        self.health = HealthServicer(processor.ready)
        self._extproc = ExtProcServicer(processor, observer, limits)
        self._max_concurrent_streams = max_concurrent_streams or None
        self._health_on_extproc_port = health_on_extproc_port
        self._servers: list[Any] = []
        self.bound_grpc_port = 0
        self.bound_health_port = 0

    async def start(self) -> None:
        extproc_server = grpc.aio.server(
            options=_OPTIONS, maximum_concurrent_rpcs=self._max_concurrent_streams
        )
        add_extproc_servicer(self._extproc, extproc_server)
        if self._health_on_extproc_port:
            health_pb2_grpc.add_HealthServicer_to_server(self.health, extproc_server)
        address = f"{self._host}:{self._grpc_port}"
        try:
            if self._certificate is not None:
                credentials = grpc.ssl_server_credentials(
                    [(self._certificate.private_key_pem, self._certificate.certificate_pem)]
                )
                self.bound_grpc_port = extproc_server.add_secure_port(address, credentials)
            else:
                self.bound_grpc_port = extproc_server.add_insecure_port(address)
        except RuntimeError as exc:
            raise OSError(f"--grpc-port: cannot listen on {address}: {exc}") from exc
        if self.bound_grpc_port == 0:
            raise OSError(f"--grpc-port: cannot listen on {address}")

        health_server = grpc.aio.server(options=_OPTIONS)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, health_server)
        health_address = f"{self._host}:{self._health_port}"
        try:
            self.bound_health_port = health_server.add_insecure_port(health_address)
        except RuntimeError as exc:
            raise OSError(f"--grpc-health-port: cannot listen on {health_address}: {exc}") from exc
        if self.bound_health_port == 0:
            raise OSError(f"--grpc-health-port: cannot listen on {health_address}")

        await extproc_server.start()
        await health_server.start()
        self._servers = [extproc_server, health_server]
        logger.info(
            "ext_proc serving on %s:%d (%s), health on %s:%d",
            self._host,
            self.bound_grpc_port,
            "TLS" if self._certificate else "plaintext",
            self._host,
            self.bound_health_port,
        )

    async def drain(self, grace: float) -> None:
        if not self._servers:
            return
        self.health.start_draining()
        extproc_server, health_server = self._servers
        await extproc_server.stop(grace)
        await health_server.stop(0)
        self._servers = []
