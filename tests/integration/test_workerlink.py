"""The supervisor's hub and a worker's link over a real unix socket.

The supervisor's data layer calls the teed ports; a worker, even one that connects late,
sees the same endpoints, readiness, objectives, poll results and watch events through its
relayed ports, and the supervisor sees the worker's readiness. With the default extractor
the worker gets the supervisor's parsed snapshots of real simulators' metrics, equal to what
one process reads; a frame it cannot read is skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest

from adapters.prometheus.scrape import MetricsDataSource, MetricsSourceParameters
from adapters.workerlink import MetricsSnapshot, SupervisorHub, WorkerLink
from adapters.workerlink.frames import (
    MAX_FRAME_BYTES,
    encode_frame,
    encode_snapshot_frame,
    read_frame,
)
from app.metrics_relay import relays_snapshots, supervisor_binding, worker_binding
from domain.datalayer.collector import Collectors, SourceBinding
from domain.datalayer.plugins.core_metrics_extractor import TYPE as CORE_TYPE
from domain.datalayer.plugins.core_metrics_extractor import (
    CoreMetricsExtractor,
    CoreMetricsExtractorParameters,
)
from domain.datastore.endpoint import Endpoint, EndpointMetrics
from domain.datastore.store import Datastore
from ports.datalayer import MetricsText, NotificationEvent, NotificationKind
from ports.endpoints import EndpointAddress, EndpointEvent, EndpointEventKind, EndpointInfo
from ports.objectives import ModelRewriteRule
from ports.plugins import TypedName
from tests.simulator import ModelServerSimulator, SimulatorConfig

SOURCE = TypedName("metrics-data-source", "metrics-data-source")
WATCH = TypedName("k8s-notification-source", "configmaps")


def info(name: str) -> EndpointInfo:
    ip, _, port = name.partition(":")
    return EndpointInfo(name=name, address=EndpointAddress(ip=ip, port=int(port)))


class Objectives:
    def __init__(self) -> None:
        self.priorities: Mapping[str, int | None] = {}
        self.rules: Sequence[ModelRewriteRule] = ()

    def set_objectives(self, priorities: Mapping[str, int | None]) -> None:
        self.priorities = priorities

    def set_rules(self, rules: Sequence[ModelRewriteRule]) -> None:
        self.rules = rules


class CountingSource:
    """A polling source answering ``body-<n>`` on its n-th poll."""

    def __init__(self) -> None:
        self.polls = 0

    @property
    def typed_name(self) -> TypedName:
        return SOURCE

    def output_type(self) -> type:
        return MetricsText

    async def poll(self, endpoint: EndpointInfo) -> MetricsText:
        self.polls += 1
        return MetricsText(body=f"body-{self.polls}".encode(), fetched_at=1.0)

    async def close(self) -> None:
        return None


class Watch:
    def __init__(self) -> None:
        self.deliver: Callable[[NotificationEvent], None] | None = None

    @property
    def typed_name(self) -> TypedName:
        return WATCH

    def gvk(self) -> str:
        return "/v1, Kind=ConfigMap"

    def output_type(self) -> type:
        return NotificationEvent

    async def run(self, deliver: Callable[[NotificationEvent], None]) -> None:
        self.deliver = deliver
        await asyncio.Event().wait()


async def until(condition: Callable[[], Any], what: str, within: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while True:
        if condition():
            return
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


@pytest.fixture
async def hub(tmp_path: Path) -> AsyncIterator[SupervisorHub]:
    server = SupervisorHub(str(tmp_path / "link.sock"))
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


async def test_a_late_worker_sees_the_pod_data_layer_then_its_changes(
    hub: SupervisorHub,
) -> None:
    supervisor_store = Datastore()
    sink = hub.sink(supervisor_store)
    source = hub.polling(CountingSource())
    watch = Watch()
    watch_task = asyncio.create_task(hub.notifications(watch).run(lambda event: None))
    await until(lambda: watch.deliver is not None, "the watch to run")
    assert watch.deliver is not None
    sink.apply(EndpointEvent(kind=EndpointEventKind.ADD_OR_UPDATE, endpoint=info("10.0.0.1:80")))
    sink.apply(EndpointEvent(kind=EndpointEventKind.ADD_OR_UPDATE, endpoint=info("10.0.0.2:80")))
    sink.mark_synced()
    hub.objectives(Objectives()).set_objectives({"batch": -1})
    await source.poll(info("10.0.0.1:80"))
    configmap = {"metadata": {"namespace": "ns", "name": "cm"}, "data": {"k": "v"}}
    watch.deliver(NotificationEvent(kind=NotificationKind.ADD_OR_UPDATE, gvk="g", object=configmap))

    link = await WorkerLink.connect(hub.path, worker_id=3)
    worker_store, objectives = Datastore(), Objectives()
    relayed = link.polling_source(SOURCE, MetricsText)
    relayed_watch = link.notification_source(WATCH, "/v1, Kind=ConfigMap", NotificationEvent)
    seen: list[NotificationEvent] = []
    tasks = [
        asyncio.create_task(link.endpoint_source(objectives).run(worker_store)),
        asyncio.create_task(relayed_watch.run(seen.append)),
    ]
    try:
        await until(lambda: worker_store.synced, "the worker's datastore synced")
        assert {e.name for e in worker_store.endpoints()} == {"10.0.0.1:80", "10.0.0.2:80"}
        assert objectives.priorities == {"batch": -1}
        first = await asyncio.wait_for(relayed.poll(info("10.0.0.1:80")), 5)
        assert first == MetricsText(body=b"body-1", fetched_at=1.0)
        await until(lambda: seen, "the watched object")
        assert seen[0].object == configmap

        # Changes after the worker joined reach it in order.
        next_poll = asyncio.create_task(relayed.poll(info("10.0.0.1:80")))
        await source.poll(info("10.0.0.1:80"))
        assert await asyncio.wait_for(next_poll, 5) == MetricsText(body=b"body-2", fetched_at=1.0)
        sink.apply(EndpointEvent(kind=EndpointEventKind.DELETE, endpoint=info("10.0.0.2:80")))
        await until(lambda: len(worker_store.endpoints()) == 1, "the deletion")
        sink.mark_unsynced()
        await until(lambda: not worker_store.synced, "unsynced")

        # The supervisor sees what the worker reports.
        link.report(True, 4321)
        await until(lambda: hub.ready_workers() == 1, "the worker ready")
        (status,) = hub.workers()
        assert (status.worker_id, status.ready, status.metrics_port) == (3, True, 4321)
    finally:
        for task in [*tasks, watch_task]:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await link.close()


async def test_a_worker_knows_when_its_supervisor_is_gone(hub: SupervisorHub) -> None:
    link = await WorkerLink.connect(hub.path, worker_id=0)
    try:
        await until(lambda: hub.workers(), "the hello")
        await hub.stop()
        await asyncio.wait_for(link.lost.wait(), 5)
        assert hub.ready_workers() == 0
    finally:
        await link.close()


async def test_a_restarted_worker_replaces_its_predecessor(hub: SupervisorHub) -> None:
    old = await WorkerLink.connect(hub.path, worker_id=1)
    new = None
    try:
        old.report(True, 1)
        await until(lambda: hub.ready_workers() == 1, "the first worker ready")
        new = await WorkerLink.connect(hub.path, worker_id=1)
        await asyncio.wait_for(old.lost.wait(), 5)
        await until(lambda: hub.workers() and not hub.workers()[0].ready, "the new one listed")
        assert len(hub.workers()) == 1
    finally:
        await old.close()
        if new is not None:
            await new.close()


class RecordingSource:
    """A polling source passing another's results through and keeping each endpoint's last."""

    def __init__(self, inner: MetricsDataSource) -> None:
        self._inner = inner
        self.last: dict[str, MetricsText] = {}

    @property
    def typed_name(self) -> TypedName:
        return self._inner.typed_name

    def output_type(self) -> type:
        return MetricsText

    async def poll(self, endpoint: EndpointInfo) -> MetricsText:
        text = await self._inner.poll(endpoint)
        self.last[endpoint.name] = text
        return text

    async def close(self) -> None:
        await self._inner.close()


async def _stream_forever(url: str, model: str) -> None:
    """A streamed completion that runs until cancelled (it keeps its server busy)."""
    body = {"model": model, "prompt": "hello " * 200, "max_tokens": 100000, "stream": True}
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{url}/v1/completions", json=body) as response,
    ):
        async for _ in response.content:
            pass


async def test_a_worker_endpoint_metrics_equal_the_single_process_ones(
    hub: SupervisorHub,
) -> None:
    """Real simulators, polled by the supervisor's data layer as one process polls them;
    the worker gets the snapshots, not the bodies, and ends with the same endpoint
    metrics as one process reading the same scrape."""
    config = SimulatorConfig(
        lora_adapters=("sql-lora",), max_loras=2, block_size=32, num_gpu_blocks=4096, itl=0.02
    )
    source = RecordingSource(MetricsDataSource(SOURCE, MetricsSourceParameters()))
    extractor = CoreMetricsExtractor(
        TypedName(CORE_TYPE, CORE_TYPE), CoreMetricsExtractorParameters()
    )
    binding = SourceBinding(source, (extractor,))
    assert relays_snapshots(binding)
    supervisor_store = Datastore()
    supervisor = Collectors(
        datastore=supervisor_store, bindings=[supervisor_binding(binding, hub)], interval=0.02
    )
    link = await WorkerLink.connect(hub.path, worker_id=0)
    worker_store = Datastore()
    worker = Collectors(
        datastore=worker_store,
        bindings=[worker_binding(binding, link)],
        interval=0.02,
        poll_timeout=3600.0,
    )
    tasks: list[asyncio.Task[None]] = []
    async with (
        ModelServerSimulator(config, name="a", host="127.0.0.2", port=0) as busy,
        ModelServerSimulator(config, name="b", host="127.0.0.3", port=0) as idle,
    ):
        try:
            tasks.append(asyncio.create_task(_stream_forever(busy.url, "sql-lora")))
            tasks.append(asyncio.create_task(link.endpoint_source(Objectives()).run(worker_store)))
            sink = hub.sink(supervisor_store)
            for sim in (busy, idle):
                sink.apply(
                    EndpointEvent(
                        kind=EndpointEventKind.ADD_OR_UPDATE,
                        endpoint=info(sim.url.removeprefix("http://")),
                    )
                )
            sink.mark_synced()
            supervisor.start()
            worker.start()
            busy_name = busy.url.removeprefix("http://")

            def busy_seen() -> bool:
                metrics = worker_store.get(busy_name).metrics  # type: ignore[union-attr]
                return metrics is not None and metrics.running_requests_size == 1

            await until(lambda: worker_store.get(busy_name) is not None, "the endpoints")
            await until(busy_seen, "the running request in the worker's metrics")

            await supervisor.stop()  # the last scrape stays the last
            for name, text in source.last.items():
                polled = supervisor_store.get(name)
                relayed = worker_store.get(name)
                assert polled is not None
                assert polled.metrics is not None
                assert relayed is not None
                await until(_holds(relayed, polled.metrics), f"the last snapshot of {name}")
                # One process reading the same body gets the same metrics.
                alone = Endpoint(info=info(name))
                extractor.extract(text, alone, polled.metrics.update_time)
                assert relayed.metrics == alone.metrics
            metrics = worker_store.get(busy_name).metrics  # type: ignore[union-attr]
            assert metrics is not None
            assert (metrics.cache_block_size, metrics.cache_num_blocks) == (32, 4096)
            assert metrics.active_models == frozenset({"sql-lora"})
            assert metrics.kv_cache_usage_percent > 0
            assert link.rejected_frames == 0
        finally:
            for task in tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
                    await task
            await worker.stop()
            await supervisor.stop()
            await link.close()


async def test_a_malformed_frame_is_skipped_and_the_worker_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Frames the worker cannot read are rejected one by one (logged once in a row); the
    link stays up and applies the next good frame. An oversized frame still ends it."""
    endpoint = info("10.0.0.1:80")
    good = MetricsSnapshot(
        waiting_queue_size=2,
        running_requests_size=3,
        kv_cache_usage_percent=0.5,
        active_models=frozenset({"a"}),
        waiting_models=frozenset(),
        max_active_models=4,
        cache_block_size=16,
        cache_num_blocks=100,
        update_time=12.5,
    )
    bad_frames = [
        _raw_frame(b"M\xc1\xc1garbage"),  # not msgpack
        encode_snapshot_frame(
            str(SOURCE), endpoint.name, msgspec.structs.replace(good, kv_cache_usage_percent=7.0)
        ),  # out of its range
        encode_snapshot_frame(
            str(SOURCE), endpoint.name, msgspec.structs.replace(good, waiting_queue_size=-1)
        ),
        _raw_frame(b"P\x80\x05not a pickle"),
        _raw_frame(b"Xunknown"),
        _raw_frame(b""),
        encode_frame(("synced", "yes")),  # a message of the wrong shape
        encode_frame(("poll", str(SOURCE), endpoint.name, 42)),  # not the source's type
        encode_frame(["not", "a", "tuple"]),
    ]
    connected: asyncio.Queue[asyncio.StreamWriter] = asyncio.Queue()

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_frame(reader)  # the hello
        connected.put_nowait(writer)
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                await read_frame(reader)

    path = str(tmp_path / "fake.sock")
    server = await asyncio.start_unix_server(accept, path=path)
    link = await WorkerLink.connect(path, worker_id=0)
    relayed = link.polling_source(SOURCE, MetricsSnapshot)
    store = Datastore()
    run = asyncio.create_task(link.endpoint_source(Objectives()).run(store))
    try:
        writer = await asyncio.wait_for(connected.get(), 5)
        with caplog.at_level(logging.WARNING, logger="adapters.workerlink.link"):
            for frame in bad_frames:
                writer.write(frame)
            writer.write(
                encode_frame(
                    (
                        "endpoint",
                        EndpointEvent(kind=EndpointEventKind.ADD_OR_UPDATE, endpoint=endpoint),
                    )
                )
            )
            writer.write(encode_snapshot_frame(str(SOURCE), endpoint.name, good))
            await writer.drain()
            assert await asyncio.wait_for(relayed.poll(endpoint), 5) == good
        assert link.rejected_frames == len(bad_frames)
        assert not link.lost.is_set()
        assert [e.name for e in store.endpoints()] == [endpoint.name]
        skipped = [r for r in caplog.records if "cannot read" in r.getMessage()]
        assert len(skipped) == 1, caplog.text  # once for the run of bad frames

        writer.write((MAX_FRAME_BYTES + 1).to_bytes(4, "big"))
        await writer.drain()
        await asyncio.wait_for(link.lost.wait(), 5)
    finally:
        run.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await run
        await link.close()
        server.close()


def _holds(endpoint: Endpoint, metrics: EndpointMetrics) -> Callable[[], bool]:
    return lambda: endpoint.metrics == metrics


def _raw_frame(payload: bytes) -> bytes:
    return len(payload).to_bytes(4, "big") + payload
