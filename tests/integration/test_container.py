"""The container wires the real process; any provider can be swapped, as here the source."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from dependency_injector import providers
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from app.container import Container, build_container
from app.runner import serve
from app.settings import Settings
from domain.prefixcache import InMemoryPrefixIndex
from domain.sharedstate import LoadBoard, LocalSharedLoad, ResilientPrefixIndex
from tests.fakes.endpoint_source import FakeEndpointSource
from tests.support.extproc import envoy_headers, request_body, request_headers, set_headers


async def _eventually(condition: Any, within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while not await condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def _running(container: Container) -> AsyncIterator[asyncio.Event]:
    stop = asyncio.Event()
    task = asyncio.create_task(serve(container, stop))
    try:
        yield stop
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


def _settings() -> Settings:
    return Settings(
        static_endpoints="127.0.0.250:9",  # never used: the source is swapped below
        metrics_endpoint_auth=False,
        bind_address="127.0.0.1",
        grpc_port=0,
        grpc_health_port=0,
        metrics_port=0,
        secure_serving=False,
    )


async def test_a_swapped_endpoint_source_feeds_routing_and_readiness() -> None:
    container = build_container(_settings())
    fake = FakeEndpointSource(["127.0.0.31:8000", "127.0.0.32:8000"])
    container.endpoint_source.override(providers.Object(fake))
    async with _running(container):
        await asyncio.wait_for(fake.running.wait(), 5)
        servers = container.servers()
        health_channel = grpc.aio.insecure_channel(f"127.0.0.1:{servers.bound_health_port}")
        health = health_pb2_grpc.HealthStub(health_channel)

        async def readiness() -> Any:
            request = health_pb2.HealthCheckRequest(service="readiness")
            return (await health.Check(request)).status

        assert await readiness() == health_pb2.HealthCheckResponse.NOT_SERVING
        fake.sync()

        async def serving() -> bool:
            return bool(await readiness() == health_pb2.HealthCheckResponse.SERVING)

        await _eventually(serving)
        fake.remove("127.0.0.31:8000")

        async with grpc.aio.insecure_channel(f"127.0.0.1:{servers.bound_grpc_port}") as channel:
            call = pb_grpc.ExternalProcessorStub(channel).Process()
            await call.write(request_headers(envoy_headers()))
            await call.write(request_body(b'{"model": "m", "prompt": "hi"}', end_of_stream=True))
            reply = await call.read()
            await call.done_writing()
        destination = dict(set_headers(reply.request_headers.response))
        assert destination["x-gateway-destination-endpoint"] == "127.0.0.32:8000"
        await health_channel.close()


async def test_the_default_wiring_serves_the_static_endpoints() -> None:
    container = build_container(_settings())
    async with _running(container):
        servers = container.servers()
        await _eventually(lambda: _true(container.datastore().synced))
        names = [e.name for e in container.datastore().endpoints()]
        assert names == ["127.0.0.250:9"]
        assert servers.bound_grpc_port > 0


async def test_the_shared_state_reaches_the_plugins_and_lives_with_the_process() -> None:
    board = LoadBoard(lease=60.0)
    member = board.member("this-process")
    remote = InMemoryPrefixIndex()
    resilient = ResilientPrefixIndex(remote)
    container = build_container(_settings())
    container.shared_load.override(providers.Object(member))
    container.prefix_index.override(providers.Object(resilient))
    async with _running(container):
        # Started before serving: its lease is held.
        await _eventually(lambda: _true(board.live() == ["this-process"]))
        assert container.handle().shared_load is member
        assert container.handle().prefix_index is resilient
        await resilient.add([1, 2], "127.0.0.250:9", 10)
        await resilient.flush()  # the writer runs: the index was started
        assert remote.match_sync([1, 2]) == {"127.0.0.250:9": 2}
    assert board.live() == []  # stopped: withdrawn from the pool


def test_one_process_alone_by_default() -> None:
    container = build_container(_settings())
    assert isinstance(container.handle().shared_load, LocalSharedLoad)


async def _true(value: bool) -> bool:
    return value


@pytest.mark.parametrize("secure", [True, False])
def test_certificate_follows_secure_serving(secure: bool) -> None:
    container = build_container(_settings().model_copy(update={"secure_serving": secure}))
    certificate = container.certificate()
    assert (certificate is not None) is secure
    if certificate is not None:
        assert certificate.certificate_pem.startswith(b"-----BEGIN CERTIFICATE-----")
