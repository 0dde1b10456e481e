"""The ``--workers`` supervisor as a process: flags, shutdown, no orphans, one set of watches."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import re
import signal
import socket
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import orjson
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from tests.bench.leader_failover import failover
from tests.e2e.test_kubernetes_e2e import MODEL_LABELS, POOL, model_pod, write_kubeconfig
from tests.integration.test_process import NOT_SERVING, Epp
from tests.support.certs import served_certificate
from tests.support.extproc import envoy_headers, request_body, request_headers, set_headers
from tests.support.kube_api import INFERENCE_POOLS_V1, PODS, KubeApiServer, inference_pool_v1, pod
from tests.support.ports import bindable
from tests.support.redis import RedisServer, redis_available
from tests.support.stack import ChildProcess, Stack, StackOptions, free_port, wait_for

_METRICS_LINE = re.compile(r"metrics serving on [^\s\"]+:(\d+)")


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    if not redis_available():
        pytest.fail("redis-server and redis-cli are not on PATH: run `make install`")
    server = RedisServer()
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


#: The bearer token the Kubernetes test's API server authorizes for the supervisor's port.
SCRAPER_TOKEN = "scraper-token"


def _workers(child: ChildProcess) -> list[dict[str, Any]]:
    match = _METRICS_LINE.search(child.log())
    assert match is not None, child.log()
    request = urllib.request.Request(
        f"http://127.0.0.1:{match.group(1)}/workers",
        headers={"Authorization": f"Bearer {SCRAPER_TOKEN}"},
    )
    with urllib.request.urlopen(request, timeout=5) as r:
        listing: list[dict[str, Any]] = orjson.loads(r.read())
    return listing


def _all_ready(child: ChildProcess) -> bool:
    child.check_alive()
    try:
        return all(w["ready"] for w in _workers(child))
    except (OSError, AssertionError):
        return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("value", ["0", "-2", "many"])
def test_bad_worker_counts_exit_2_naming_the_flag(tmp_path: Path, value: str) -> None:
    epp = Epp(tmp_path, f"--workers={value}")
    epp.child.start()
    assert epp.child.wait(30) == 2
    assert "epp: --workers" in epp.child.log()


def test_a_bad_config_stops_the_supervisor_with_exit_1(tmp_path: Path, redis_url: str) -> None:
    epp = Epp(tmp_path, "--workers", "2", "--redis-url", redis_url, "--config-text", "plugins: 7")
    epp.child.start()
    assert epp.child.wait(30) == 1
    assert "invalid configuration" in epp.child.log()
    assert "worker 0 started" not in epp.child.log()


@contextlib.asynccontextmanager
async def _two_workers_ready(tmp_path: Path, redis_url: str) -> AsyncIterator[Epp]:
    epp = Epp(tmp_path, "--workers", "2", "--redis-url", redis_url, "--tracing=false")
    epp.child.start()
    try:
        await asyncio.to_thread(wait_for, lambda: _all_ready(epp.child), timeout=60, what="ready")
        yield epp
    finally:
        epp.child.stop()


async def test_sigterm_drains_the_workers_in_flight_streams_then_exits_0(
    tmp_path: Path, redis_url: str
) -> None:
    async with _two_workers_ready(tmp_path, redis_url) as epp:
        pids = [w["pid"] for w in _workers(epp.child)]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{epp.grpc_port}") as channel:
            call = pb_grpc.ExternalProcessorStub(channel).Process()
            await call.write(request_headers(envoy_headers()))
            await call.write(request_body(b'{"model": "m", "prompt": "held"}', end_of_stream=True))
            reply = await call.read()
            chosen = dict(set_headers(reply.request_headers.response))
            assert chosen["x-gateway-destination-endpoint"] in {
                "127.0.0.41:8000",
                "127.0.0.42:8000",
            }
            await call.read()  # the body

            epp.child.signal(signal.SIGTERM)
            await asyncio.to_thread(
                wait_for, lambda: epp.readiness() == NOT_SERVING, timeout=10, what="NOT_SERVING"
            )
            await call.done_writing()  # the held stream ends normally, after the SIGTERM
            assert await call.code() == grpc.StatusCode.OK
        assert await asyncio.to_thread(epp.child.wait, 30) == 0
        assert not any(_alive(pid) for pid in pids)
        assert "worker=supervisor" in epp.child.log()
        assert "worker=1" in epp.child.log()


def _handed_connections(child: ChildProcess) -> list[tuple[int, int, int]]:
    return [
        (w["connections_taken"], w["connections_accepting"], w["calls_started"])
        for w in _workers(child)
    ]


def _reported(handed: list[tuple[int, int, int]], connections: int) -> bool:
    """The workers reported ``connections`` taken, none still taking streams, one call each."""
    taken = sum(t for t, _, _ in handed)
    return taken == connections and all(a == 0 and c == t for t, a, c in handed)


def _served_by_worker(child: ChildProcess) -> dict[int, float]:
    """``inference_objective_request_total`` on each worker's own ``/metrics``."""
    counts = {}
    for worker in _workers(child):
        url = f"http://127.0.0.1:{worker['metrics_port']}/metrics"
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
        counts[worker["worker"]] = sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("inference_objective_request_total{")
        )
    return counts


