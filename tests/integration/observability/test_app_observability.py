"""The process wiring: one observer for everything, /metrics served for the process's life."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import grpc
import pytest
from dependency_injector import providers
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from prometheus_client.parser import text_string_to_metric_families

from adapters.otel.tracing import OtelTracing
from app.container import Container, build_container
from app.observability import EppObserver
from app.runner import StartupError, serve
from app.settings import Settings
from tests.fakes.endpoint_source import FakeEndpointSource
from tests.support.extproc import envoy_headers, request_body, request_headers


async def _eventually(condition: Callable[[], Awaitable[bool]], within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while not await condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def _running(container: Container) -> AsyncIterator[None]:
    stop = asyncio.Event()
    task = asyncio.create_task(serve(container, stop))
    try:
        yield
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


def _settings(**overrides: object) -> Settings:
    values: dict[str, object] = {
        "static_endpoints": "127.0.0.250:9",
        "metrics_endpoint_auth": False,
        "bind_address": "127.0.0.1",
        "grpc_port": 0,
        "grpc_health_port": 0,
        "metrics_port": 0,
        "secure_serving": False,
        "pool_name": "",
        "refresh_prometheus_metrics_interval": 0.02,
        **overrides,
    }
    return Settings(**values)  # type: ignore[arg-type]


async def _scrape(port: int) -> dict[str, list[tuple[dict[str, str], float]]]:
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{port}/metrics") as response,
    ):
        text = await response.text()
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return samples


async def test_metrics_are_served_while_the_process_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    container = build_container(_settings())
    fake = FakeEndpointSource(["127.0.0.31:8000", "127.0.0.32:8000"])
    container.endpoint_source.override(providers.Object(fake))
    async with _running(container):
        await asyncio.wait_for(fake.running.wait(), 5)
        fake.sync()
        observability = container.observability()

        async def served() -> bool:
            return observability.server.bound_port > 0

        await _eventually(served)
        port = observability.server.bound_port
        observer = container.observer()
        assert isinstance(observer, EppObserver)
        assert isinstance(observer.tracing, OtelTracing)  # --tracing defaults to true
        assert container.processor().observer is observer
        assert container.handle().observer is observer

        servers = container.servers()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{servers.bound_grpc_port}") as channel:
            call = pb_grpc.ExternalProcessorStub(channel).Process()
            await call.write(request_headers(envoy_headers()))
            await call.write(request_body(b'{"model": "m", "prompt": "hi"}', end_of_stream=True))
            await call.read()
            await call.done_writing()

        async def routed_and_gauged() -> bool:
            samples = await _scrape(port)
            return bool(
                samples.get("inference_objective_request_total")
                and samples.get("inference_pool_ready_pods")
            )

        await _eventually(routed_and_gauged)
        samples = await _scrape(port)
        assert samples["inference_objective_request_total"] == [
            ({"model_name": "m", "target_model_name": "m", "priority": "0"}, 1.0)
        ]
        (attempt,) = samples["inference_extension_scheduler_attempts_total"]
        assert attempt[0]["status"] == "success"
        assert attempt[0]["pod_name"] in {"127.0.0.31:8000", "127.0.0.32:8000"}
        ((info_labels, info_value),) = samples["inference_extension_info"]
        assert info_value == 1
        assert set(info_labels) == {"commit", "build_ref"}
        assert samples["inference_extension_prefix_indexer_size"][0][1] >= 0
    with pytest.raises(aiohttp.ClientConnectionError):
        await _scrape(port)


async def test_tracing_off_gives_no_span_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    container = build_container(_settings(tracing=False))
    observer = container.observer()
    assert isinstance(observer, EppObserver)
    assert observer.tracing is None


async def test_a_taken_metrics_port_stops_start_up_naming_the_flag() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        container = build_container(_settings(metrics_port=taken.getsockname()[1]))
        container.endpoint_source.override(providers.Object(FakeEndpointSource([])))
        with pytest.raises(StartupError, match="--metrics-port"):
            await serve(container, asyncio.Event())
