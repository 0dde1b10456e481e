"""The supervisor's hub and a worker's link over a real unix socket.

The supervisor's data layer calls the teed ports; a worker, even one that connects late,
sees the same endpoints, readiness, objectives, poll results and watch events through its
relayed ports, and the supervisor sees the worker's readiness.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from adapters.workerlink import SupervisorHub, WorkerLink
from domain.datastore.store import Datastore
from ports.datalayer import MetricsText, NotificationEvent, NotificationKind
from ports.endpoints import EndpointAddress, EndpointEvent, EndpointEventKind, EndpointInfo
from ports.objectives import ModelRewriteRule
from ports.plugins import TypedName

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
