"""Suite-wide collection order: the slowest test files first."""

from __future__ import annotations

import pytest

#: The slowest test files, slowest first (the image test builds the image from nothing on a
#: fresh machine; the others start Envoys, EPP processes, Redis and the loopback API server):
#: collected first, so that under `make test` the workers start on them and the short files
#: fill in at the end, instead of one worker starting a long file when the others are done.
#: Measured with `pytest -n auto --dist loadfile --durations=0` (2026-11-29).
_SLOWEST = (
    "tests/image/",
    "tests/integration/test_workers_process.py",
    "tests/e2e/test_shared_state_faults_e2e.py",
    "tests/integration/test_process.py",
    "tests/e2e/test_helm_charts.py",
    "tests/e2e/test_model_server_faults.py",
    "tests/e2e/test_precise_prefix_shared_e2e.py",
    "tests/e2e/test_shared_state_e2e.py",
    "tests/e2e/test_workers_e2e.py",
    "tests/integration/test_static_objectives.py",
    "tests/integration/test_config_file_limits.py",
)


def _rank(item: pytest.Item) -> int:
    for rank, prefix in enumerate(_SLOWEST):
        if item.nodeid.startswith(prefix):
            return rank
    return len(_SLOWEST)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=_rank)
