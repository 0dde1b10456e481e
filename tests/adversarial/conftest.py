"""``each_transport``: a test that serves through ``extproc_channel`` runs once per ext_proc
transport (``--extproc-transport``), so both servers keep every behaviour it checks."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from adapters.envoy.server import TRANSPORTS
from tests.adversarial import extproc_support


@pytest.fixture(params=TRANSPORTS)
def each_transport(request: pytest.FixtureRequest) -> Iterator[str]:
    transport = str(request.param)
    extproc_support.TRANSPORT[0] = transport
    try:
        yield transport
    finally:
        extproc_support.TRANSPORT[0] = extproc_support.DEFAULT_TRANSPORT
