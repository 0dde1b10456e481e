"""The gRPC health service of the real ``GrpcServers``, asked as a kubelet or Envoy would."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from adapters.envoy.server import GrpcServers
from domain.datastore import Datastore
from ports.endpoints import EndpointAddress, EndpointEvent, EndpointEventKind, EndpointInfo
from tests.fakes import FakeProcessor
from tests.support.director import configured_director

DEADLINE = 5.0
SERVICES = ("", "liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor")
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

#: the ``start_servers`` fixture of conftest.py
StartServers = Callable[..., Awaitable[GrpcServers]]


def _service_params() -> list[Any]:
    return [pytest.param(name, id=name or "overall") for name in SERVICES]


@pytest.fixture
def datastore() -> Datastore:
    store = Datastore()
    store.apply(
        EndpointEvent(
            kind=EndpointEventKind.ADD_OR_UPDATE,
            endpoint=EndpointInfo(
                name="10.0.0.1:8000", address=EndpointAddress(ip="10.0.0.1", port=8000)
            ),
        )
    )
    return store  # not synced yet


@pytest.fixture
async def servers(start_servers: StartServers, datastore: Datastore) -> GrpcServers:
    director = configured_director(datastore)
    return await start_servers(director)


@pytest.fixture
async def health(servers: GrpcServers) -> AsyncIterator[Any]:
    """A Health stub on the health port."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{servers.bound_health_port}") as channel:
        yield health_pb2_grpc.HealthStub(channel)


async def check(stub: Any, service: str) -> Any:
    response = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=DEADLINE)
    return response.status


async def eventually_status(stub: Any, service: str, status: Any) -> None:
    """Poll ``Check`` until it answers ``status``, up to ``DEADLINE`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE
    while (current := await check(stub, service)) != status:
        assert loop.time() < deadline, f"{service!r} stayed {current}"
        await asyncio.sleep(0.01)


def extproc_request() -> list[Any]:
    """A small completions request as Envoy sends it: headers, then the whole body."""
    headers = base_pb2.HeaderMap(
        headers=[
            base_pb2.HeaderValue(key=":path", raw_value=b"/v1/completions"),
            base_pb2.HeaderValue(key=":method", raw_value=b"POST"),
        ]
    )
    return [
        pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=headers)),
        pb.ProcessingRequest(
            request_body=pb.HttpBody(body=b'{"model":"m","prompt":"p"}', end_of_stream=True)
        ),
    ]


# --- Check and List ----------------------------------------------------------------------------


@pytest.mark.parametrize("service", _service_params())
async def test_not_serving_before_the_datastore_is_synced(health: Any, service: str) -> None:
    assert await check(health, service) == NOT_SERVING


@pytest.mark.parametrize("service", SERVICES)
async def test_serving_after_the_datastore_is_synced(
    health: Any, datastore: Datastore, service: str
) -> None:
    datastore.mark_synced()
    assert await check(health, service) == SERVING


async def test_list_reports_the_four_services(health: Any, datastore: Datastore) -> None:
    datastore.mark_synced()
    response = await health.List(health_pb2.HealthListRequest(), timeout=DEADLINE)
    assert {name: s.status for name, s in response.statuses.items()} == dict.fromkeys(
        SERVICES, SERVING
    )


async def test_list_before_sync_reports_readiness_not_serving(health: Any) -> None:
    response = await health.List(health_pb2.HealthListRequest(), timeout=DEADLINE)
    assert set(response.statuses) == set(SERVICES)
    assert response.statuses["readiness"].status == NOT_SERVING
    assert response.statuses[""].status == NOT_SERVING


async def test_watch_is_unimplemented(health: Any) -> None:
    call = health.Watch(health_pb2.HealthCheckRequest(service="readiness"), timeout=DEADLINE)
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await call.read()
    assert failure.value.code() == grpc.StatusCode.UNIMPLEMENTED


# --- draining ----------------------------------------------------------------------------------


async def test_drain_turns_readiness_off_refuses_new_streams_and_finishes_in_flight(
    start_servers: StartServers,
) -> None:
    fake = FakeProcessor(block_route=True)
    servers = await start_servers(fake)
    extproc_address = f"127.0.0.1:{servers.bound_grpc_port}"
    async with (
        grpc.aio.insecure_channel(f"127.0.0.1:{servers.bound_health_port}") as health_channel,
        grpc.aio.insecure_channel(extproc_address) as channel,
    ):
        health = health_pb2_grpc.HealthStub(health_channel)
        assert await check(health, "readiness") == SERVING

        in_flight = pb_grpc.ExternalProcessorStub(channel).Process(timeout=30)
        for message in extproc_request():
            await in_flight.write(message)
        await fake.wait_until(lambda: bool(fake.exchanges) and fake.last.route_calls == 1)

        drain = asyncio.create_task(servers.drain(30))
        await eventually_status(health, "readiness", NOT_SERVING)
        assert await check(health, "") == NOT_SERVING
        assert await check(health, "liveness") == SERVING  # alive, just not taking work

        async with grpc.aio.insecure_channel(extproc_address) as new_channel:
            refused = pb_grpc.ExternalProcessorStub(new_channel).Process(timeout=DEADLINE)
            with contextlib.suppress(grpc.aio.AioRpcError):  # the write may already fail
                for message in extproc_request():
                    await refused.write(message)
            assert await refused.code() == grpc.StatusCode.UNAVAILABLE
        assert len(fake.exchanges) == 1
        assert not drain.done()

        fake.release_route()
        header_reply = await asyncio.wait_for(in_flight.read(), DEADLINE)
        assert header_reply.WhichOneof("response") == "request_headers"
        body_reply = await asyncio.wait_for(in_flight.read(), DEADLINE)
        assert body_reply.request_body.response.body_mutation.streamed_response.end_of_stream
        await in_flight.done_writing()
        assert await asyncio.wait_for(in_flight.read(), DEADLINE) is grpc.aio.EOF
        assert await in_flight.code() == grpc.StatusCode.OK

        await asyncio.wait_for(drain, DEADLINE)
        assert fake.open_exchanges == 0


# --- health on the ext_proc port ---------------------------------------------------------------


async def test_health_also_answers_on_extproc_port_when_enabled(
    start_servers: StartServers, datastore: Datastore
) -> None:
    director = configured_director(datastore)
    servers = await start_servers(director, health_on_extproc_port=True)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{servers.bound_grpc_port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        assert await check(stub, "readiness") == NOT_SERVING
        datastore.mark_synced()
        for service in SERVICES:
            assert await check(stub, service) == SERVING


async def test_health_is_not_on_extproc_port_by_default(
    servers: GrpcServers, datastore: Datastore
) -> None:
    datastore.mark_synced()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{servers.bound_grpc_port}") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await check(health_pb2_grpc.HealthStub(channel), "readiness")
    assert failure.value.code() == grpc.StatusCode.UNIMPLEMENTED
