"""List+watch under trouble: bookmarks, expired versions, dropped and failing watches, shutdown."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Iterator

import pytest
from kubernetes.client import ApiClient

from ports.endpoints import EndpointEventKind
from tests.support.kube_api import (
    INFERENCE_OBJECTIVES,
    INFERENCE_POOLS_V1,
    PODS,
    KubeApiServer,
    RecordingSink,
    inference_objective,
    inference_pool_v1,
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
        api_server.create(INFERENCE_POOLS_V1, inference_pool_v1("pool", selector=MODEL))
        for name, ip in (("a", "10.0.0.1"), ("b", "10.0.0.2"), ("c", "10.0.0.3")):
            api_server.create(PODS, pod(name, ip=ip, labels=MODEL))
        yield api_server


def pod_lists(server: KubeApiServer) -> int:
    return len(server.requests(PODS, watch=False))


async def test_a_bookmark_moves_the_resume_point_without_events(
    server: KubeApiServer, api_client: ApiClient
) -> None:
    sink = RecordingSink()
    async with running(pool_source(api_client), sink):
        await wait_until(lambda: sink.synced and server.open_watches(PODS) == 1, what="watch")
        # Changes the pod watch does not see move the resourceVersion on.
        server.create(PODS, pod("unrelated", ip="10.0.9.9", labels={"app": "other"}))
        server.create(INFERENCE_OBJECTIVES, inference_objective("o", pool="pool"))
        latest = server.resource_version
        events_before = len(sink.events)

        server.send_bookmark()
        await wait_until(lambda: server.bookmarks_pending() == 0, what="bookmark sent")
        server.compact()  # only a watch resumed from the bookmark avoids a relist
        server.drop_watches()
        await wait_until(lambda: len(server.requests(PODS, watch=True)) == 2, what="rewatch")

        assert server.requests(PODS, watch=True)[-1].query["resourceVersion"] == str(latest)
        assert server.requests(PODS, watch=True)[0].query["allowWatchBookmarks"] == "true"
        assert pod_lists(server) == 1
        assert len(sink.events) == events_before

        server.create(PODS, pod("d", ip="10.0.0.4", labels=MODEL))
        await wait_until(lambda: "d-rank-0" in sink.endpoints, what="later event")


async def test_an_expired_watch_relists_without_losing_or_duplicating_endpoints(
    server: KubeApiServer, api_client: ApiClient
) -> None:
    sink = RecordingSink()
    async with running(pool_source(api_client), sink):
        await wait_until(lambda: sink.synced and server.open_watches(PODS) == 1, what="watch")

        server.pause_watches()  # what happens now is missed by the open watch...
        server.delete(PODS, "b")
        server.create(PODS, pod("d", ip="10.0.0.4", labels=MODEL))
        server.modify(PODS, "c", lambda obj: obj["status"].update(podIP="10.0.1.3"))
        server.expire_watches()  # ...which then ends with 410 Gone

        await wait_until(
            lambda: (
                sink.addresses()
                == {
                    "a-rank-0": "10.0.0.1:8000",
                    "c-rank-0": "10.0.1.3:8000",
                    "d-rank-0": "10.0.0.4:8000",
                }
            ),
            what="the relisted state",
        )
        assert pod_lists(server) == 2
        assert sink.kinds("a-rank-0") == [ADD]
        assert sink.kinds("b-rank-0") == [ADD, DELETE]
        assert sink.kinds("c-rank-0") == [ADD, ADD]
        assert sink.kinds("d-rank-0") == [ADD]

        server.resume_watches()
        server.create(PODS, pod("e", ip="10.0.0.5", labels=MODEL))
        await wait_until(lambda: "e-rank-0" in sink.endpoints, what="events after the relist")
        assert sink.synced_calls == 1


async def test_resuming_from_an_expired_version_relists(
    server: KubeApiServer, api_client: ApiClient
) -> None:
    sink = RecordingSink()
    async with running(pool_source(api_client), sink):
        await wait_until(lambda: sink.synced and server.open_watches(PODS) == 1, what="watch")
        server.pause_watches()
        server.delete(PODS, "a")
        server.compact()
        server.drop_watches()  # the watch from the old version gets an ERROR event, 410
        await wait_until(lambda: "a-rank-0" not in sink.endpoints, what="the gap noticed")
        assert pod_lists(server) == 2
        assert set(sink.endpoints) == {"b-rank-0", "c-rank-0"}
        server.resume_watches()


async def test_an_http_410_on_the_watch_relists(
    server: KubeApiServer, api_client: ApiClient
) -> None:
    sink = RecordingSink()
    async with running(pool_source(api_client), sink):
        await wait_until(lambda: sink.synced and server.open_watches(PODS) == 1, what="watch")
        server.fail_requests(410, resource=PODS, watch=True)
        server.drop_watches()
        await wait_until(lambda: pod_lists(server) == 2, what="relist")
        server.create(PODS, pod("d", ip="10.0.0.4", labels=MODEL))
        await wait_until(lambda: "d-rank-0" in sink.endpoints, what="later event")
        assert len(sink.events) == 4
        assert set(sink.endpoints) == {"a-rank-0", "b-rank-0", "c-rank-0", "d-rank-0"}


async def test_a_dropped_watch_reconnects_and_later_events_arrive(
    server: KubeApiServer, api_client: ApiClient
) -> None:
    sink = RecordingSink()
    async with running(pool_source(api_client), sink):
        await wait_until(lambda: sink.synced and server.open_watches(PODS) == 1, what="watch")
        server.drop_watches()
        server.delete(PODS, "a")  # happens while the watch is down: replayed on reconnect
        await wait_until(lambda: "a-rank-0" not in sink.endpoints, what="the missed delete")
        server.create(PODS, pod("d", ip="10.0.0.4", labels=MODEL))
        await wait_until(lambda: "d-rank-0" in sink.endpoints, what="a later event")
        assert pod_lists(server) == 1  # resumed, not relisted
        assert len(server.requests(PODS, watch=True)) >= 2
        assert set(sink.endpoints) == {"b-rank-0", "c-rank-0", "d-rank-0"}


async def test_failing_requests_keep_the_known_endpoints_and_back_off(
    server: KubeApiServer, api_client: ApiClient
) -> None:
    sink = RecordingSink()
    async with running(pool_source(api_client), sink):
        await wait_until(lambda: sink.synced and server.open_watches(PODS) == 1, what="watch")
        server.fail_requests(500, resource=PODS, count=3)
        server.drop_watches()
        await wait_until(
            lambda: (
                len(server.requests(PODS, watch=True)) == 5  # first, 3 failures, recovery
                and server.open_watches(PODS) == 1
            ),
            what="recovery",
        )
        retries = [r.at for r in server.requests(PODS, watch=True)[1:]]
        gaps = [later - earlier for earlier, later in itertools.pairwise(retries)]
        assert gaps[0] >= 0.04  # 0.05 s, then doubling up to the 0.2 s cap
        assert gaps[-1] >= 0.15
        assert all(e.kind is ADD for e in sink.events)
        assert len(sink.endpoints) == 3
        server.create(PODS, pod("d", ip="10.0.0.4", labels=MODEL))
        await wait_until(lambda: "d-rank-0" in sink.endpoints, what="a later event")


async def test_watches_end_after_their_timeout_and_restart(
    server: KubeApiServer, api_client: ApiClient
) -> None:
    sink = RecordingSink()
    async with running(pool_source(api_client, watch_timeout=1.0), sink):
        await wait_until(lambda: server.open_watches(PODS) == 1, what="the pod watch")
        first = server.requests(PODS, watch=True)
        assert all(1 <= int(r.query["timeoutSeconds"]) <= 2 for r in first)
        await wait_until(
            lambda: len(server.requests(PODS, watch=True)) >= 2, within=5, what="a restart"
        )
        server.create(PODS, pod("d", ip="10.0.0.4", labels=MODEL))
        await wait_until(lambda: "d-rank-0" in sink.endpoints, what="a later event")
        assert pod_lists(server) == 1
        assert all(e.kind is ADD for e in sink.events)


def watch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("kube-watch-")]


async def test_cancelling_run_stops_its_threads_promptly(
    server: KubeApiServer, api_client: ApiClient
) -> None:
    sink = RecordingSink()
    source = pool_source(api_client, objective_sink=sink)
    task = asyncio.create_task(source.run(sink))
    await wait_until(
        lambda: server.open_watches() == 4, what="pool, pod, objective and rewrite watches"
    )
    assert len(watch_threads()) == 4
    started = time.monotonic()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert time.monotonic() - started < 2.0
    await wait_until(lambda: not watch_threads(), within=0.5, what="the threads ended")
    await wait_until(lambda: server.open_watches() == 0, what="the watches closed")
