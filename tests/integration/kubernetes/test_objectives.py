"""InferenceObjectives and InferenceModelRewrites of the pool reach the ObjectiveSink."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest
from kubernetes.client import ApiClient

from adapters.kubernetes import InferencePoolSource
from ports.objectives import ModelRewriteRule, ModelRewriteTarget
from tests.support.kube_api import (
    INFERENCE_MODEL_REWRITES,
    INFERENCE_OBJECTIVES,
    INFERENCE_POOLS_V1,
    INFERENCE_POOLS_V1ALPHA2,
    LLMD_INFERENCE_MODEL_REWRITES,
    LLMD_INFERENCE_OBJECTIVES,
    PODS,
    WITH_LLMD_RESOURCES,
    KubeApiServer,
    RecordingSink,
    inference_objective,
    inference_pool_v1,
    inference_pool_v1alpha2,
    kube_client,
    model_rewrite,
    pod,
    running,
    wait_until,
)

MODEL = {"app": "model"}
GA_GROUP = "inference.networking.k8s.io"
ALPHA_GROUP = "inference.networking.x-k8s.io"
LLMD_GROUP = "llm-d.ai"


@pytest.fixture
def server() -> Iterator[KubeApiServer]:
    with KubeApiServer() as api_server:
        api_server.create(INFERENCE_POOLS_V1, inference_pool_v1("pool", selector=MODEL))
        api_server.create(PODS, pod("a", ip="10.0.0.1", labels=MODEL))
        yield api_server


def source_for(
    api_client: ApiClient, sink: RecordingSink | None, pool_group: str = GA_GROUP
) -> InferencePoolSource:
    return InferencePoolSource(
        api_client,
        namespace="default",
        pool_name="pool",
        pool_group=pool_group,
        objective_sink=sink,
        resync_backoff=(0.05, 0.2),
    )


async def test_objectives_of_the_pool_map_names_to_priorities(
    server: KubeApiServer, api_client: ApiClient
) -> None:
    server.create(INFERENCE_OBJECTIVES, inference_objective("chat", pool="pool", priority=5))
    server.create(INFERENCE_OBJECTIVES, inference_objective("batch", pool="pool"))
    server.create(
        INFERENCE_OBJECTIVES,
        inference_objective("grouped", pool="pool", priority=-1, pool_group=GA_GROUP),
    )
    server.create(INFERENCE_OBJECTIVES, inference_objective("elsewhere", pool="other"))
    server.create(
        INFERENCE_OBJECTIVES,
        inference_objective("other-group", pool="pool", priority=9, pool_group=ALPHA_GROUP),
    )
    sink = RecordingSink()
    async with running(source_for(api_client, sink), sink):
        await wait_until(lambda: sink.objectives is not None, what="objectives")
        assert sink.objectives == {"chat": 5, "batch": None, "grouped": -1}

        server.update(INFERENCE_OBJECTIVES, inference_objective("chat", pool="pool", priority=7))
        await wait_until(lambda: (sink.objectives or {}).get("chat") == 7, what="new priority")

        server.update(INFERENCE_OBJECTIVES, inference_objective("elsewhere", pool="pool"))
        await wait_until(lambda: "elsewhere" in (sink.objectives or {}), what="now in the pool")

        server.update(INFERENCE_OBJECTIVES, inference_objective("batch", pool="other"))
        server.delete(INFERENCE_OBJECTIVES, "grouped")
        await wait_until(lambda: sink.objectives == {"chat": 7, "elsewhere": None}, what="removals")


async def test_rewrites_of_the_pool_become_rules(
    server: KubeApiServer, api_client: ApiClient
) -> None:
    server.create(
        INFERENCE_MODEL_REWRITES,
        model_rewrite(
            "canary",
            pool="pool",
            created="2025-03-01T12:00:00Z",
            rules=[
                (["llama", "llama-3"], [("llama-3-v1", 90), ("llama-3-v2", 10)]),
                ([], [("fallback", 1)]),
            ],
        ),
    )
    server.create(
        INFERENCE_MODEL_REWRITES,
        model_rewrite("elsewhere", pool="other", rules=[(["llama"], [("x", 1)])]),
    )
    sink = RecordingSink()
    async with running(source_for(api_client, sink), sink):
        await wait_until(lambda: bool(sink.rules), what="rules")
        created = datetime(2025, 3, 1, 12, tzinfo=UTC).timestamp()
        split = (
            ModelRewriteTarget(model="llama-3-v1", weight=90),
            ModelRewriteTarget(model="llama-3-v2", weight=10),
        )
        assert sink.rules == (
            ModelRewriteRule(name="canary", match="llama", targets=split, created=created),
            ModelRewriteRule(name="canary", match="llama-3", targets=split, created=created),
            ModelRewriteRule(
                name="canary",
                match="",
                targets=(ModelRewriteTarget(model="fallback", weight=1),),
                created=created,
                order=1,
            ),
        )

        server.delete(INFERENCE_MODEL_REWRITES, "canary")
        await wait_until(lambda: sink.rules == (), what="no rules")


async def test_a_v1alpha2_pool_takes_objectives_of_its_group(
    server: KubeApiServer, api_client: ApiClient
) -> None:
    server.create(
        INFERENCE_POOLS_V1ALPHA2, inference_pool_v1alpha2("pool", selector=MODEL, port=8000)
    )
    server.create(
        INFERENCE_OBJECTIVES,
        inference_objective("alpha", pool="pool", priority=1, pool_group=ALPHA_GROUP),
    )
    server.create(
        INFERENCE_OBJECTIVES,
        inference_objective("ga", pool="pool", priority=2, pool_group=GA_GROUP),
    )
    sink = RecordingSink()
    async with running(source_for(api_client, sink, pool_group=ALPHA_GROUP), sink):
        await wait_until(lambda: sink.objectives is not None and sink.synced, what="sync")
        assert sink.objectives == {"alpha": 1}


async def test_without_the_crds_objectives_are_skipped(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="adapters.kubernetes")
    served = (PODS, INFERENCE_POOLS_V1)
    with KubeApiServer(resources=served) as server, kube_client(server) as client:
        server.create(INFERENCE_POOLS_V1, inference_pool_v1("pool", selector=MODEL))
        server.create(PODS, pod("a", ip="10.0.0.1", labels=MODEL))
        sink = RecordingSink()
        async with running(source_for(client, sink), sink):
            await wait_until(lambda: sink.synced, what="sync")
            await wait_until(
                lambda: (
                    "InferenceModelRewrite is not served" in caplog.text
                    and "InferenceObjective is not served" in caplog.text
                ),
                what="the log lines",
            )
            assert set(sink.endpoints) == {"a-rank-0"}
            assert sink.objectives is None
            assert sink.rules is None
            discovery = [r.path for r in server.requests() if r.resource is None]
            assert sorted(discovery) == sorted(
                [f"/apis/{ALPHA_GROUP}/v1alpha2", f"/apis/{LLMD_GROUP}/v1alpha2"] * 2
            )
            assert not server.requests(INFERENCE_OBJECTIVES)
    assert caplog.text.count("InferenceObjective is not served") == 1


async def test_without_an_objective_sink_nothing_else_is_watched(
    server: KubeApiServer, api_client: ApiClient
) -> None:
    sink = RecordingSink()
    async with running(source_for(api_client, None), sink):
        await wait_until(lambda: sink.synced, what="sync")
        assert {r.resource for r in server.requests()} == {INFERENCE_POOLS_V1, PODS}


# -- the llm-d.ai/v1alpha2 group -------------------------------------------------------------


@pytest.fixture
def both_groups() -> Iterator[KubeApiServer]:
    """A cluster serving the legacy and the llm-d.ai CRDs."""
    with KubeApiServer(resources=WITH_LLMD_RESOURCES) as api_server:
        api_server.create(INFERENCE_POOLS_V1, inference_pool_v1("pool", selector=MODEL))
        api_server.create(PODS, pod("a", ip="10.0.0.1", labels=MODEL))
        yield api_server


LLMD = f"{LLMD_GROUP}/v1alpha2"


async def test_the_llmd_group_wins_when_both_are_served(both_groups: KubeApiServer) -> None:
    server = both_groups
    server.create(INFERENCE_OBJECTIVES, inference_objective("old", pool="pool", priority=1))
    server.create(
        LLMD_INFERENCE_OBJECTIVES,
        inference_objective("new", pool="pool", priority=2, api_version=LLMD),
    )
    server.create(
        INFERENCE_MODEL_REWRITES, model_rewrite("old", pool="pool", rules=[(["a"], [("b", 1)])])
    )
    server.create(
        LLMD_INFERENCE_MODEL_REWRITES,
        model_rewrite("new", pool="pool", rules=[(["a"], [("c", 1)])], api_version=LLMD),
    )
    sink = RecordingSink()
    with kube_client(server) as client:
        async with running(source_for(client, sink), sink):
            await wait_until(lambda: sink.objectives is not None, what="objectives")
            await wait_until(lambda: sink.rules is not None, what="rules")
            assert sink.objectives == {"new": 2}
            assert [(r.name, r.targets[0].model) for r in sink.rules or ()] == [("new", "c")]

            server.create(
                LLMD_INFERENCE_OBJECTIVES,
                inference_objective("newer", pool="pool", priority=3, api_version=LLMD),
            )
            server.create(INFERENCE_OBJECTIVES, inference_objective("older", pool="pool"))
            await wait_until(lambda: "newer" in (sink.objectives or {}), what="the new objective")
            assert sink.objectives == {"new": 2, "newer": 3}


async def test_the_llmd_group_alone_is_enough() -> None:
    served = (PODS, INFERENCE_POOLS_V1, LLMD_INFERENCE_OBJECTIVES, LLMD_INFERENCE_MODEL_REWRITES)
    with KubeApiServer(resources=served) as server, kube_client(server) as client:
        server.create(INFERENCE_POOLS_V1, inference_pool_v1("pool", selector=MODEL))
        server.create(PODS, pod("a", ip="10.0.0.1", labels=MODEL))
        server.create(
            LLMD_INFERENCE_OBJECTIVES,
            inference_objective("chat", pool="pool", priority=4, api_version=LLMD),
        )
        sink = RecordingSink()
        async with running(source_for(client, sink), sink):
            await wait_until(lambda: sink.objectives is not None, what="objectives")
            await wait_until(lambda: sink.rules is not None, what="rules")
            assert sink.objectives == {"chat": 4}
            assert sink.rules == ()
