"""Benchmark (not a test): what a pod costs with no traffic, by process, as its workers and
the model servers it scrapes grow.

Starts ``--endpoints`` lightweight model servers (``tests.bench.scrape_cpu``'s: each answers
``GET /metrics`` with the ~11 KB vLLM fixture whose gauges change on every response) in a
separate process, one redis-server, and then, for each count of ``--workers`` in turn
(``--repeat`` times, alternated), an EPP pod in static mode scraping them every 50 ms (the
default), plaintext, no request sent. After ``--settle`` seconds it prints the CPU of each
process of the pod over ``--seconds``, as a share of one core: the supervisor (it scrapes
and relays each result to every worker) and each worker (it applies what is relayed), or the
one process.

    .venv/bin/python -m tests.bench.pod_idle [--endpoints 100] [--workers 1,2] [--repeat 2]
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.bench.load import cpu_seconds
from tests.bench.pod import pod_pids
from tests.bench.scrape_cpu import model_server_addresses, start_model_servers
from tests.support.redis import RedisServer
from tests.support.stack import free_port, wait_for


def _model_servers(count: int, exits: contextlib.ExitStack) -> list[str]:
    server = start_model_servers(count, "127.0.1.2")
    exits.callback(server.wait, 10)
    exits.callback(server.terminate)
    return model_server_addresses(server)


def _measure(
    workers: int, addresses: list[str], redis_url: str, settle: float, seconds: float
) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp, (Path(tmp) / "epp.log").open("w") as log:
        epp = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "app",
                "--static-endpoints",
                ",".join(addresses),
                "--metrics-endpoint-auth=false",
                "--bind-address",
                "127.0.0.1",
                "--grpc-port",
                str(free_port()),
                "--grpc-health-port",
                str(free_port()),
                "--metrics-port",
                "0",
                "--secure-serving=false",
                "--redis-url",
                redis_url,
                "--workers",
                str(workers),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            expected = workers + 1 if workers > 1 else 1
            wait_for(
                lambda: len(pod_pids(epp.pid)) == expected, timeout=60, what="the pod's processes"
            )
            time.sleep(settle)
            pids = pod_pids(epp.pid)
            before = [cpu_seconds(p) for p in pids]
            started = time.monotonic()
            time.sleep(seconds)
            elapsed = time.monotonic() - started
            return [(cpu_seconds(p) - b) / elapsed for p, b in zip(pids, before, strict=True)]
        finally:
            epp.terminate()
            epp.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--endpoints", type=int, default=100)
    parser.add_argument("--workers", default="1,2", help="comma-separated worker counts")
    parser.add_argument("--repeat", type=int, default=2, help="runs per count, alternated")
    parser.add_argument("--settle", type=float, default=8.0, help="seconds before measuring")
    parser.add_argument("--seconds", type=float, default=20.0, help="seconds measured")
    args = parser.parse_args()
    counts = [int(text) for text in args.workers.split(",")]
    with contextlib.ExitStack() as exits:
        addresses = _model_servers(args.endpoints, exits)
        redis = RedisServer()
        redis.start()
        exits.callback(redis.stop)
        for _ in range(args.repeat):
            for workers in counts:
                shares = _measure(workers, addresses, redis.url, args.settle, args.seconds)
                parts = ", ".join(f"{share * 100:.1f}" for share in shares)
                label = "supervisor, workers" if workers > 1 else "one process"
                print(
                    f"{args.endpoints} model servers scraped every 50 ms, {workers} worker(s), "
                    f"no traffic: {sum(shares) * 100:.1f}% of a core ({label}: {parts})",
                    flush=True,
                )


if __name__ == "__main__":
    main()
