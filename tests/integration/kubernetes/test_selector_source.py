"""EndpointSelectorSource: standalone mode, pods by label selector and fixed target ports."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kubernetes.client import ApiClient

from adapters.kubernetes import EndpointSelectorSource, parse_label_selector
from tests.support.kube_api import (
    PODS,
    KubeApiServer,
    RecordingSink,
    pod,
    running,
    wait_until,
)

SELECTOR = {"app": "model", "tier": "gpu"}


@pytest.fixture
def server() -> Iterator[KubeApiServer]:
    with KubeApiServer() as api_server:
        yield api_server


def source_for(api_client: ApiClient) -> EndpointSelectorSource:
    return EndpointSelectorSource(
        api_client,
        namespace="default",
        selector=SELECTOR,
        target_ports=[8000, 8001],
        resync_backoff=(0.05, 0.2),
    )


async def test_pods_matching_the_selector_are_endpoints(
    server: KubeApiServer, api_client: ApiClient
) -> None:
    server.create(PODS, pod("a", ip="10.0.0.1", labels={**SELECTOR, "extra": "x"}))
    server.create(PODS, pod("cpu", ip="10.0.0.2", labels={"app": "model", "tier": "cpu"}))
    server.create(PODS, pod("unready", ip="10.0.0.3", labels=SELECTOR, ready=False))
    sink = RecordingSink()
    async with running(source_for(api_client), sink):
        await wait_until(lambda: sink.synced, what="sync")
        assert sink.addresses() == {"a-rank-0": "10.0.0.1:8000", "a-rank-1": "10.0.0.1:8001"}
        assert {r.query.get("labelSelector") for r in server.requests(PODS)} == {
            "app=model,tier=gpu"
        }

        server.create(PODS, pod("b", ip="10.0.0.4", labels=SELECTOR))
        server.modify(
            PODS, "unready", lambda obj: obj["status"]["conditions"][1].update(status="True")
        )
        await wait_until(lambda: len(sink.endpoints) == 6, what="new and ready pods")

        server.delete(PODS, "a")
        await wait_until(lambda: len(sink.endpoints) == 4, what="deleted pod gone")


async def test_an_empty_namespace_syncs_with_no_endpoints(
    server: KubeApiServer, api_client: ApiClient
) -> None:
    sink = RecordingSink()
    async with running(source_for(api_client), sink):
        await wait_until(lambda: sink.synced, what="sync")
        assert not sink.endpoints


@pytest.mark.parametrize(
    ("selector", "ports", "message"),
    [
        ({}, [8000], "selector"),
        (SELECTOR, [], "target ports"),
        (SELECTOR, list(range(8000, 8009)), "target ports"),
        (SELECTOR, [8000, 8000], "target ports"),
        (SELECTOR, [70000], "target ports"),
    ],
)
def test_bad_configuration_is_rejected(
    api_client: ApiClient, selector: dict[str, str], ports: list[int], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        EndpointSelectorSource(
            api_client, namespace="default", selector=selector, target_ports=ports
        )


def test_parse_label_selector() -> None:
    assert parse_label_selector("app=model, tier==gpu") == {"app": "model", "tier": "gpu"}


@pytest.mark.parametrize(
    ("text", "message"),
    [("", "empty"), ("app", "not key=value"), ("app!=x", "not key=value"), ("a=1,a=2", "twice")],
)
def test_parse_label_selector_rejects(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_label_selector(text)
