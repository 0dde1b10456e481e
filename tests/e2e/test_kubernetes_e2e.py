"""The EPP process discovering its model servers from Kubernetes, through a real Envoy.

A loopback Kubernetes API server (``tests.support.kube_api``) holds the InferencePool, its
pods, InferenceObjectives and InferenceModelRewrites; the EPP reaches it through a kubeconfig
file. The pods' IPs are those of simulated model servers listening on one shared port, so
what the EPP picks from the pods is where Envoy sends the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import re
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from grpc_health.v1 import health_pb2

from app.config import REFERENCE_DEFAULT_CONFIG_TEXT
from tests.simulator import BODY_SHA256_HEADER, DEFAULT_MODEL, INSTANCE_HEADER
from tests.support.kube_api import (
    INFERENCE_MODEL_REWRITES,
    INFERENCE_OBJECTIVES,
    INFERENCE_POOLS_V1,
    PODS,
    KubeApiServer,
    inference_objective,
    inference_pool_v1,
    model_rewrite,
    pod,
)
from tests.support.stack import Stack, StackOptions, free_port, trusted_header, wait_for

pytestmark = pytest.mark.e2e

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

POOL = "pool"
MODEL_LABELS = {"app": "model"}
#: Pod name → the IP of the simulator standing in for it (instances sim-0, sim-1, sim-2).
POD_IPS = {"pod-a": "127.0.0.101", "pod-b": "127.0.0.102", "pod-c": "127.0.0.103"}
#: A ready pod outside the pool's selector, on the IP of pod-c's simulator.
STRAY_POD = "stray"
ALL_PODS = (*POD_IPS, STRAY_POD)

#: The simulators' KV cache: 64 blocks of 16 tokens. A prompt of 880 tokens holds 55 blocks
#: (86 %), above the saturation detector's 80 %, and leaves room for short requests.
NUM_GPU_BLOCKS = 64
KV_HOG_PROMPT = "".join(f"{i:03d} " for i in range(880))  # 3,520 characters = 880 tokens
ITL_MS = 50
LORA = "food-review-1"
SIMULATOR_ARGS = ("--num-gpu-blocks", str(NUM_GPU_BLOCKS), "--itl-ms", str(ITL_MS), "--lora", LORA)

DECISION_HEADER = "x-epp-decision"
# Set by the test stack's trusted filter (Envoy strips a client's x-gateway-* headers).
OBJECTIVE_HEADER = trusted_header("x-gateway-inference-objective")
_SCORED = re.compile(r"([^\s,;=()]+)=(\d+\.\d+) \(([^)]*)\)")


def endpoint(pod_name: str) -> str:
    """The EPP's name for the endpoint of a pod's first (only) target port."""
    return f"{pod_name}-rank-0"


def write_kubeconfig(path: Path, server_url: str) -> Path:
    """A minimal kubeconfig for a plain-HTTP API server, namespace ``default``."""
    path.write_text(
        f"""apiVersion: v1
kind: Config
clusters:
- name: loopback
  cluster:
    server: {server_url}
    insecure-skip-tls-verify: true
users:
- name: tester
  user:
    token: not-checked
contexts:
- name: loopback
  context:
    cluster: loopback
    user: tester
    namespace: default
current-context: loopback
"""
    )
    return path


def model_pod(
    name: str, *, ready: bool = True, labels: Mapping[str, str] | None = None
) -> dict[str, Any]:
    ip = POD_IPS.get(name, POD_IPS["pod-c"])
    return pod(name, ip=ip, labels={**MODEL_LABELS, **(labels or {})}, ready=ready)


def apply_pods(api: KubeApiServer, *pods: dict[str, Any]) -> None:
    """Makes the given pods the only pods (of ``ALL_PODS``) the API server holds."""
    wanted = {p["metadata"]["name"]: p for p in pods}
    for name in ALL_PODS:
        if name not in wanted and api.get(PODS, name) is not None:
            api.delete(PODS, name)
    for name, obj in wanted.items():
        if api.get(PODS, name) is None:
            api.create(PODS, obj)
        else:
            api.update(PODS, obj)


@dataclass(frozen=True)
class Reply:
    """What a client sees of one completion through Envoy."""

    status: int
    instance: str
    headers: Mapping[str, str]
    body: bytes

    @property
    def scores(self) -> dict[str, dict[str, float]]:
        """The ``x-epp-decision`` header: every candidate's per-scorer scores, by endpoint."""
        found: dict[str, dict[str, float]] = {}
        for name, _total, detail in _SCORED.findall(self.headers.get(DECISION_HEADER, "")):
            found[name] = {k: float(v) for k, _, v in (d.partition("=") for d in detail.split())}
        return found


