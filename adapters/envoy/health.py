"""The standard gRPC health service, answering from the EPP's readiness."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

__all__ = ["SERVICE_NAMES", "HealthServer", "HealthServicer"]

#: The service names the EPP reports in ``List``; ``Check`` answers for any name.
SERVICE_NAMES = ("", "liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor")

_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


_SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


class HealthServicer(health_pb2_grpc.HealthServicer):  # type: ignore[misc]
    """Every service is SERVING once ``ready()`` is true (the endpoint set is known).

    While draining after SIGTERM every service but ``liveness`` turns NOT_SERVING:
    the process is alive, just not taking new work.

    With leader election (``leader`` given), as the reference: ``liveness`` is always
    SERVING, the other names of ``SERVICE_NAMES`` are SERVING only while ``leader()`` is
    true as well, and any other name is SERVICE_UNKNOWN.
    """

    def __init__(self, ready: Callable[[], bool], leader: Callable[[], bool] | None = None) -> None:
        self._ready = ready
        self._leader = leader
        self._draining = False

    def start_draining(self) -> None:
        self._draining = True

    def serving(self) -> bool:
        """Whether ``readiness`` is SERVING."""
        return bool(self._status("readiness") == _SERVING)

    def _status(self, service: str) -> Any:
        if self._leader is not None:
            if service == "liveness":
                return _SERVING
            if service not in SERVICE_NAMES:
                return _SERVICE_UNKNOWN
            if not self._leader():
                return _NOT_SERVING
        if not self._ready():
            return _NOT_SERVING
        if self._draining and service != "liveness":
            return _NOT_SERVING
        return _SERVING

    async def Check(  # noqa: N802 - the gRPC method name
        self, request: Any, context: grpc.aio.ServicerContext[Any, Any]
    ) -> Any:
        return health_pb2.HealthCheckResponse(status=self._status(request.service))

    async def List(  # noqa: N802 - the gRPC method name
        self, request: Any, context: grpc.aio.ServicerContext[Any, Any]
    ) -> Any:
        response = health_pb2.HealthListResponse()
        for name in SERVICE_NAMES:
            response.statuses[name].status = self._status(name)
        return response

    async def Watch(  # noqa: N802 - the gRPC method name
        self, request: Any, context: grpc.aio.ServicerContext[Any, Any]
    ) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Watch is not implemented")


class HealthServer:
    """A gRPC server of the health service alone, on ``host:port`` (a pod's supervisor: the
    one health port of its workers). ``start`` raises ``OSError`` naming
    ``--grpc-health-port`` when it cannot listen; ``port`` is the bound port."""

    def __init__(self, servicer: HealthServicer, *, host: str, port: int) -> None:
        self.servicer = servicer
        self._address = f"{host}:{port}"
        self._server: grpc.aio.Server | None = None
        self.port = 0

    async def start(self) -> None:
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)
        try:
            port = server.add_insecure_port(self._address)
        except RuntimeError as exc:
            raise OSError(f"--grpc-health-port: cannot listen on {self._address}: {exc}") from exc
        if port == 0:
            raise OSError(f"--grpc-health-port: cannot listen on {self._address}")
        await server.start()
        self._server, self.port = server, port

    async def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            await server.stop(0)
