"""Prometheus text exposition (format 0.0.4) of the engine state, named as vLLM names it."""

from __future__ import annotations

from collections.abc import Mapping

from tests.simulator.config import SimulatorConfig
from tests.simulator.engine import EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
ENGINE_INDEX = "0"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _format_value(value: float) -> str:
    return repr(float(value))


class _Exposition:
    def __init__(self) -> None:
        self._lines: list[str] = []

    def family(
        self,
        name: str,
        kind: str,
        help_text: str,
        samples: list[tuple[Mapping[str, str], float]],
    ) -> None:
        self._lines.append(f"# HELP {name} {help_text}")
        self._lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            rendered = ",".join(f'{key}="{_escape(val)}"' for key, val in labels.items())
            self._lines.append(f"{name}{{{rendered}}} {_format_value(value)}")

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
    return out.text()