async def _one_routed_stream(port: int) -> None:
    """One ext_proc stream routed, on a connection of its own."""
    async with grpc.aio.insecure_channel(
        f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)]
    ) as channel:
        call = pb_grpc.ExternalProcessorStub(channel).Process()
        await call.write(request_headers(envoy_headers()))
        await call.write(request_body(b'{"model": "m", "prompt": "turn"}', end_of_stream=True))
        reply = await call.read()
        assert dict(set_headers(reply.request_headers.response))
        await call.read()  # the body
        await call.done_writing()
        assert await call.code() == grpc.StatusCode.OK


async def test_connections_are_handed_to_the_workers_in_turn(
    tmp_path: Path, redis_url: str
) -> None:
    # The kernel's SO_REUSEPORT hash would put all four on one worker one time in eight,
    # and split them 3/1 one time in two: handed over by the supervisor they alternate.
    async with _two_workers_ready(tmp_path, redis_url) as epp:
        for opened in range(1, 5):
            await _one_routed_stream(epp.grpc_port)
            # The supervisor weighs what the workers last reported (every 50 ms); a gateway
            # opens its connections further apart than these do, so wait for the report:
            # with a worker's report late, the other, reported idle, would rightly go again.
            await asyncio.to_thread(
                wait_for,
                lambda n=opened: _reported(_handed_connections(epp.child), n),
                timeout=10,
                what=f"/workers to report {opened} connection(s) taken and closed",
            )
        assert await asyncio.to_thread(_served_by_worker, epp.child) == {0: 2.0, 1: 2.0}
        # what each worker reports of them, which the supervisor weighs for the next one
        handed = [(2, 0, 2), (2, 0, 2)]
        await asyncio.to_thread(
            wait_for,
            lambda: _handed_connections(epp.child) == handed,
            timeout=10,
            what=f"/workers to list {handed} (taken, taking streams, calls started)",
        )

        # A stream held open keeps the pod draining (with none, it exits at once, and the
        # port's state while draining cannot be seen).
        async with grpc.aio.insecure_channel(f"127.0.0.1:{epp.grpc_port}") as channel:
            call = pb_grpc.ExternalProcessorStub(channel).Process()
            await call.write(request_headers(envoy_headers()))
            epp.child.signal(signal.SIGTERM)
            await asyncio.to_thread(
                wait_for, lambda: epp.readiness() == NOT_SERVING, timeout=10, what="NOT_SERVING"
            )
            with pytest.raises(ConnectionRefusedError):  # the port is closed while draining
                socket.create_connection(("127.0.0.1", epp.grpc_port), timeout=5).close()
            await call.write(request_body(b'{"model": "m", "prompt": "held"}', end_of_stream=True))
            assert dict(set_headers((await call.read()).request_headers.response))
            await call.read()  # the body
            await call.done_writing()
            assert await call.code() == grpc.StatusCode.OK
        assert await asyncio.to_thread(epp.child.wait, 30) == 0


async def test_every_worker_serves_the_pods_one_self_signed_certificate(
    tmp_path: Path, redis_url: str
) -> None:
    # connections are handed to the workers in turn, so four of them meet both workers
    epp = Epp(
        tmp_path,
        *("--workers", "2", "--redis-url", redis_url, "--tracing=false"),
        "--secure-serving=true",
    )
    epp.child.start()
    try:
        await asyncio.to_thread(wait_for, lambda: _all_ready(epp.child), timeout=60, what="ready")
        seen = {await asyncio.to_thread(served_certificate, epp.grpc_port) for _ in range(4)}
        assert len(seen) == 1
    finally:
        epp.child.stop()


