"""Micro-benchmark (not a test): what rendering the EPP's own ``/metrics`` costs at the label cap.

Fills a ``PrometheusObserver`` the way the a2 attack does, only more: every metric of the
catalogue reported for ``--models`` (1,000, the label cap) distinct model names (histograms
with one observation in each of several buckets), then renders the exposition ``--rounds``
times with ``prometheus_client.generate_latest`` (how ``/metrics`` was rendered before), with
the observer's own ``exposition()``, and with ``exposition_parts()`` (what ``/metrics``
writes, family by family, never joined), each round after one more report per model (so no
render is like the last). Prints, per variant, the body size, the CPU time per render (the
best round) and the peak of Python allocations during one render (tracemalloc), and checks
that all variants give the same text.

``--worst``: every cap reached at once, the largest ``/metrics`` the label caps allow: each
request-derived label at its 1,000 distinct values of 256 characters, ten fairness ids per
model (every metric that has both at its 10,000-series cap); prints the body's size and its
series (``generate_latest`` left out: minutes).

    .venv/bin/python -m tests.bench.metrics_render [--models 1000] [--rounds 5] [--worst]
"""

from __future__ import annotations

import argparse
import time
import tracemalloc
from collections.abc import Callable

from prometheus_client.exposition import generate_latest

from adapters.prometheus.exporter import (
    MAX_LABEL_LENGTH,
    REQUEST_DERIVED_LABELS,
    PrometheusObserver,
)
from ports.metric_catalogue import CATALOGUE, HistogramMetric, MetricKind

__all__ = ["main"]

MIB = 1 << 20


def _labels(names: tuple[str, ...], model: str, fairness: str | None = None) -> dict[str, str]:
    return {
        n: (
            fairness
            if n == "fairness_id" and fairness is not None
            else model
            if n in REQUEST_DERIVED_LABELS
            else "value"
        )
        for n in names
    }


def _combinations(models: int, worst: bool) -> list[tuple[int, str, str | None]]:
    if not worst:
        return [(i, f"model-{i:05d}", None) for i in range(models)]
    return [
        (
            i,
            f"model-{i:05d}-".ljust(MAX_LABEL_LENGTH, "m"),
            f"tenant-{j}-".ljust(MAX_LABEL_LENGTH, "t"),
        )
        for i in range(models)
        for j in range(10)
    ]


def _report(observer: PrometheusObserver, models: int, step: int, worst: bool = False) -> None:
    for i, model, fairness in _combinations(models, worst):
        for metric in CATALOGUE:
            labels = _labels(metric.labels, model, fairness)
            if metric.kind is MetricKind.COUNTER:
                observer.counter(metric, labels)  # type: ignore[arg-type]
            elif metric.kind is MetricKind.GAUGE:
                observer.gauge(metric, labels, float(i + step))  # type: ignore[arg-type]
            else:
                assert isinstance(metric, HistogramMetric)
                for bound in metric.buckets[:: max(1, len(metric.buckets) // 4)]:
                    observer.histogram(metric, labels, bound * 0.9 + step)


def _measure(render: Callable[[], bytes | list[bytes]]) -> tuple[bytes, float, int]:
    tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    result = render()
    peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    body = result if isinstance(result, bytes) else b"".join(result)
    started = time.process_time()
    render()
    return body, time.process_time() - started, peak


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--models", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--worst", action="store_true", help="every label cap reached")
    args = parser.parse_args()
    observer = PrometheusObserver()
    variants: dict[str, Callable[[], bytes | list[bytes]]] = {
        "generate_latest (before)": lambda: generate_latest(observer.registry),
        "exposition()": observer.exposition,
        "exposition_parts() (/metrics)": observer.exposition_parts,
    }
    if args.worst:
        del variants["generate_latest (before)"]
    best: dict[str, tuple[int, float, int]] = {}
    for step in range(args.rounds):
        _report(observer, args.models, step, args.worst)
        bodies = []
        for name, render in variants.items():
            body, cpu, peak = _measure(render)
            bodies.append(body)
            size, best_cpu, best_peak = best.get(name, (0, float("inf"), 1 << 62))
            best[name] = (len(body), min(best_cpu, cpu), min(best_peak, peak))
        if any(body != bodies[0] for body in bodies):
            print("the renders differ")
            return 1
    print(f"{args.models} model names, {args.rounds} rounds; all renders give the same text")
    series = sum(1 for line in bodies[0].splitlines() if line and not line.startswith(b"#"))
    print(f"  {series:,} series")
    for name, (size, cpu, peak) in best.items():
        print(
            f"  {name:30s} body {size / MIB:6.2f} MiB  CPU {cpu * 1000:7.1f} ms  "
            f"peak Python allocations {peak / MIB:6.2f} MiB"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
