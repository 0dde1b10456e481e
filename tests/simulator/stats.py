"""Engine records: latency histograms (vLLM's buckets), samples and the stats snapshot."""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

TTFT_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
"""Upper bounds of ``vllm:time_to_first_token_seconds``."""
ITL_BUCKETS: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
"""Upper bounds of ``vllm:inter_token_latency_seconds``."""
REQUEST_LATENCY_BUCKETS: tuple[float, ...] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
    30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
"""Upper bounds of ``vllm:e2e_request_latency_seconds`` and ``request_queue_time_seconds``."""


class Histogram:
    """A Prometheus-style histogram that may also keep every observation."""

    def __init__(self, buckets: Sequence[float], *, keep_samples: bool = False) -> None:
        self.buckets = tuple(buckets)
        self._counts = [0] * (len(self.buckets) + 1)  # the last one is +Inf
        self.count = 0
        self.sum = 0.0
        self.max = 0.0
        self._samples: list[float] | None = [] if keep_samples else None

    def observe(self, value: float) -> None:
        self._counts[bisect.bisect_left(self.buckets, value)] += 1
        self.count += 1
        self.sum += value
        self.max = max(self.max, value)
        if self._samples is not None:
            self._samples.append(value)

    def snapshot(self, *, with_samples: bool = False) -> HistogramSnapshot:
        """Current state; the kept samples are copied only if ``with_samples``."""
        cumulative: list[int] = []
        running = 0
        for bucket_count in self._counts:
            running += bucket_count
            cumulative.append(running)
        return HistogramSnapshot(
            buckets=self.buckets,
            cumulative_counts=tuple(cumulative),
            count=self.count,
            sum=self.sum,
            max=self.max,
            samples=tuple(self._samples) if with_samples and self._samples is not None else None,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class HistogramSnapshot:
    """Histogram state: ``cumulative_counts[i]`` observations ≤ ``buckets[i]`` (+Inf last)."""

    buckets: tuple[float, ...]
    cumulative_counts: tuple[int, ...]
    count: int
    sum: float
    max: float
    samples: tuple[float, ...] | None = None

    def summary(self) -> dict[str, float | int]:
        """Count, sum, mean and max, plus exact p50/p90/p99/min when samples were kept."""
        result: dict[str, float | int] = {
            "count": self.count,
            "sum": self.sum,
            "mean": self.sum / self.count if self.count else 0.0,
            "max": self.max,
        }
        if self.samples is not None:
            ordered = sorted(self.samples)
            result["min"] = ordered[0] if ordered else 0.0
            for name, quantile in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
                result[name] = _nearest_rank(ordered, quantile)
        return result


def _nearest_rank(ordered: Sequence[float], quantile: float) -> float:
    if not ordered:
        return 0.0
    rank = max(1, math.ceil(quantile * len(ordered)))
    return ordered[rank - 1]


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineStats:
    """Point-in-time view of the engine, as exported on ``/metrics`` and ``/sim/stats``.

    Latencies are in simulated seconds (see ``SimulatorConfig.time_scale``).
    """

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    kv_used_blocks: int
    kv_cached_blocks: int
    kv_evictions: int
    running_lora_adapters: tuple[str, ...]
    waiting_lora_adapters: tuple[str, ...]
    prompt_tokens_total: int
    generation_tokens_total: int
    prefix_cache_queries_total: int
    prefix_cache_hits_total: int
    preemptions_total: int
    request_success_total: dict[str, int] = field(default_factory=dict)
    ttft: HistogramSnapshot
    itl: HistogramSnapshot
    e2e_latency: HistogramSnapshot
    queue_time: HistogramSnapshot

    def document(self, *, include_samples: bool = False) -> dict[str, Any]:
        """The JSON document served on ``/sim/stats`` (without the instance fields)."""
        queries = self.prefix_cache_queries_total
        hits = self.prefix_cache_hits_total
        document: dict[str, Any] = {
            "requests": {
                "running": self.num_running,
                "waiting": self.num_waiting,
                "finished": dict(self.request_success_total),
                "preemptions": self.preemptions_total,
            },
            "prefix_cache": {
                "queries": queries,
                "hits": hits,
                "hit_rate": hits / queries if queries else 0.0,
            },
            "kv_cache": {
                "usage": self.kv_cache_usage,
                "used_blocks": self.kv_used_blocks,
                "cached_blocks": self.kv_cached_blocks,
                "evictions": self.kv_evictions,
            },
            "tokens": {
                "prompt": self.prompt_tokens_total,
                "generation": self.generation_tokens_total,
            },
            "lora": {
                "running": list(self.running_lora_adapters),
                "waiting": list(self.waiting_lora_adapters),
            },
            "ttft": self.ttft.summary(),
            "itl": self.itl.summary(),
            "e2e_latency": self.e2e_latency.summary(),
            "queue_time": self.queue_time.summary(),
        }
        if include_samples:
            document["ttft_samples"] = list(self.ttft.samples or ())
            document["e2e_latency_samples"] = list(self.e2e_latency.samples or ())
        return document
