"""Shared fixture: the real ``GrpcServers`` on loopback, drained after the test; a test using
it runs once per ext_proc transport (``--extproc-transport``)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from adapters.envoy.server import TRANSPORTS, GrpcServers, ServerOptions
from adapters.envoy.tls import ServerCertificate
from ports.requests import RequestProcessor

#: ``await start_servers(processor, certificate=..., health_on_extproc_port=...)``
StartServers = Callable[..., Awaitable[GrpcServers]]


@pytest.fixture(params=TRANSPORTS)
async def start_servers(request: pytest.FixtureRequest) -> AsyncIterator[StartServers]:
    """Starts ``GrpcServers`` on 127.0.0.1 with OS-chosen ports, served by each transport in
    turn; drains them afterwards."""
    started: list[GrpcServers] = []

    async def start(
        processor: RequestProcessor,
        *,
        certificate: ServerCertificate | None = None,
        health_on_extproc_port: bool = False,
    ) -> GrpcServers:
        servers = GrpcServers(
            processor,
            ServerOptions(
                host="127.0.0.1",
                grpc_port=0,
                health_port=0,
                certificate=certificate,
                health_on_extproc_port=health_on_extproc_port,
                transport=str(request.param),
            ),
        )
        await servers.start()
        started.append(servers)
        return servers

    yield start
    for servers in reversed(started):
        await servers.drain(0)
