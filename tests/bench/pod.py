"""What an EPP pod is made of, for benchmarks: its processes, their CPU and memory, how the
streams split across workers, and how often each model server is scraped."""

from __future__ import annotations

import json
import os
import urllib.request
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from tests.bench.load import cpu_seconds

__all__ = ["PodSample", "pod_pids", "rss_mib", "sample_pod", "scrapes", "worker_requests"]


def pod_pids(pid: int) -> list[int]:
    """``pid`` and its child processes (the workers under a supervisor)."""
    children: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                children.extend(int(c) for c in f.read().split())
        except FileNotFoundError:
            continue
    return [pid, *children]


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=5) as response:
        return bytes(response.read())


def worker_requests(metrics_port: int) -> dict[int, float]:
    """Requests each worker served so far (``inference_objective_request_total``), by worker
    id, from the supervisor's ``/workers``; ``{0: n}`` for a lone process."""
    try:
        listing = json.loads(_get(f"http://127.0.0.1:{metrics_port}/workers"))
    except OSError:  # a lone process has no /workers
        listing = [{"worker": 0, "metrics_port": metrics_port}]
    counts = {}
    for worker in listing:
        if not worker["metrics_port"]:  # not serving yet
            continue
        text = _get(f"http://127.0.0.1:{worker['metrics_port']}/metrics").decode()
        counts[int(worker["worker"])] = sum(
            s.value
            for family in text_string_to_metric_families(text)
            if family.name == "inference_objective_request"
            for s in family.samples
        )
    return counts


def scrapes(simulator_urls: list[str]) -> list[int]:
    """``GET /metrics`` each simulated model server has answered so far."""
    return [int(json.loads(_get(f"{url}/sim/stats"))["metrics_scrapes"]) for url in simulator_urls]


@dataclass(frozen=True)
class PodSample:
    pids: list[int]
    cpu: float
    per_worker: dict[int, float]
    scrapes: list[int]


def sample_pod(pid: int, metrics_port: int, simulator_urls: list[str]) -> PodSample:
    pids = pod_pids(pid)
    return PodSample(
        pids=pids,
        cpu=sum(cpu_seconds(p) for p in pids),
        per_worker=worker_requests(metrics_port),
        scrapes=scrapes(simulator_urls),
    )
