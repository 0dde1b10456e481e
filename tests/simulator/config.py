"""Configuration of one simulated model server."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MODEL = "meta-llama/Llama-3.1-8B-Instruct"


@dataclass(frozen=True, slots=True, kw_only=True)
class SimulatorConfig:
    """Behaviour of a simulated vLLM instance (shared by every instance of a fleet).

    Times are in seconds. The defaults make every request complete immediately so that
    tests run fast; raise ``ttft``/``itl`` to hold scheduler slots for a while.
    """

    served_model_names: tuple[str, ...] = (DEFAULT_MODEL,)
    """Model names the server answers to; the first one labels the metrics."""
    lora_adapters: tuple[str, ...] = ()
    """LoRA adapter names listed by ``/v1/models`` and reported in ``lora_requests_info``."""
    max_loras: int = 1
    """Value of the ``max_lora`` label of ``vllm:lora_requests_info``."""
    max_num_seqs: int = 256
    """Maximum number of concurrently running requests; the rest wait in FIFO order."""
    ttft: float = 0.0
    """Prefill time: delay between getting a slot and the first generated token."""
    itl: float = 0.0
    """Inter-token latency: delay before each generated token."""
    default_max_tokens: int = 16
    """Generated tokens when the request does not set ``max_tokens``."""
    block_size: int = 16
    """KV-cache block size in tokens (``cache_config_info`` label)."""
    num_gpu_blocks: int = 2048
    """Number of KV-cache blocks (``cache_config_info`` label)."""
    max_request_bytes: int = 64 * 1024 * 1024
    """Largest accepted request body; larger bodies get HTTP 413."""
    shutdown_timeout: float = 0.25
    """Grace period for in-flight requests when an instance stops."""

    def __post_init__(self) -> None:
        if not self.served_model_names or not all(self.served_model_names):
            raise ValueError("served_model_names must hold at least one non-empty name")
        if not all(self.lora_adapters):
            raise ValueError("lora_adapters must not contain empty names")
        positive = {
            "max_loras": self.max_loras,
            "max_num_seqs": self.max_num_seqs,
            "default_max_tokens": self.default_max_tokens,
            "block_size": self.block_size,
            "num_gpu_blocks": self.num_gpu_blocks,
            "max_request_bytes": self.max_request_bytes,
        }
        for field_name, value in positive.items():
            if value < 1:
                raise ValueError(f"{field_name} must be >= 1, got {value}")
        non_negative = {
            "ttft": self.ttft,
            "itl": self.itl,
            "shutdown_timeout": self.shutdown_timeout,
        }
        for field_name, seconds in non_negative.items():
            if seconds < 0:
                raise ValueError(f"{field_name} must be >= 0, got {seconds}")

    @property
    def model_name(self) -> str:
        """The primary served model name (used as the ``model_name`` metric label)."""
        return self.served_model_names[0]

    @property
    def kv_cache_capacity_tokens(self) -> int:
        """Total KV-cache capacity in tokens."""
        return self.block_size * self.num_gpu_blocks
