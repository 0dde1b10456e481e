"""vLLM-compatible model-server simulator for end-to-end tests, the demo and benchmarks.

Run ``python -m tests.simulator --help`` for the command-line mode.
"""

from tests.simulator.config import DEFAULT_MODEL, SimulatorConfig
from tests.simulator.fleet import SimulatorFleet
from tests.simulator.server import (
    BODY_SHA256_HEADER,
    DESTINATION_SEEN_HEADER,
    INSTANCE_HEADER,
    RECEIVED_BYTES_HEADER,
    REQUEST_ID_HEADER,
    ModelServerSimulator,
)

__all__ = [
    "BODY_SHA256_HEADER",
    "DEFAULT_MODEL",
    "DESTINATION_SEEN_HEADER",
    "INSTANCE_HEADER",
    "RECEIVED_BYTES_HEADER",
    "REQUEST_ID_HEADER",
    "ModelServerSimulator",
    "SimulatorConfig",
    "SimulatorFleet",
]
