"""Configuration of one simulated model server."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

DEFAULT_MODEL = "meta-llama/Llama-3.1-8B-Instruct"

H100_8B_NUM_GPU_BLOCKS = 26_624
"""KV-cache blocks of Llama-3.1-8B (bf16) on one H100-80GB at ``gpu_memory_utilization=0.9``.

128 KiB of KV per token (32 layers * 8 KV heads * 128 dims * K and V * 2 bytes); about
52 GiB left for the cache after weights and activations: 425,984 tokens = 26,624 blocks.
"""


@dataclass(frozen=True, slots=True, kw_only=True)
class SimulatorConfig:
    """Behaviour of a simulated vLLM instance (shared by every instance of a fleet).

    Durations are *simulated* seconds; each real wait lasts ``duration * time_scale``. The
    defaults make every request complete immediately so that tests run fast; use
    :meth:`h100_8b` for realistic timings. With ``running`` the number of running requests
    (this one included) and ``load = 1 + load_alpha * (running - 1) / max_num_seqs``:

    - time to first token = queueing + (``prefill_overhead`` + uncached prompt tokens *
      ``prefill_per_token``) * load, with ``running`` taken when the request is admitted;
    - every later token takes ``itl`` * load, with ``running`` taken at that token.

    A request alone is not slowed down; a full batch is about ``1 + load_alpha`` times slower.
    """

    served_model_names: tuple[str, ...] = (DEFAULT_MODEL,)
    """Model names the server answers to; the first one labels the metrics."""
    lora_adapters: tuple[str, ...] = ()
    """LoRA adapter names: listed by ``/v1/models``; a request naming one runs on it."""
    max_loras: int = 1
    """Most distinct LoRA adapters among running requests (``max_lora`` label)."""
    max_num_seqs: int = 256
    """Maximum number of concurrently running requests; the rest wait in FIFO order."""
    prefill_overhead: float = 0.0
    """Fixed part of the prefill time, seconds."""
    prefill_per_token: float = 0.0
    """Prefill time per prompt token not served from the prefix cache, seconds."""
    itl: float = 0.0
    """Inter-token latency of an unloaded server: time per generated token after the first."""
    load_alpha: float = 0.0
    """Slow-down of prefill and decode at a full batch (see the class docstring)."""
    time_scale: float = 1.0
    """Real seconds per simulated second (0: no waiting at all; 0.01: 100 times faster)."""
    default_max_tokens: int = 16
    """Generated tokens when the request does not set ``max_tokens``."""
    block_size: int = 16
    """KV-cache block size in tokens."""
    num_gpu_blocks: int = H100_8B_NUM_GPU_BLOCKS
    """Number of KV-cache blocks."""
    max_model_len: int | None = None
    """Longest prompt + ``max_tokens`` accepted (HTTP 400 beyond); ``None``: the cache size."""
    enable_prompt_tokens_details: bool = False
    """Report ``usage.prompt_tokens_details.cached_tokens`` (vLLM's flag of that name)."""
    max_request_bytes: int = 64 * 1024 * 1024
    """Largest accepted request body; larger bodies get HTTP 413."""
    tokenizer_path: str | None = None
    """A ``tokenizer.json``: text prompts are tokenized with it and blocks are hashed as
    vLLM hashes them (``domain.prefixcache.engine_hash``), so the EPP can compute the same
    keys. ``None``: pseudo-tokens of four characters (see :mod:`tests.simulator.tokens`)."""
    prefix_caching_hash_algo: str = "sha256"
    """vLLM's ``--prefix-caching-hash-algo`` (with ``tokenizer_path``)."""
    hash_seed: str = "0"
    """vLLM's ``PYTHONHASHSEED``: seeds the block-hash chain (with ``tokenizer_path``)."""
    kv_events: bool = False
    """Publish KV-cache events on ZMQ, as vLLM's ``--kv-events-config`` does (see
    :mod:`tests.simulator.kvevents`): a PUB and a replay ROUTER socket."""
    kv_events_port: int = 0
    """Port of the PUB socket on the instance's address (0: a free one)."""
    kv_events_replay_port: int = 0
    """Port of the replay ROUTER socket (0: a free one)."""
    shutdown_timeout: float = 0.25
    """Grace period for in-flight requests when an instance stops (real seconds)."""

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
        if self.max_model_len is not None:
            positive["max_model_len"] = self.max_model_len
        for field_name, value in positive.items():
            if value < 1:
                raise ValueError(f"{field_name} must be >= 1, got {value}")
        non_negative = {
            "prefill_overhead": self.prefill_overhead,
            "prefill_per_token": self.prefill_per_token,
            "itl": self.itl,
            "load_alpha": self.load_alpha,
            "time_scale": self.time_scale,
            "shutdown_timeout": self.shutdown_timeout,
        }
        for field_name, number in non_negative.items():
            if not number >= 0:  # also rejects NaN
                raise ValueError(f"{field_name} must be >= 0, got {number}")
        if self.max_model_len is not None and self.max_model_len > self.kv_cache_capacity_tokens:
            raise ValueError(
                f"max_model_len ({self.max_model_len}) is larger than the KV cache"
                f" ({self.kv_cache_capacity_tokens} tokens)"
            )

    @classmethod
    def h100_8b(cls, *, time_scale: float = 1.0, **overrides: Any) -> SimulatorConfig:
        """An 8B model (Llama-3.1-8B) on one H100: realistic timings and cache size.

        About 30 ms prefill overhead plus 0.25 ms per uncached prompt token, 12 ms per
        output token, 1.5 times slower at a full batch of 256, 26,624 blocks of 16 tokens,
        a 128k-token context (less if an override shrinks the cache below it).
        ``overrides`` replace any other field.
        """
        fields: dict[str, Any] = {
            "prefill_overhead": 0.030,
            "prefill_per_token": 0.00025,
            "itl": 0.012,
            "load_alpha": 1.5,
            "max_num_seqs": 256,
            "block_size": 16,
            "num_gpu_blocks": H100_8B_NUM_GPU_BLOCKS,
            "time_scale": time_scale,
            **overrides,
        }
        if "max_model_len" not in overrides:
            fields["max_model_len"] = min(
                131_072, int(fields["block_size"]) * int(fields["num_gpu_blocks"])
            )
        return cls(**fields)

    def slowed(self, factor: float) -> SimulatorConfig:
        """This configuration ``factor`` times slower in prefill and decode (a server of an
        older GPU generation, or one sharing its GPU): the prefill overhead, the prefill
        time per token and the inter-token latency multiplied by ``factor`` (> 0)."""
        if not factor > 0 or factor == float("inf"):
            raise ValueError(f"slowdown must be a finite number > 0, got {factor}")
        return dataclasses.replace(
            self,
            prefill_overhead=self.prefill_overhead * factor,
            prefill_per_token=self.prefill_per_token * factor,
            itl=self.itl * factor,
        )

    @property
    def model_name(self) -> str:
        """The primary served model name (used as the ``model_name`` metric label)."""
        return self.served_model_names[0]

    @property
    def kv_cache_capacity_tokens(self) -> int:
        """Total KV-cache capacity in tokens."""
        return self.block_size * self.num_gpu_blocks

    @property
    def effective_max_model_len(self) -> int:
        """The longest accepted prompt + ``max_tokens``."""
        if self.max_model_len is not None:
            return self.max_model_len
        return self.kv_cache_capacity_tokens

    def load_factor(self, running: int) -> float:
        """Slow-down with ``running`` requests in the batch (the one timed included)."""
        return 1.0 + self.load_alpha * max(0, running - 1) / self.max_num_seqs
