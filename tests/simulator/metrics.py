"""Prometheus text exposition (format 0.0.4) of the engine state, named as vLLM names it.

Latency histograms are in simulated seconds (see ``SimulatorConfig.time_scale``).
"""

from __future__ import annotations

from collections.abc import Mapping

from tests.simulator.config import SimulatorConfig
from tests.simulator.stats import EngineStats, HistogramSnapshot

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
ENGINE_INDEX = "0"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _format_value(value: float) -> str:
    return repr(float(value))


def _render_labels(labels: Mapping[str, str]) -> str:
    return ",".join(f'{key}="{_escape(val)}"' for key, val in labels.items())


class _Exposition:
    def __init__(self) -> None:
        self._lines: list[str] = []

    def _header(self, name: str, kind: str, help_text: str) -> None:
        self._lines.append(f"# HELP {name} {help_text}")
        self._lines.append(f"# TYPE {name} {kind}")

    def family(
        self,
        name: str,
        kind: str,
        help_text: str,
        samples: list[tuple[Mapping[str, str], float]],
    ) -> None:
        self._header(name, kind, help_text)
        for labels, value in samples:
            self._lines.append(f"{name}{{{_render_labels(labels)}}} {_format_value(value)}")

    def histogram(
        self, name: str, help_text: str, labels: Mapping[str, str], data: HistogramSnapshot
    ) -> None:
        self._header(name, "histogram", help_text)
        bounds = [_format_value(bound) for bound in data.buckets] + ["+Inf"]
        for bound, count in zip(bounds, data.cumulative_counts, strict=True):
            rendered = _render_labels({**labels, "le": bound})
            self._lines.append(f"{name}_bucket{{{rendered}}} {_format_value(count)}")
        rendered = _render_labels(labels)
        self._lines.append(f"{name}_sum{{{rendered}}} {_format_value(data.sum)}")
        self._lines.append(f"{name}_count{{{rendered}}} {_format_value(data.count)}")

    def text(self) -> str:
        return "\n".join(self._lines) + "\n"


def render_metrics(config: SimulatorConfig, stats: EngineStats, now: float) -> str:
    """Render ``/metrics``; ``now`` (unix seconds) is the value of ``lora_requests_info``."""
    model = {"engine": ENGINE_INDEX, "model_name": config.model_name}
    out = _Exposition()
    out.family(
        "vllm:num_requests_running",
        "gauge",
        "Number of requests in model execution batches.",
        [(model, stats.num_running)],
    )
    out.family(
        "vllm:num_requests_waiting",
        "gauge",
        "Number of requests waiting to be processed.",
        [(model, stats.num_waiting)],
    )
    out.family(
        "vllm:kv_cache_usage_perc",
        "gauge",
        "KV-cache usage. 1 means 100 percent usage.",
        [(model, stats.kv_cache_usage)],
    )
    lora_labels = {
        "max_lora": str(config.max_loras),
        "running_lora_adapters": ",".join(stats.running_lora_adapters),
        "waiting_lora_adapters": ",".join(stats.waiting_lora_adapters),
    }
    out.family(
        "vllm:lora_requests_info",
        "gauge",
        "Running stats on lora requests.",
        [(lora_labels, now)],
    )
    cache_labels = {
        "block_size": str(config.block_size),
        "cache_dtype": "auto",
        "enable_prefix_caching": "True",
        "engine": ENGINE_INDEX,
        "gpu_memory_utilization": "0.9",
        "num_cpu_blocks": "None",
        "num_gpu_blocks": str(config.num_gpu_blocks),
        "num_gpu_blocks_override": "None",
        "prefix_caching_hash_algo": "sha256",
        "swap_space": "4",
    }
    out.family(
        "vllm:cache_config_info",
        "gauge",
        "Information of the LLMEngine CacheConfig",
        [(cache_labels, 1.0)],
    )
    out.family(
        "vllm:prefix_cache_queries_total",
        "counter",
        "Prefix cache queries, in terms of number of queried tokens.",
        [(model, stats.prefix_cache_queries_total)],
    )
    out.family(
        "vllm:prefix_cache_hits_total",
        "counter",
        "Prefix cache hits, in terms of number of cached tokens.",
        [(model, stats.prefix_cache_hits_total)],
    )
    out.family(
        "vllm:num_preemptions_total",
        "counter",
        "Cumulative number of preemption from the engine.",
        [(model, stats.preemptions_total)],
    )
    out.family(
        "vllm:prompt_tokens_total",
        "counter",
        "Number of prefill tokens processed.",
        [(model, stats.prompt_tokens_total)],
    )
    out.family(
        "vllm:generation_tokens_total",
        "counter",
        "Number of generation tokens processed.",
        [(model, stats.generation_tokens_total)],
    )
    out.family(
        "vllm:request_success_total",
        "counter",
        "Count of successfully processed requests.",
        [
            ({**model, "finished_reason": reason}, count)
            for reason, count in stats.request_success_total.items()
        ],
    )
    out.histogram(
        "vllm:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        model,
        stats.ttft,
    )
    out.histogram(
        "vllm:inter_token_latency_seconds",
        "Histogram of inter-token latency in seconds.",
        model,
        stats.itl,
    )
    out.histogram(
        "vllm:e2e_request_latency_seconds",
        "Histogram of e2e request latency in seconds.",
        model,
        stats.e2e_latency,
    )
    out.histogram(
        "vllm:request_queue_time_seconds",
        "Histogram of time spent in WAITING phase for request.",
        model,
        stats.queue_time,
    )
    return out.text()
