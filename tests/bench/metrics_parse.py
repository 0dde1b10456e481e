"""Micro-benchmark (not a test): what reading one model server's ``/metrics`` body costs.

Times, on the ~11 KB vLLM fixture of the unit tests, the full parse of every family, the
wanted-only parse of the families the vLLM engine reads, and ``core-metrics-extractor``'s
whole ``extract``: on the same body every time (an idle server), on bodies whose queue,
running and KV-usage values change on every call (a loaded server), and with the parser's
line cache emptied before every call (the worst case). Prints µs per
call (CPU time, the best of several rounds) and what ``extract`` would cost at the default scrape
rate for 100 endpoints (every 50 ms: 2,000 bodies a second).

    .venv/bin/python -m tests.bench.metrics_parse [--rounds 7] [--number 2000]
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Callable
from pathlib import Path

from domain.datalayer import prometheus_text
from domain.datalayer.plugins.core_metrics_extractor import (
    TYPE,
    CoreMetricsExtractor,
    CoreMetricsExtractorParameters,
)
from domain.datalayer.prometheus_text import parse_families
from domain.plugins.base import TypedName
from ports.datalayer import MetricsText
from tests.support.scheduling import endpoint

FIXTURE = Path(__file__).parents[1] / "unit" / "datalayer" / "fixtures" / "vllm.txt"
VLLM_FAMILIES = frozenset(
    {
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "vllm:lora_requests_info",
        "vllm:cache_config_info",
    }
)
BODIES_PER_SECOND = 100 * 20  # 100 endpoints, one scrape every 50 ms


def best_us(call: Callable[[], object], rounds: int, number: int) -> float:
    """CPU µs per call (this thread's CPU time, so other processes' load counts less),
    the best of ``rounds`` rounds of ``number`` calls."""
    best = float("inf")
    for _ in range(rounds):
        start = time.thread_time()
        for _ in range(number):
            call()
        best = min(best, (time.thread_time() - start) / number)
    return best * 1e6


def varying_bodies(body: bytes, count: int) -> list[bytes]:
    """Copies of ``body`` whose three load gauges differ from one copy to the next."""
    bodies = []
    for i in range(count):
        bodies.append(
            body.replace(b"} 3.0\n", f"}} {i % 17}.0\n".encode(), 1)
            .replace(b"} 7.0\n", f"}} {i % 23}.0\n".encode(), 1)
            .replace(b"} 0.4172661870503597\n", f"}} {i / count!r}\n".encode(), 1)
        )
    return bodies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--number", type=int, default=2000)
    args = parser.parse_args()
    rounds, number = args.rounds, args.number

    body = FIXTURE.read_bytes()
    extractor = CoreMetricsExtractor(TypedName(TYPE, TYPE), CoreMetricsExtractorParameters())
    target = endpoint("bench")
    same = MetricsText(body=body, fetched_at=0.0)
    # More distinct bodies than the line cache holds, so changed lines are always parsed.
    changing = itertools.cycle(
        [MetricsText(body=b, fetched_at=0.0) for b in varying_bodies(body, 5000)]
    )

    def cold_extract() -> None:
        prometheus_text._line_cache.clear()
        extractor.extract(same, target, 1.0)

    results = {
        "full parse (all families)": best_us(lambda: parse_families(body), rounds, number // 10),
        "wanted-only parse": best_us(lambda: parse_families(body, VLLM_FAMILIES), rounds, number),
        "extract, same body": best_us(lambda: extractor.extract(same, target, 1.0), rounds, number),
        "extract, changing values": best_us(
            lambda: extractor.extract(next(changing), target, 1.0), rounds, number
        ),
        "extract, empty line cache": best_us(cold_extract, rounds, number),
    }
    lines = body.count(b"\n")
    print(f"vLLM fixture: {len(body)} bytes, {lines} lines")
    for name, micros in results.items():
        print(f"  {name:<28} {micros:8.1f} µs")
    for case in ("extract, same body", "extract, changing values"):
        share = results[case] * BODIES_PER_SECOND / 1e6
        print(f"  {case} at {BODIES_PER_SECOND} bodies/s: {share:.1%} of one core")


if __name__ == "__main__":
    main()