def _prompt() -> str:
    # Shorter than one prefix block: no prefix-cache affinity between the probes.
    return f"q {uuid.uuid4().hex[:12]}"


async def complete(
    session: aiohttp.ClientSession, url: str, *, headers: Mapping[str, str] | None = None
) -> Reply:
    """One short completion through Envoy (a fresh prompt each time)."""
    body = orjson.dumps({"model": DEFAULT_MODEL, "prompt": _prompt(), "max_tokens": 1})
    async with session.post(
        f"{url}/v1/completions",
        data=body,
        headers=dict(headers or {}),
        timeout=aiohttp.ClientTimeout(total=5),
    ) as response:
        data = await response.read()
        return Reply(
            response.status, response.headers.get(INSTANCE_HEADER, ""), response.headers, data
        )


async def poll(condition: Any, *, within: float, what: str) -> Any:
    """Awaits ``condition()`` until it returns something truthy; fails after ``within`` s."""
    deadline = time.monotonic() + within
    while True:
        value = await condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {within}s waiting for {what}"
        await asyncio.sleep(0.02)


async def wait_for_candidates(
    session: aiohttp.ClientSession, url: str, expected: set[str], *, within: float = 10.0
) -> None:
    """Until the EPP scores exactly the ``expected`` endpoints (its view of the pool)."""

    async def seen() -> bool:
        reply = await complete(session, url)
        return reply.status == 200 and set(reply.scores) == expected

    await poll(seen, within=within, what=f"the EPP to consider exactly {sorted(expected)}")


async def sim_stats(session: aiohttp.ClientSession, sim_url: str) -> dict[str, Any]:
    async with session.get(f"{sim_url}/sim/stats") as response:
        document: dict[str, Any] = await response.json()
        return document


@contextlib.asynccontextmanager
async def kv_hog(session: aiohttp.ClientSession, sim_url: str) -> AsyncIterator[None]:
    """A long request sent straight to one simulator, holding 86 % of its KV cache until the
    block ends (then it is cancelled, and the simulator aborts it)."""
    body = orjson.dumps({"model": DEFAULT_MODEL, "prompt": KV_HOG_PROMPT, "max_tokens": 100})

    async def run() -> None:
        async with session.post(f"{sim_url}/v1/completions", data=body) as response:
            await response.read()

    task = asyncio.create_task(run())

    async def holding() -> bool:
        assert not task.done(), task
        return bool((await sim_stats(session, sim_url))["kv_cache"]["usage"] >= 0.8)

    try:
        await poll(holding, within=5, what="the KV cache to fill")
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
            await task


# -- readiness follows the InferencePool ------------------------------------------------------


def test_not_ready_until_the_inference_pool_exists(tmp_path: Path) -> None:
    with KubeApiServer() as api:
        kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", api.url)
        options = StackOptions(
            simulators=0,
            envoy=False,
            wait_for_serving=False,
            epp_tls=False,
            epp_discovery=[
                "--pool-name",
                POOL,
                "--pool-namespace",
                "default",
                "--kubeconfig",
                str(kubeconfig),
            ],
        )
        with Stack.run(options) as stack:
            assert stack.epp is not None
            epp = stack.epp
            wait_for(
                lambda: "InferencePool default/pool not found" in epp.log(),
                timeout=15,
                what="the EPP to log that the pool does not exist",
            )
            assert stack.epp_readiness() == NOT_SERVING

            api.create(
                INFERENCE_POOLS_V1,
                inference_pool_v1(POOL, selector=MODEL_LABELS, ports=[free_port()]),
            )
            api.create(PODS, model_pod("pod-a"))
            api.create(PODS, model_pod("pod-b"))
            wait_for(lambda: stack.epp_readiness() == SERVING, timeout=10, what="readiness SERVING")
            assert "InferencePool default/pool: 2 pods, 2 endpoints" in epp.log()

            api.delete(INFERENCE_POOLS_V1, POOL)
            wait_for(
                lambda: stack.epp_readiness() == NOT_SERVING,
                timeout=10,
                what="readiness NOT_SERVING after the pool was deleted",
            )
            assert "InferencePool default/pool was deleted" in epp.log()


# -- routing from a live pool -----------------------------------------------------------------


