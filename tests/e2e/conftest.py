"""Fixtures shared by the end-to-end tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.redis import RedisServer, redis_available


@pytest.fixture(scope="module")
def redis() -> Iterator[RedisServer]:
    """One redis-server per test module (installed by `make install`)."""
    if not redis_available():
        pytest.fail("redis-server and redis-cli are not on PATH: run `make install`")
    server = RedisServer()
    server.start()
    yield server
    server.close()
