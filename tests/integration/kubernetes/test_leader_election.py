"""``--ha-enable-leader-election``: Lease-based active-passive replicas, against the loopback
API server through the official ``kubernetes`` client (short lease timings for speed)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kubernetes.client import ApiClient

from adapters.envoy.server import GrpcServers, ServerOptions
from adapters.kubernetes.leader import LeaderElector
from domain.datastore import Datastore
from tests.bench.leader_failover import failover
from tests.support.director import configured_director
from tests.support.extproc import completion, envoy_headers, request_body_chunks, request_headers
from tests.support.kube_api import (
    INFERENCE_POOLS_V1,
    LEASES,
    PODS,
    KubeApiServer,
    inference_pool_v1,
    kube_client,
    pod,
    wait_until,
)

from ..test_extproc_protocol import ENDPOINT_IPS, EnvoyStream, endpoint_event

LEASE = "epp-default-pool.gateway-api-inference-extension.sigs.k8s.io"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


@pytest.fixture
def api() -> Iterator[KubeApiServer]:
    with KubeApiServer() as server:
        yield server


@pytest.fixture
def client(api: KubeApiServer) -> Iterator[ApiClient]:
    with kube_client(api) as api_client:
        yield api_client


def _elector(client: ApiClient, identity: str) -> LeaderElector:
    return LeaderElector(
        client,
        namespace="default",
        name=LEASE,
        identity=identity,
        lease_duration=1.5,
        renew_deadline=1.0,
        retry_period=0.1,
    )


@contextlib.asynccontextmanager
async def campaigning(elector: LeaderElector) -> AsyncIterator[asyncio.Task[None]]:
    task = asyncio.create_task(elector.run())
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 5)


def _holder(api: KubeApiServer) -> str | None:
    lease = api.get(LEASES, LEASE)
    return None if lease is None else lease["spec"].get("holderIdentity")


async def test_one_replica_leads_and_a_standby_takes_over_on_release(
    api: KubeApiServer, client: ApiClient
) -> None:
    a, b = _elector(client, "epp-a"), _elector(client, "epp-b")
    async with campaigning(a) as task_a:
        await wait_until(lambda: a.is_leader, what="a to lead")
        async with campaigning(b):
            rounds = len(api.requests(LEASES))
            await wait_until(lambda: len(api.requests(LEASES)) > rounds + 6, what="rounds")
            assert not b.is_leader  # the Lease is renewed: b waits
            assert _holder(api) == "epp-a"
            task_a.cancel()  # SIGTERM: a releases the Lease
            released = time.monotonic()
            await wait_until(lambda: b.is_leader, within=1.0, what="b to take over")
            assert time.monotonic() - released < 1.0  # well within one lease duration
            assert not a.is_leader
            assert _holder(api) == "epp-b"
            lease = api.get(LEASES, LEASE)
            assert lease is not None
            assert lease["spec"]["leaseTransitions"] == 1


async def test_racing_candidates_cannot_both_win(api: KubeApiServer, client: ApiClient) -> None:
    electors = [_elector(client, f"epp-{n}") for n in range(4)]
    async with contextlib.AsyncExitStack() as stack:
        for elector in electors:
            await stack.enter_async_context(campaigning(elector))
        await wait_until(lambda: any(e.is_leader for e in electors), what="a leader")
        for _ in range(10):
            assert sum(e.is_leader for e in electors) == 1
            await asyncio.sleep(0.05)
        # Counted before the candidates stop: a leader stopped first releases the Lease, and
        # one still campaigning may take it before it stops in turn.
        assert sum(e.transitions for e in electors) == 1


async def test_a_leader_that_cannot_renew_steps_down(api: KubeApiServer, client: ApiClient) -> None:
    a = _elector(client, "epp-a")
    async with campaigning(a):
        await wait_until(lambda: a.is_leader, what="a to lead")
        api.fail_requests(503, resource=LEASES, count=1000)
        lost = time.monotonic()
        await wait_until(lambda: not a.is_leader, within=3.0, what="a to step down")
        assert time.monotonic() - lost >= 0.9  # not before the renew deadline


async def test_a_lost_lease_flips_readiness_and_the_stream_in_flight_finishes(
    api: KubeApiServer, client: ApiClient
) -> None:
    datastore = Datastore()
    for ip in ENDPOINT_IPS:
        datastore.apply(endpoint_event(ip))
    datastore.mark_synced()
    a = _elector(client, "epp-a")
    servers = GrpcServers(
        configured_director(datastore),
        ServerOptions(
            host="127.0.0.1",
            grpc_port=0,
            health_port=0,
            certificate=None,
        ),
        leader=a.leader,
    )
    await servers.start()
    health_channel = grpc.aio.insecure_channel(f"127.0.0.1:{servers.bound_health_port}")
    health = health_pb2_grpc.HealthStub(health_channel)

    async def status(service: str) -> int:
        request = health_pb2.HealthCheckRequest(service=service)
        return int((await health.Check(request, timeout=5)).status)

    try:
        async with (
            grpc.aio.insecure_channel(f"127.0.0.1:{servers.bound_grpc_port}") as channel,
            campaigning(a),
        ):
            # a warm standby: synced, alive, not ready
            assert await status("liveness") == SERVING
            assert await status("readiness") == NOT_SERVING
            await wait_until(lambda: a.is_leader, what="a to lead")
            for service in ("readiness", "", "envoy.service.ext_proc.v3.ExternalProcessor"):
                assert await status(service) == SERVING
            assert await status("inference-extension") == UNKNOWN

            stream = EnvoyStream(channel)
            await stream.send(request_headers(envoy_headers()))
            # another replica takes the Lease (as after a partition)
            api.modify(
                LEASES,
                LEASE,
                lambda lease: lease["spec"].update(holderIdentity="epp-elsewhere"),
            )
            await wait_until(lambda: not a.is_leader, what="a to lose the Lease")
            assert await status("readiness") == NOT_SERVING
            assert await status("liveness") == SERVING
            await stream.send(*request_body_chunks(completion()))
            header_reply, _ = await stream.read_request_replies()
            assert header_reply.request_headers.response.header_mutation.set_headers
            await stream.finish()
    finally:
        await health_channel.close()
        await servers.drain(0)


def test_two_processes_fail_over_within_five_seconds_on_sigterm(
    api: KubeApiServer, tmp_path: Path
) -> None:
    """The operator's view, default lease settings: the leader's pod is deleted."""
    api.create(INFERENCE_POOLS_V1, inference_pool_v1("pool", selector={"app": "model"}))
    api.create(PODS, pod("model-0", ip="127.0.0.61", labels={"app": "model"}))
    ready, _ = failover(tmp_path, api, signal.SIGTERM)
    assert ready < 5.0
