"""The shared-state degraded gauge against a real ``redis-server`` that refuses every call.

Before: with the EPP's Redis user's permissions revoked (``ACL SETUSER ... -@all``: every
command answered ``NOPERM``), the shared load's sync failed on every round and said so in
its log, but ``inference_extension_shared_state_degraded`` stayed 0. Now every shared part
that falls back on local state raises the gauge, and it comes back to 0 when Redis answers.
"""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from tests.support.extproc import envoy_headers, request_body, request_headers
from tests.support.redis import ACL_PASSWORD, ACL_USER, RedisServer, redis_available
from tests.support.stack import free_port, wait_for

from .test_process import Epp

GAUGE = "inference_extension_shared_state_degraded"


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    if not redis_available():
        pytest.fail("redis-server and redis-cli are not on PATH: run `make install`")
    server = RedisServer()
    server.start()
    server.add_acl_user()
    yield server
    server.close()


def degraded(metrics_port: int) -> float | None:
    """The gauge's value on ``/metrics``, or None while it is not there."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=2) as r:
            text = r.read().decode()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(GAUGE + " "):
            return float(line.split()[1])
    return None


async def route(grpc_port: int) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        call = pb_grpc.ExternalProcessorStub(channel).Process()
        await call.write(request_headers(envoy_headers()))
        text = "a long shared system prompt " * 200
        body = f'{{"model": "m", "prompt": "{text}"}}'.encode()
        await call.write(request_body(body, end_of_stream=True))
        await call.read()
        await call.done_writing()


async def test_every_call_refused_by_acl_shows_degraded_and_heals(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    metrics_port = free_port()
    url = f"redis://{ACL_USER}:{ACL_PASSWORD}@{redis_server.address}"
    process = Epp(tmp_path, "--redis-url", url, "--metrics-port", str(metrics_port))
    process.child.start()
    try:
        await asyncio.to_thread(wait_for, process.serving, timeout=30, what="SERVING")
        await route(process.grpc_port)
        await asyncio.to_thread(
            wait_for, lambda: degraded(metrics_port) == 0.0, timeout=15, what="healthy"
        )
        # the user's permissions revoked: every command is answered NOPERM
        redis_server.cli("ACL", "SETUSER", ACL_USER, "-@all")
        await asyncio.to_thread(
            wait_for, lambda: degraded(metrics_port) == 1.0, timeout=15, what="degraded"
        )
        await route(process.grpc_port)  # requests still routed, on local state
        process.child.check_alive()
        redis_server.add_acl_user()  # permissions back
        await route(process.grpc_port)
        await asyncio.to_thread(
            wait_for, lambda: degraded(metrics_port) == 0.0, timeout=30, what="healthy again"
        )
    finally:
        process.child.stop()
    assert "Traceback" not in process.child.log()
