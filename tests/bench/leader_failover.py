"""Benchmark (not a test): time from the leader's loss to the standby's readiness.

Two EPP processes with ``--ha-enable-leader-election`` and the default lease settings
(15 s lease, 10 s renew deadline, 2 s retry period) serve one InferencePool from the
loopback Kubernetes API server. Once one is ready (gRPC health ``readiness`` SERVING) and
the other is a warm standby (synced, NOT_SERVING), the leader is stopped, and the script
measures how long until the standby reports SERVING:

- ``SIGTERM`` (a pod deleted, a rollout): the leader releases its Lease on the way out;
- ``SIGKILL`` (a node lost, OOM): nobody releases it; the standby waits the lease duration
  it observed.

Each round restarts the stopped replica so that the next round has a standby again.

    .venv/bin/python -m tests.bench.leader_failover --rounds 3 --signals TERM,KILL

``--workers N`` runs each replica as a pod of N workers (``--workers`` > 1 needs Redis: the
script starts a redis-server the replicas share).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support.kube_api import (
    INFERENCE_POOLS_V1,
    LEASES,
    PODS,
    KubeApiServer,
    inference_pool_v1,
    pod,
    write_kubeconfig,
)
from tests.support.redis import RedisServer
from tests.support.stack import ChildProcess, free_port, wait_for

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Replica:
    def __init__(self, name: str, workdir: Path, kubeconfig: Path, extra: list[str]) -> None:
        self.name = name
        self.health_port = free_port()
        self.child = ChildProcess(
            name,
            [
                sys.executable,
                "-m",
                "app",
                "--pool-name",
                "pool",
                "--pool-namespace",
                "default",
                "--kubeconfig",
                str(kubeconfig),
                "--ha-enable-leader-election",
                "--metrics-endpoint-auth=false",
                "--secure-serving=false",
                "--bind-address",
                "127.0.0.1",
                "--grpc-port",
                "0",
                "--grpc-health-port",
                str(self.health_port),
                "--metrics-port",
                "0",
                "--shutdown-grace-period",
                "1s",
                *extra,
            ],
            workdir / f"{name}.log",
            env={**os.environ, "PYTHONUNBUFFERED": "1", "POD_NAME": name},
        )

    def readiness(self) -> int | None:
        with grpc.insecure_channel(f"127.0.0.1:{self.health_port}") as channel:
            try:
                response = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service="readiness"), timeout=1
                )
            except grpc.RpcError:
                return None
        return int(response.status)


LEASE_NAME = "epp-default-pool.gateway-api-inference-extension.sigs.k8s.io"


def _lease_end(api: KubeApiServer) -> float:
    """When the Lease lapses unless renewed (wall clock): its renewTime + duration."""
    lease = api.get(LEASES, LEASE_NAME)
    assert lease is not None, "no Lease"
    spec = lease["spec"]
    renewed = datetime.datetime.fromisoformat(spec["renewTime"].replace("Z", "+00:00"))
    return renewed.timestamp() + float(spec["leaseDurationSeconds"])


def failover(
    workdir: Path, api: KubeApiServer, signum: int, extra: list[str] | None = None
) -> tuple[float, float]:
    """Start two replicas, stop the leader with ``signum``; seconds from the stop to the
    standby's readiness, and from the Lease's loss (released, or lapsed) to it."""
    kubeconfig = write_kubeconfig(workdir / "kubeconfig", api.url)
    replicas = [Replica(f"epp-{n}", workdir, kubeconfig, extra or []) for n in range(2)]
    for replica in replicas:
        replica.child.start()
    try:

        def leader() -> Replica | None:
            states = [r.readiness() for r in replicas]
            if None in states:
                return None
            serving = [r for r, s in zip(replicas, states, strict=True) if s == SERVING]
            return serving[0] if len(serving) == 1 else None

        first = wait_for(leader, timeout=60, what="one replica to lead")
        (standby,) = [r for r in replicas if r is not first]
        assert standby.readiness() == NOT_SERVING
        assert first.child.process is not None
        first.child.process.send_signal(signum)
        lost = time.monotonic()
        stopped_at = time.time()
        lease_end = _lease_end(api)
        wait_for(lambda: standby.readiness() == SERVING, timeout=60, what="the standby")
        ready = time.monotonic() - lost
        # SIGTERM releases the Lease at once; SIGKILL leaves it to lapse.
        loss = stopped_at if signum == signal.SIGTERM else max(stopped_at, lease_end)
        return ready, stopped_at + ready - loss
    finally:
        for replica in replicas:
            replica.child.stop(timeout=10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--signals", default="TERM,KILL")
    parser.add_argument("--workers", type=int, default=1, help="worker processes per replica")
    args = parser.parse_args()
    with contextlib.ExitStack() as exits:
        extra = []
        if args.workers > 1:
            redis = RedisServer()
            redis.start()
            exits.callback(redis.stop)
            extra = ["--workers", str(args.workers), "--redis-url", redis.url]
        _rounds(args, extra)


def _rounds(args: argparse.Namespace, extra: list[str]) -> None:
    with KubeApiServer() as api, tempfile.TemporaryDirectory() as tmp:
        api.create(INFERENCE_POOLS_V1, inference_pool_v1("pool", selector={"app": "model"}))
        api.create(PODS, pod("model-0", ip="127.0.0.61", labels={"app": "model"}))
        for name in args.signals.split(","):
            signum = getattr(signal, f"SIG{name}")
            times, after_loss = [], []
            for n in range(args.rounds):
                workdir = Path(tmp) / f"{name}-{n}"
                workdir.mkdir()
                ready, since_loss = failover(workdir, api, signum, extra)
                times.append(ready)
                after_loss.append(since_loss)
            print(
                f"SIG{name}, default lease settings, {args.workers} worker(s) per replica, "
                f"over {len(times)} rounds: "
                f"leader stopped -> standby ready median {statistics.median(times):.2f}s, "
                f"max {max(times):.2f}s ({', '.join(f'{t:.2f}' for t in times)}); "
                f"Lease lost (released or lapsed) -> standby ready median "
                f"{statistics.median(after_loss):.2f}s, max {max(after_loss):.2f}s"
            )


if __name__ == "__main__":
    main()