def test_pods_of_workers_fail_over_on_their_supervisors_lease(
    tmp_path: Path, redis_url: str
) -> None:
    """``--ha-enable-leader-election`` with ``--workers 2``: each pod's supervisor campaigns
    for the Lease (its workers do not), one pod is ready, and when its pod is deleted
    (SIGTERM) the standby pod reports ready within seconds."""
    with KubeApiServer() as api:
        api.create(INFERENCE_POOLS_V1, inference_pool_v1("pool", selector={"app": "model"}))
        api.create(PODS, pod("model-0", ip="127.0.0.61", labels={"app": "model"}))
        ready, _ = failover(
            tmp_path, api, signal.SIGTERM, ["--workers", "2", "--redis-url", redis_url]
        )
    assert ready < 5.0
    for name in ("epp-0", "epp-1"):
        log = (tmp_path / f"{name}.log").read_text()
        campaigns = [line for line in log.splitlines() if "campaigning for Lease" in line]
        assert len(campaigns) == 1, campaigns
        assert campaigns[0].endswith("worker=supervisor"), campaigns


def test_the_supervisor_serves_each_workers_profiling_pages(tmp_path: Path, redis_url: str) -> None:
    epp = Epp(tmp_path, "--workers", "2", "--redis-url", redis_url, "--tracing=false")
    epp.child.start()
    try:
        wait_for(lambda: _all_ready(epp.child), timeout=60, what="both workers ready")
        match = _METRICS_LINE.search(epp.child.log())
        assert match is not None
        base = f"http://127.0.0.1:{match.group(1)}/debug/pprof"
        pids = {w["worker"]: w["pid"] for w in _workers(epp.child)}
        for worker_id in pids:
            with urllib.request.urlopen(f"{base}/threads?worker={worker_id}", timeout=10) as r:
                text = r.read().decode()
            assert text.startswith(f"# worker {worker_id}\n"), text[:200]
            assert "MainThread" in text
        with pytest.raises(urllib.error.HTTPError) as unknown:
            urllib.request.urlopen(f"{base}/threads?worker=9", timeout=10)
        assert unknown.value.code == 404
    finally:
        epp.child.stop()


def test_sigkill_of_the_supervisor_leaves_no_worker_holding_the_port(
    tmp_path: Path, redis_url: str
) -> None:
    epp = Epp(tmp_path, "--workers", "2", "--redis-url", redis_url, "--tracing=false")
    epp.child.start()
    try:
        wait_for(lambda: _all_ready(epp.child), timeout=60, what="both workers ready")
        pids = [w["pid"] for w in _workers(epp.child)]
        assert not bindable(epp.grpc_port)
        epp.child.signal(signal.SIGKILL)
        wait_for(lambda: bindable(epp.grpc_port), timeout=10, what="the ext_proc port free")
        wait_for(lambda: not any(_alive(p) for p in pids), timeout=10, what="workers gone")
    finally:
        epp.child.stop()


def test_kubernetes_is_watched_once_per_pod_not_per_worker(tmp_path: Path, redis_url: str) -> None:
    with KubeApiServer() as api:
        kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", api.url)
        api.create(
            INFERENCE_POOLS_V1, inference_pool_v1(POOL, selector=MODEL_LABELS, ports=[free_port()])
        )
        api.create(PODS, model_pod("pod-a"))
        api.add_token(SCRAPER_TOKEN, username="prometheus")
        api.grant("prometheus", "/workers")
        discovery = ["--pool-name", POOL, "--kubeconfig", str(kubeconfig)]
        counts = []
        for workers in (1, 2):
            options = StackOptions(
                simulators=0,
                envoy=False,
                epp_tls=False,
                epp_discovery=discovery,
                epp_args=["--redis-url", redis_url, "--workers", str(workers)],
            )
            with Stack.run(options) as stack:
                child = stack.epp
                assert child is not None
                if workers > 1:
                    wait_for(
                        functools.partial(_all_ready, child), timeout=60, what="the workers ready"
                    )
                    # The supervisor's /metrics is the pod's: behind the same token check.
                    url = f"http://127.0.0.1:{stack.epp_metrics_port}/metrics"
                    with pytest.raises(urllib.error.HTTPError) as refused:
                        urllib.request.urlopen(url, timeout=5)
                    assert refused.value.code == 401
                # The InferencePool, its pods, InferenceObjectives, InferenceModelRewrites.
                wait_for(lambda: api.open_watches() >= 4, timeout=30, what="the watches")
                counts.append(api.open_watches())
            wait_for(lambda: api.open_watches() == 0, timeout=30, what="the watches closed")
        assert counts[0] == counts[1], counts
