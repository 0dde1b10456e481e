"""k8s-notification-source: watched objects of one GVK reach the notification extractors."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator

import pytest
from kubernetes.client import ApiClient

from adapters.kubernetes.notification_source import (
    K8sNotificationSource,
    K8sNotificationSourceParameters,
)
from adapters.kubernetes.watch import WatchOptions
from ports.datalayer import NotificationEvent, NotificationKind
from ports.plugins import TypedName
from tests.support.kube_api import (
    INFERENCE_OBJECTIVES,
    PODS,
    KubeApiServer,
    inference_objective,
    pod,
    wait_until,
)

ALPHA_GROUP = "inference.networking.x-k8s.io"
OBJECTIVE_GVK = f"{ALPHA_GROUP}/v1alpha2, Kind=InferenceObjective"


@pytest.fixture
def server() -> Iterator[KubeApiServer]:
    with KubeApiServer() as api_server:
        api_server.create(INFERENCE_OBJECTIVES, inference_objective("early", pool="pool"))
        yield api_server


def source_for(
    api_client: ApiClient, *, group: str, version: str, kind: str
) -> K8sNotificationSource:
    parameters = K8sNotificationSourceParameters(group=group, version=version, kind=kind)
    return K8sNotificationSource(
        TypedName("k8s-notification-source", parameters.default_name()),
        parameters,
        api_client_factory=lambda: api_client,
        namespace="default",
        options=WatchOptions(backoff_initial=0.05, backoff_max=0.2),
    )


@contextlib.asynccontextmanager
async def running(source: K8sNotificationSource) -> AsyncIterator[list[NotificationEvent]]:
    events: list[NotificationEvent] = []
    task = asyncio.create_task(source.run(events.append))
    try:
        yield events
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, timeout=5)


def seen(events: list[NotificationEvent]) -> list[tuple[NotificationKind, str]]:
    return [(e.kind, e.object["metadata"]["name"]) for e in events]


async def test_objectives_are_notified_on_create_update_and_delete(
    server: KubeApiServer, api_client: ApiClient
) -> None:
    source = source_for(
        api_client, group=ALPHA_GROUP, version="v1alpha2", kind="InferenceObjective"
    )
    assert source.gvk() == OBJECTIVE_GVK
    async with running(source) as events:
        await wait_until(lambda: len(events) == 1, what="the listed objective")
        server.create(INFERENCE_OBJECTIVES, inference_objective("late", pool="pool", priority=1))
        await wait_until(lambda: len(events) == 2, what="the created objective")
        server.modify(INFERENCE_OBJECTIVES, "late", lambda obj: obj["spec"].update(priority=5))
        await wait_until(lambda: len(events) == 3, what="the updated objective")
        server.delete(INFERENCE_OBJECTIVES, "early")
        await wait_until(lambda: len(events) == 4, what="the deleted objective")
    assert seen(events) == [
        (NotificationKind.ADD_OR_UPDATE, "early"),
        (NotificationKind.ADD_OR_UPDATE, "late"),
        (NotificationKind.ADD_OR_UPDATE, "late"),
        (NotificationKind.DELETE, "early"),
    ]
    assert events[2].object["spec"]["priority"] == 5
    assert all(e.gvk == OBJECTIVE_GVK for e in events)


async def test_core_kinds_are_resolved_through_discovery(
    server: KubeApiServer, api_client: ApiClient
) -> None:
    server.create(PODS, pod("p", ip="10.0.0.1", labels={"app": "x"}))
    source = source_for(api_client, group="", version="v1", kind="Pod")
    async with running(source) as events:
        await wait_until(lambda: len(events) == 1, what="the listed pod")
        server.delete(PODS, "p")
        await wait_until(lambda: len(events) == 2, what="the deleted pod")
    assert seen(events) == [(NotificationKind.ADD_OR_UPDATE, "p"), (NotificationKind.DELETE, "p")]
    assert events[0].gvk == "/v1, Kind=Pod"
    assert any(r.path == "/api/v1" for r in server.requests())


async def test_an_unserved_kind_is_retried_and_nothing_is_delivered(
    server: KubeApiServer, api_client: ApiClient, caplog: pytest.LogCaptureFixture
) -> None:
    source = source_for(api_client, group=ALPHA_GROUP, version="v1alpha2", kind="Nothing")
    async with running(source) as events:
        await wait_until(
            lambda: sum(r.path == f"/apis/{ALPHA_GROUP}/v1alpha2" for r in server.requests()) >= 3,
            what="repeated discovery",
        )
    assert events == []
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == [
        f"{ALPHA_GROUP}/v1alpha2, Kind=Nothing/k8s-notification-source: cannot watch "
        f"{ALPHA_GROUP}/v1alpha2, Kind=Nothing: the API server does not serve it; retrying"
    ]
