"""vLLM-compatible model-server simulator for end-to-end tests, the demo and benchmarks.

Each instance models one vLLM engine: a FIFO queue in front of ``max_num_seqs`` running
slots, LoRA adapters limited by ``max_loras``, a paged KV cache with prefix caching and
LRU eviction, and prefill/decode times that depend on cache hits and batch load
(:class:`SimulatorConfig`). ``/metrics`` exports the state under vLLM's metric names;
``GET /sim/stats`` returns the same as JSON for scripts.

Run ``python -m tests.simulator --help`` for the command-line mode.
"""

from tests.simulator.config import DEFAULT_MODEL, SimulatorConfig
from tests.simulator.fleet import SimulatorFleet
from tests.simulator.server import (
    BODY_SHA256_HEADER,
    DESTINATION_SEEN_HEADER,
    INSTANCE_HEADER,
    PREFILLER_SEEN_HEADER,
    RECEIVED_BYTES_HEADER,
    REQUEST_ID_HEADER,
    ModelServerSimulator,
)
from tests.simulator.stats import EngineStats

__all__ = [
    "BODY_SHA256_HEADER",
    "DEFAULT_MODEL",
    "DESTINATION_SEEN_HEADER",
    "INSTANCE_HEADER",
    "PREFILLER_SEEN_HEADER",
    "RECEIVED_BYTES_HEADER",
    "REQUEST_ID_HEADER",
    "EngineStats",
    "ModelServerSimulator",
    "SimulatorConfig",
    "SimulatorFleet",
]
