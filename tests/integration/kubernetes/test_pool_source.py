"""InferencePoolSource: the endpoints of a pool follow its pods and its spec."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes.client import ApiClient

from ports.endpoints import EndpointAddress, EndpointEventKind, EndpointInfo
from tests.support.kube_api import (
    INFERENCE_POOLS_V1,
    INFERENCE_POOLS_V1ALPHA2,
    PODS,
    KubeApiServer,
    RecordingSink,
    inference_pool_v1,
    inference_pool_v1alpha2,
    pod,
    pool_source,
    running,
    wait_until,
)

ADD = EndpointEventKind.ADD_OR_UPDATE
DELETE = EndpointEventKind.DELETE
MODEL = {"app": "model"}


@pytest.fixture
def server() -> Iterator[KubeApiServer]:
    with KubeApiServer() as api_server:
        yield api_server


def set_ip(ip: str) -> Any:
    def change(obj: dict[str, Any]) -> None:
        obj["status"]["podIP"] = ip

    return change


def set_ready(ready: bool) -> Any:
    def change(obj: dict[str, Any]) -> None:
        obj["status"]["conditions"][1]["status"] = "True" if ready else "False"

    return change


async def test_two_ready_pods_become_two_endpoints_and_the_source_syncs(
    server: KubeApiServer, api_client: ApiClient
) -> None:
    server.create(INFERENCE_POOLS_V1, inference_pool_v1("pool", selector=MODEL, ports=[8000]))
    server.create(PODS, pod("a", ip="10.0.0.1", labels={**MODEL, "tier": "gpu"}))
    server.create(PODS, pod("b", ip="10.0.0.2", labels=MODEL))
    sink = RecordingSink()
    async with running(pool_source(api_client), sink):
        await wait_until(lambda: sink.synced, what="sync")
        assert sink.endpoints["a-rank-0"] == EndpointInfo(
            name="a-rank-0",
            address=EndpointAddress(ip="10.0.0.1", port=8000),
            pod_name="a",
            namespace="default",
            labels={"app": "model", "tier": "gpu"},
            metrics_host="10.0.0.1:8000",
        )
        assert sink.addresses() == {"a-rank-0": "10.0.0.1:8000", "b-rank-0": "10.0.0.2:8000"}
        assert sink.synced_calls == 1


async def test_pods_follow_readiness_addresses_and_lifecycle(
    server: KubeApiServer, api_client: ApiClient
) -> None:
    server.create(INFERENCE_POOLS_V1, inference_pool_v1("pool", selector=MODEL))
    server.create(PODS, pod("a", ip="10.0.0.1", labels=MODEL))
    server.create(PODS, pod("b", ip="10.0.0.2", labels=MODEL))
    sink = RecordingSink()
    async with running(pool_source(api_client), sink):
        await wait_until(lambda: len(sink.endpoints) == 2, what="two endpoints")

        server.modify(PODS, "a", set_ready(False))
        await wait_until(lambda: "a-rank-0" not in sink.endpoints, what="unready pod deleted")
        assert sink.kinds("a-rank-0") == [ADD, DELETE]

        server.modify(PODS, "a", set_ready(True))
        await wait_until(lambda: "a-rank-0" in sink.endpoints, what="ready again")

        server.create(PODS, pod("c", ip="10.0.0.3", labels=MODEL))
        await wait_until(lambda: "c-rank-0" in sink.endpoints, what="new pod added")

        server.modify(PODS, "b", set_ip("10.0.1.2"))
        await wait_until(lambda: sink.addresses().get("b-rank-0") == "10.0.1.2:8000", what="new IP")
        assert sink.kinds("b-rank-0") == [ADD, ADD]

        server.modify(PODS, "c", lambda obj: obj["metadata"].update(deletionTimestamp="now"))
        await wait_until(lambda: "c-rank-0" not in sink.endpoints, what="terminating pod gone")

        server.delete(PODS, "b")
        await wait_until(lambda: "b-rank-0" not in sink.endpoints, what="deleted pod gone")

        server.modify(PODS, "a", lambda obj: obj["metadata"].update(labels={"app": "other"}))
        await wait_until(lambda: not sink.endpoints, what="pod that left the selector gone")


async def test_pods_that_do_not_qualify_are_no_endpoints(
    server: KubeApiServer, api_client: ApiClient
) -> None:
    server.create(INFERENCE_POOLS_V1, inference_pool_v1("pool", selector=MODEL))
    server.create(PODS, pod("ready", ip="10.0.0.1", labels=MODEL))
    server.create(PODS, pod("unready", ip="10.0.0.2", labels=MODEL, ready=False))
    server.create(PODS, pod("no-ip", ip=None, labels=MODEL))
    server.create(PODS, pod("terminating", ip="10.0.0.3", labels=MODEL, deleting=True))
    server.create(PODS, pod("other", ip="10.0.0.4", labels={"app": "other"}))
    server.create(PODS, pod("elsewhere", ip="10.0.0.5", labels=MODEL, namespace="other"))
    sink = RecordingSink()
    async with running(pool_source(api_client), sink):
        await wait_until(lambda: sink.synced, what="sync")
        assert set(sink.endpoints) == {"ready-rank-0"}
        assert [e.endpoint.name for e in sink.events] == ["ready-rank-0"]


async def test_each_target_port_is_a_rank(server: KubeApiServer, api_client: ApiClient) -> None:
    server.create(INFERENCE_POOLS_V1, inference_pool_v1("pool", selector=MODEL, ports=[8000, 8001]))
    server.create(PODS, pod("a", ip="10.0.0.1", labels=MODEL))
    server.create(PODS, pod("b", ip="fd00::2", labels=MODEL))
    sink = RecordingSink()
    async with running(pool_source(api_client), sink):
        await wait_until(lambda: sink.synced, what="sync")
        assert sink.addresses() == {
            "a-rank-0": "10.0.0.1:8000",
            "a-rank-1": "10.0.0.1:8001",
            "b-rank-0": "[fd00::2]:8000",
            "b-rank-1": "[fd00::2]:8001",
        }
        assert sink.endpoints["b-rank-1"].metrics_host == "[fd00::2]:8001"
        assert [sink.endpoints[f"a-rank-{i}"].rank for i in (0, 1)] == [0, 1]  # the DP rank


async def test_the_active_ports_annotation_limits_the_ranks(
    server: KubeApiServer, api_client: ApiClient
) -> None:
    server.create(
        INFERENCE_POOLS_V1, inference_pool_v1("pool", selector=MODEL, ports=[8000, 8001, 8002])
    )
    annotation = "inference.networking.k8s.io/active-ports"
    server.create(
        PODS, pod("a", ip="10.0.0.1", labels=MODEL, annotations={annotation: "8000, 8002"})
    )
    sink = RecordingSink()
    async with running(pool_source(api_client), sink):
        await wait_until(lambda: sink.synced, what="sync")
        assert sink.addresses() == {"a-rank-0": "10.0.0.1:8000", "a-rank-2": "10.0.0.1:8002"}

        server.modify(
            PODS, "a", lambda obj: obj["metadata"]["annotations"].update({annotation: "8001"})
        )
        await wait_until(
            lambda: sink.addresses() == {"a-rank-1": "10.0.0.1:8001"}, what="only rank 1"
        )

        server.modify(PODS, "a", lambda obj: obj["metadata"].pop("annotations"))
        await wait_until(lambda: len(sink.endpoints) == 3, what="every rank")


async def test_a_selector_change_resyncs_the_pods(
    server: KubeApiServer, api_client: ApiClient
) -> None:
    server.create(INFERENCE_POOLS_V1, inference_pool_v1("pool", selector={"app": "model"}))
    server.create(PODS, pod("old", ip="10.0.0.1", labels={"app": "model"}))
    server.create(PODS, pod("both", ip="10.0.0.2", labels={"app": "model", "v": "2"}))
    server.create(PODS, pod("new", ip="10.0.0.3", labels={"v": "2"}))
    sink = RecordingSink()
    async with running(pool_source(api_client), sink):
        await wait_until(lambda: sink.synced, what="sync")
        assert set(sink.endpoints) == {"old-rank-0", "both-rank-0"}

        server.update(INFERENCE_POOLS_V1, inference_pool_v1("pool", selector={"v": "2"}))
        await wait_until(
            lambda: set(sink.endpoints) == {"both-rank-0", "new-rank-0"}, what="resync"
        )
        assert sink.kinds("both-rank-0") == [ADD]  # unchanged: not re-announced
        assert sink.kinds("old-rank-0") == [ADD, DELETE]
        pod_lists = server.requests(PODS, watch=False)
        assert [r.query.get("labelSelector") for r in pod_lists] == ["app=model", "v=2"]

        server.create(PODS, pod("later", ip="10.0.0.4", labels={"v": "2"}))
        server.create(PODS, pod("stale", ip="10.0.0.5", labels={"app": "model"}))
        await wait_until(lambda: "later-rank-0" in sink.endpoints, what="new selector watched")
        assert "stale-rank-0" not in sink.endpoints


async def test_a_target_ports_change_resyncs_the_endpoints(
    server: KubeApiServer, api_client: ApiClient
) -> None:
    server.create(INFERENCE_POOLS_V1, inference_pool_v1("pool", selector=MODEL, ports=[8000]))
    server.create(PODS, pod("a", ip="10.0.0.1", labels=MODEL))
    sink = RecordingSink()
    async with running(pool_source(api_client), sink):
        await wait_until(lambda: sink.synced, what="sync")

        server.update(
            INFERENCE_POOLS_V1, inference_pool_v1("pool", selector=MODEL, ports=[8000, 9000])
        )
        await wait_until(lambda: len(sink.endpoints) == 2, what="two ranks")
        assert sink.addresses() == {"a-rank-0": "10.0.0.1:8000", "a-rank-1": "10.0.0.1:9000"}
        assert sink.kinds("a-rank-0") == [ADD]

        server.update(INFERENCE_POOLS_V1, inference_pool_v1("pool", selector=MODEL, ports=[9000]))
        await wait_until(
            lambda: sink.addresses() == {"a-rank-0": "10.0.0.1:9000"}, what="one rank again"
        )
        assert sink.kinds("a-rank-1") == [ADD, DELETE]
        assert len(server.requests(PODS, watch=False)) == 1  # the pods were not listed again


async def test_deleting_the_pool_deletes_every_endpoint(
    server: KubeApiServer, api_client: ApiClient
) -> None:
    server.create(INFERENCE_POOLS_V1, inference_pool_v1("pool", selector=MODEL, ports=[8000, 8001]))
    server.create(PODS, pod("a", ip="10.0.0.1", labels=MODEL))
    server.create(PODS, pod("b", ip="10.0.0.2", labels=MODEL))
    sink = RecordingSink()
    async with running(pool_source(api_client), sink):
        await wait_until(lambda: len(sink.endpoints) == 4, what="four endpoints")

        assert sink.synced
        server.delete(INFERENCE_POOLS_V1, "pool")
        await wait_until(lambda: not sink.endpoints, what="every endpoint deleted")
        assert sum(e.kind is DELETE for e in sink.events) == 4
        assert not sink.synced  # readiness turns NOT_SERVING without a pool

        server.create(PODS, pod("c", ip="10.0.0.3", labels=MODEL))  # no pool: not watched
        server.create(INFERENCE_POOLS_V1, inference_pool_v1("pool", selector=MODEL))
        await wait_until(lambda: len(sink.endpoints) == 3, what="the pool is back")
        assert set(sink.endpoints) == {"a-rank-0", "b-rank-0", "c-rank-0"}
        await wait_until(lambda: sink.synced, what="synced again")


async def test_an_absent_pool_leaves_the_source_unsynced_until_it_is_created(
    server: KubeApiServer, api_client: ApiClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="adapters.kubernetes")
    server.create(PODS, pod("a", ip="10.0.0.1", labels=MODEL))
    sink = RecordingSink()
    async with running(pool_source(api_client), sink):
        await wait_until(
            lambda: "InferencePool default/pool not found" in caplog.text, what="the log line"
        )
        assert not sink.synced
        assert not sink.endpoints
        assert not server.requests(PODS)  # no pool: no selector to watch pods by

        server.create(INFERENCE_POOLS_V1, inference_pool_v1("pool", selector=MODEL))
        await wait_until(lambda: sink.synced, what="sync once the pool exists")
        assert set(sink.endpoints) == {"a-rank-0"}
    assert caplog.text.count("InferencePool default/pool not found") == 1


async def test_only_the_named_pool_counts(server: KubeApiServer, api_client: ApiClient) -> None:
    server.create(INFERENCE_POOLS_V1, inference_pool_v1("other", selector={"app": "other"}))
    server.create(PODS, pod("a", ip="10.0.0.1", labels={"app": "other"}))
    sink = RecordingSink()
    async with running(pool_source(api_client), sink):
        await wait_until(lambda: server.open_watches(INFERENCE_POOLS_V1) == 1, what="pool watch")
        assert not sink.synced
        pool_requests = server.requests(INFERENCE_POOLS_V1)
        assert {r.query.get("fieldSelector") for r in pool_requests} == {"metadata.name=pool"}


async def test_a_v1alpha2_pool(server: KubeApiServer, api_client: ApiClient) -> None:
    server.create(
        INFERENCE_POOLS_V1ALPHA2, inference_pool_v1alpha2("pool", selector=MODEL, port=8100)
    )
    server.create(INFERENCE_POOLS_V1, inference_pool_v1("pool", selector=MODEL, ports=[1]))
    server.create(PODS, pod("a", ip="10.0.0.1", labels=MODEL))
    sink = RecordingSink()
    source = pool_source(api_client, pool_group="inference.networking.x-k8s.io")
    async with running(source, sink):
        await wait_until(lambda: sink.synced, what="sync")
        assert sink.addresses() == {"a-rank-0": "10.0.0.1:8100"}

        server.update(
            INFERENCE_POOLS_V1ALPHA2, inference_pool_v1alpha2("pool", selector=MODEL, port=8200)
        )
        await wait_until(lambda: sink.addresses() == {"a-rank-0": "10.0.0.1:8200"}, what="port")


def test_an_unknown_pool_group_is_a_configuration_error(api_client: ApiClient) -> None:
    with pytest.raises(ValueError, match="pool group"):
        pool_source(api_client, pool_group="example.com")
