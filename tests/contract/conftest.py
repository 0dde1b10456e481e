"""Fixtures for the contract suites: real Redis servers (one, a 3-master cluster, TLS) started
once per session, a fresh key prefix per test (so tests never see each other's keys and no
flush is needed), and clients bound to the test's event loop."""

from __future__ import annotations

import socket
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from adapters.redis import RedisClient, connect
from tests.contract.processes import Processes
from tests.support.redis import RedisCluster, RedisServer, TlsFiles, make_tls_files, redis_available

__all__: list[str] = []

#: The client's socket timeout in the contract suites: they check what the store answers,
#: not how fast (the shipped 0.1 s is for the routing path, which has its own deadline), and
#: a loaded CI machine can stall a reply past 0.1 s.
CONTRACT_TIMEOUT = 5.0

#: The backends every contract test runs on.
BACKENDS = ["memory", "redis", "redis-cluster"]


def _require_redis() -> None:
    if not redis_available():
        pytest.fail(
            "redis-server and redis-cli are not on PATH: run `make install` (it installs "
            "Debian's redis-server and redis-tools) or install them yourself"
        )


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    _require_redis()
    server = RedisServer()
    server.start()
    server.add_acl_user()
    yield server
    server.close()


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisCluster]:
    _require_redis()
    cluster = RedisCluster()
    cluster.start()
    yield cluster
    cluster.close()


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return make_tls_files(Path(tmp_path_factory.mktemp("redis-tls")))


@pytest.fixture(scope="session")
def tls_redis_server(tls_files: TlsFiles) -> Iterator[RedisServer]:
    _require_redis()
    server = RedisServer(tls=tls_files)
    server.start()
    yield server
    server.close()


@pytest.fixture
def redis_scratch_server() -> Iterator[RedisServer]:
    """A server of the test's own, for tests that kill, restart or flush it."""
    _require_redis()
    server = RedisServer()
    server.start()
    yield server
    server.close()


@pytest.fixture
async def redis_client(redis_server: RedisServer) -> AsyncIterator[RedisClient]:
    """The shipped client (``adapters.redis.connect``) on the session's redis-server, bound
    to this test's event loop and closed after it."""
    client = connect(redis_server.url)
    try:
        yield client
    finally:
        await client.aclose()


@pytest.fixture
def key_prefix() -> str:
    """A prefix no other test uses; the ACL user may touch ``epp:*`` only."""
    return f"epp:test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts connections (the kernel's backlog) and never answers."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield int(listener.getsockname()[1])


def backend_client(request: pytest.FixtureRequest) -> RedisClient | None:
    """A client of the backend a ``BACKENDS`` fixture is at (``None``: in memory)."""
    server = {"redis": "redis_server", "redis-cluster": "redis_cluster"}.get(request.param)
    if server is None:
        return None
    return connect(request.getfixturevalue(server).url, socket_timeout=CONTRACT_TIMEOUT)


@pytest.fixture(params=BACKENDS)
async def pool(request: pytest.FixtureRequest, key_prefix: str) -> AsyncIterator[Processes]:
    client = backend_client(request)
    made = Processes(client, key_prefix)
    yield made
    for load in made.started:
        await load.stop()
    if client is not None:
        await client.aclose()