@dataclass
class Cluster:
    api: KubeApiServer
    stack: Stack
    port: int
    kubeconfig: Path

    def sim_url(self, pod_name: str) -> str:
        return f"http://{POD_IPS[pod_name]}:{self.port}"

    def pod_of(self, reply: Reply) -> str:
        """The pod whose simulator served ``reply``."""
        address = self.stack.simulator_addresses[reply.instance]
        return next(name for name, ip in POD_IPS.items() if address == f"{ip}:{self.port}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    port = free_port(POD_IPS["pod-a"])
    with KubeApiServer() as api:
        kubeconfig = write_kubeconfig(tmp_path_factory.mktemp("kube") / "kubeconfig", api.url)
        api.create(INFERENCE_POOLS_V1, inference_pool_v1(POOL, selector=MODEL_LABELS, ports=[port]))
        apply_pods(api, model_pod("pod-a"), model_pod("pod-b"))
        options = StackOptions(
            simulators=3,
            simulator_base_ip=POD_IPS["pod-a"],
            simulator_port=port,
            simulator_args=SIMULATOR_ARGS,
            epp_discovery=[
                "--pool-name",
                POOL,
                "--pool-namespace",
                "default",
                "--kubeconfig",
                str(kubeconfig),
            ],
            # the reference's default: these tests follow the scraped metrics' scorers
            epp_args=["--explain-decisions", "--config-text", REFERENCE_DEFAULT_CONFIG_TEXT],
        )
        with Stack.run(options) as stack:
            assert set(stack.simulator_addresses.values()) == {
                f"{ip}:{port}" for ip in POD_IPS.values()
            }
            yield Cluster(api, stack, port, kubeconfig)


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as client:
        yield client


@pytest.fixture
async def pool(cluster: Cluster, session: aiohttp.ClientSession) -> Cluster:
    """The pool with two ready pods, pod-a and pod-b, idle, without objectives or rewrites."""
    api = cluster.api
    for resource, name in ((INFERENCE_OBJECTIVES, "batch"), (INFERENCE_MODEL_REWRITES, "food")):
        if api.get(resource, name) is not None:
            api.delete(resource, name)
    apply_pods(api, model_pod("pod-a"), model_pod("pod-b"))
    await wait_for_candidates(session, cluster.stack.url, {endpoint("pod-a"), endpoint("pod-b")})

    async def idle() -> bool:
        for name in POD_IPS:
            requests = (await sim_stats(session, cluster.sim_url(name)))["requests"]
            if requests["running"] or requests["waiting"]:
                return False
        return True

    await poll(idle, within=10, what="the simulators to be idle")
    return cluster


async def serve(session: aiohttp.ClientSession, pool: Cluster, count: int) -> Counter[str]:
    """``count`` requests through Envoy; how many each pod served."""
    served: Counter[str] = Counter()
    for _ in range(count):
        reply = await complete(session, pool.stack.url)
        assert reply.status == 200, reply.body
        served[pool.pod_of(reply)] += 1
    return served


async def test_traffic_follows_the_pools_ready_pods(
    pool: Cluster, session: aiohttp.ClientSession
) -> None:
    api, url = pool.api, pool.stack.url
    # pod-c is in the pool but not Ready; the stray pod is Ready but not selected.
    apply_pods(
        api,
        model_pod("pod-a"),
        model_pod("pod-b"),
        model_pod("pod-c", ready=False),
        pod(STRAY_POD, ip=POD_IPS["pod-c"], labels={"app": "other"}),
    )
    served = await serve(session, pool, 20)
    assert set(served) == {"pod-a", "pod-b"}, served

    api.modify(PODS, "pod-c", _set_ready(True))

    async def pod_c_served() -> bool:
        return pool.pod_of(await complete(session, url)) == "pod-c"

    await poll(pod_c_served, within=10, what="the newly Ready pod-c to get a request")
    await wait_for_candidates(session, url, {endpoint(p) for p in ("pod-a", "pod-b", "pod-c")})

    api.modify(PODS, "pod-a", _set_ready(False))
    await wait_for_candidates(session, url, {endpoint("pod-b"), endpoint("pod-c")})
    served = await serve(session, pool, 20)
    assert set(served) == {"pod-b", "pod-c"}, served

    api.delete(PODS, "pod-b")
    await wait_for_candidates(session, url, {endpoint("pod-c")})
    assert await serve(session, pool, 5) == {"pod-c": 5}


def _set_ready(ready: bool) -> Any:
    def change(obj: dict[str, Any]) -> None:
        for condition in obj["status"]["conditions"]:
            if condition["type"] == "Ready":
                condition["status"] = "True" if ready else "False"

    return change


async def test_routing_follows_the_scraped_kv_cache_use(
    pool: Cluster, session: aiohttp.ClientSession
) -> None:
    busy = endpoint("pod-b")
    async with kv_hog(session, pool.sim_url("pod-b")):
        usage = (await sim_stats(session, pool.sim_url("pod-b")))["kv_cache"]["usage"]

        async def scraped() -> Reply | None:
            reply = await complete(session, pool.stack.url)
            scores = reply.scores
            if scores.get(busy, {}).get("kv-cache-utilization-scorer", 1.0) < 0.2:
                return reply
            return None

        reply = await poll(scraped, within=10, what="the EPP to scrape pod-b's KV-cache use")
        scores = reply.scores
        # The score is 1 - the simulator's kv_cache_usage_perc (it grows while the hog
        # decodes: at most by the blocks of 100 tokens).
        assert 1 - usage - 0.1 <= scores[busy]["kv-cache-utilization-scorer"] <= 1 - usage
        assert scores[endpoint("pod-a")]["kv-cache-utilization-scorer"] == 1.0
        assert await serve(session, pool, 10) == {"pod-a": 10}


async def test_sheddable_objective_gets_429_while_the_pool_is_saturated(
    pool: Cluster, session: aiohttp.ClientSession
) -> None:
    api, url = pool.api, pool.stack.url
    apply_pods(api, model_pod("pod-a"))
    await wait_for_candidates(session, url, {endpoint("pod-a")})
    api.create(INFERENCE_OBJECTIVES, inference_objective("batch", pool=POOL, priority=-1))
    sheddable = {OBJECTIVE_HEADER: "batch"}

    # Not saturated: the sheddable objective is served.
    reply = await complete(session, url, headers=sheddable)
    assert reply.status == 200, reply.body

    async with kv_hog(session, pool.sim_url("pod-a")):

        async def shed() -> Reply | None:
            reply = await complete(session, url, headers=sheddable)
            return reply if reply.status == 429 else None

        reply = await poll(shed, within=10, what="a sheddable request to be rejected")
        assert b"system saturated, sheddable request dropped" in reply.body
        assert INSTANCE_HEADER not in reply.headers  # never reached a model server
        for headers in ({}, {OBJECTIVE_HEADER: "not-an-objective"}):
            reply = await complete(session, url, headers=headers)
            assert reply.status == 200, reply.body
            assert pool.pod_of(reply) == "pod-a"

    async def served_again() -> bool:
        return (await complete(session, url, headers=sheddable)).status == 200

    await poll(served_again, within=10, what="sheddable requests to be served again")


async def test_model_rewrite_changes_the_model_the_server_runs(
    pool: Cluster, session: aiohttp.ClientSession
) -> None:
    """The simulator runs a request for a LoRA adapter on that adapter, visible in its
    ``/sim/stats`` (``lora.running``) while the request streams; the EPP writes the model
    name of the response back to the one the client asked for."""
    url = pool.stack.url
    pool.api.create(
        INFERENCE_MODEL_REWRITES,
        model_rewrite("food", pool=POOL, rules=[(["food-review"], [(LORA, 100)])]),
    )
    payload = {"model": "food-review", "prompt": "Rate this pizza", "max_tokens": 1}

    async def rewritten() -> bool:
        body = orjson.dumps(payload)
        async with session.post(f"{url}/v1/completions", data=body) as response:
            await response.read()
            assert response.status == 200
            # The simulator reports a digest of the body it received.
            return bool(response.headers[BODY_SHA256_HEADER] != _sha256(body))

    await poll(rewritten, within=10, what="the rewrite rule to reach the EPP")

    body = orjson.dumps({**payload, "max_tokens": 16, "stream": True})
    async with session.post(f"{url}/v1/completions", data=body) as response:
        assert response.status == 200
        first = await response.content.readline()
        assert first.startswith(b"data: ")
        served_by = pool.stack.simulator_urls[response.headers[INSTANCE_HEADER]]
        stats = await sim_stats(session, served_by)
        assert stats["lora"]["running"] == [LORA]
        rest = await response.read()
    events = [line for line in (first + rest).splitlines() if line.startswith(b"data: {")]
    assert events
    assert {orjson.loads(e.removeprefix(b"data: "))["model"] for e in events} == {"food-review"}


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


async def test_endpoint_selector_mode_routes_to_the_matching_pods(
    pool: Cluster, session: aiohttp.ClientSession
) -> None:
    api = pool.api
    selected = {"tier": "x"}
    apply_pods(
        api,
        model_pod("pod-a", labels=selected),
        model_pod("pod-b"),
        model_pod("pod-c", labels=selected),
    )
    options = StackOptions(
        simulators=0,
        epp_discovery=[
            "--endpoint-selector",
            "tier=x",
            "--endpoint-target-ports",
            str(pool.port),
            "--pool-namespace",
            "default",
            "--kubeconfig",
            str(pool.kubeconfig),
        ],
        epp_args=["--explain-decisions"],
    )
    with Stack.run(options) as selector_stack:
        url = selector_stack.url
        await wait_for_candidates(session, url, {endpoint("pod-a"), endpoint("pod-c")})
        served: Counter[str] = Counter()
        for _ in range(20):
            reply = await complete(session, url)
            assert reply.status == 200, reply.body
            served[pool.pod_of(reply)] += 1
        assert set(served) == {"pod-a", "pod-c"}, served
