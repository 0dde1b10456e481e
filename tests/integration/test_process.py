"""The ``epp`` process: start-up, readiness, SIGTERM draining, exit codes, log format."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support.extproc import (
    envoy_headers,
    request_body,
    request_headers,
    response_body,
    response_headers,
    set_headers,
)
from tests.support.redis import RedisServer, redis_available
from tests.support.stack import ChildProcess, free_port, wait_for

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Epp:
    def __init__(self, tmp_path: Path, *extra: str) -> None:
        self.grpc_port = free_port()
        self.health_port = free_port()
        self.child = ChildProcess(
            "epp",
            [
                sys.executable,
                "-m",
                "app",
                "--static-endpoints",
                "127.0.0.41:8000,127.0.0.42:8000",
                "--metrics-endpoint-auth=false",
                "--bind-address",
                "127.0.0.1",
                "--grpc-port",
                str(self.grpc_port),
                "--grpc-health-port",
                str(self.health_port),
                "--metrics-port",
                "0",
                "--secure-serving=false",
                *extra,
            ],
            tmp_path / "epp.log",
        )

    def serving(self) -> bool:
        self.child.check_alive()
        return bool(self.readiness() == SERVING)

    def readiness(self) -> Any:
        with grpc.insecure_channel(f"127.0.0.1:{self.health_port}") as channel:
            try:
                return (
                    health_pb2_grpc.HealthStub(channel)
                    .Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=1)
                    .status
                )
            except grpc.RpcError:
                return None


@pytest.fixture
def epp(tmp_path: Path) -> Iterator[Epp]:
    process = Epp(tmp_path, "--shutdown-grace-period", "30s", "--log-format", "json")
    process.child.start()
    try:
        wait_for(
            process.serving,
            timeout=30,
            what="the EPP to be SERVING",
        )
        yield process
    finally:
        process.child.stop()


async def test_sigterm_drains_in_flight_streams_then_exits_0(epp: Epp) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{epp.grpc_port}") as channel:
        stub = pb_grpc.ExternalProcessorStub(channel)
        call = stub.Process()
        await call.write(request_headers(envoy_headers()))
        await call.write(request_body(b'{"model": "m", "prompt": "in flight"}', end_of_stream=True))
        header_reply = await call.read()
        chosen = dict(set_headers(header_reply.request_headers.response))
        assert chosen["x-gateway-destination-endpoint"] in {"127.0.0.41:8000", "127.0.0.42:8000"}
        await call.read()  # the body

        epp.child.signal(signal.SIGTERM)
        await asyncio.to_thread(
            wait_for, lambda: epp.readiness() == NOT_SERVING, timeout=10, what="NOT_SERVING"
        )

        # New streams are refused while draining.
        refused = stub.Process()
        with pytest.raises(grpc.aio.AioRpcError) as refusal:
            await refused.write(request_headers(envoy_headers(), end_of_stream=True))
        assert refusal.value.code() == grpc.StatusCode.UNAVAILABLE

        # The in-flight stream still completes its response path.
        await call.write(
            response_headers([(":status", "200"), ("content-type", "application/json")])
        )
        reply = await call.read()
        assert (
            dict(set_headers(reply.response_headers.response))["x-went-into-resp-headers"] == "true"
        )
        await call.write(response_body(b'{"model": "m", "choices": []}', end_of_stream=True))
        body_reply = await call.read()
        streamed = body_reply.response_body.response.body_mutation.streamed_response
        assert streamed.end_of_stream
        await call.done_writing()
        assert await call.code() == grpc.StatusCode.OK, await call.details()

    assert await asyncio.to_thread(epp.child.wait, 20) == 0
    lines = [json.loads(line) for line in epp.child.log().splitlines() if line.startswith("{")]
    assert lines, epp.child.log()
    assert {"ts", "level", "logger", "msg"} <= set(lines[0])
    assert any(line["msg"] == "stopped" for line in lines)


async def test_with_a_drain_timeout_new_streams_are_served_after_sigterm(tmp_path: Path) -> None:
    """``--drain-timeout``: after SIGTERM health is NOT_SERVING at once, yet a gateway that
    still sends here has its new streams routed for that long; then the process drains."""
    epp = Epp(tmp_path, "--drain-timeout", "5s", "--shutdown-grace-period", "5s")
    epp.child.start()
    try:
        await asyncio.to_thread(wait_for, epp.serving, timeout=30, what="SERVING")
        signalled = time.monotonic()
        epp.child.signal(signal.SIGTERM)
        await asyncio.to_thread(
            wait_for, lambda: epp.readiness() == NOT_SERVING, timeout=10, what="NOT_SERVING"
        )
        async with grpc.aio.insecure_channel(f"127.0.0.1:{epp.grpc_port}") as channel:
            call = pb_grpc.ExternalProcessorStub(channel).Process()
            await call.write(request_headers(envoy_headers()))
            await call.write(request_body(b'{"model": "m", "prompt": "late"}', end_of_stream=True))
            header_reply = await call.read()
            chosen = dict(set_headers(header_reply.request_headers.response))
            assert chosen["x-gateway-destination-endpoint"] in {
                "127.0.0.41:8000",
                "127.0.0.42:8000",
            }
            assert time.monotonic() - signalled < 5
            call.cancel()
        assert await asyncio.to_thread(epp.child.wait, 20) == 0
        assert time.monotonic() - signalled >= 5  # it served the whole window
    finally:
        epp.child.stop()


def test_sigterm_when_idle_exits_0_quickly(tmp_path: Path) -> None:
    process = Epp(tmp_path)
    process.child.start()
    try:
        wait_for(
            process.serving,
            timeout=30,
            what="SERVING",
        )
        started = time.monotonic()
        process.child.signal(signal.SIGTERM)
        assert process.child.wait(20) == 0
        assert time.monotonic() - started < 10
    finally:
        process.child.stop()


def test_a_port_in_use_stops_start_up_naming_the_flag(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        process = Epp(tmp_path)
        process.child.argv = [
            *process.child.argv,
            "--grpc-health-port",
            str(port),
        ]
        process.child.start()
        try:
            assert process.child.wait(30) == 1
        finally:
            process.child.stop()
    assert "--grpc-health-port" in process.child.log()


def test_an_unreadable_otlp_certificate_stops_start_up_naming_the_variable(
    tmp_path: Path,
) -> None:
    process = Epp(tmp_path)
    process.child.env = {
        **os.environ,
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": "https://127.0.0.1:4317",
        "OTEL_EXPORTER_OTLP_CERTIFICATE": str(tmp_path / "missing-ca.pem"),
    }
    process.child.start()
    try:
        assert process.child.wait(30) == 1
    finally:
        process.child.stop()
    assert "OTEL_EXPORTER_OTLP_CERTIFICATE" in process.child.log()


async def test_sigterm_with_the_trace_collector_down_still_exits_promptly(
    tmp_path: Path,
) -> None:
    process = Epp(tmp_path)
    process.child.env = {
        **os.environ,
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{free_port()}",  # nobody there
        "OTEL_TRACES_SAMPLER_ARG": "1",
    }
    process.child.start()
    try:
        await asyncio.to_thread(wait_for, process.serving, timeout=30, what="SERVING")
        async with grpc.aio.insecure_channel(f"127.0.0.1:{process.grpc_port}") as channel:
            call = pb_grpc.ExternalProcessorStub(channel).Process()
            await call.write(request_headers(envoy_headers()))
            body = b'{"model": "m", "prompt": "traced"}'
            await call.write(request_body(body, end_of_stream=True))
            await call.read()  # routed: its spans are queued for the collector that is down
            await call.done_writing()
        started = time.monotonic()
        process.child.signal(signal.SIGTERM)
        assert await asyncio.to_thread(process.child.wait, 30) == 0
        # the span flush gives up after 5 s instead of the exporter's 10 s timeout per try
        assert time.monotonic() - started < 15
    finally:
        process.child.stop()
    log = process.child.log()
    assert "spans not all exported within 5s of shutdown" in log
    assert "Traceback" not in log


def test_a_bad_redis_url_exits_2_naming_the_flag_without_the_password(tmp_path: Path) -> None:
    process = Epp(tmp_path, "--redis-url", "memcached://epp:hunter2@127.0.0.1:6379")
    process.child.start()
    try:
        assert process.child.wait(30) == 2
    finally:
        process.child.stop()
    log = process.child.log()
    assert "--redis-url" in log
    assert "unknown scheme" in log
    assert "hunter2" not in log


async def test_with_redis_down_the_epp_still_becomes_ready_and_routes(tmp_path: Path) -> None:
    closed = free_port()  # nothing listens there
    process = Epp(tmp_path, "--redis-url", f"redis://epp:hunter2@127.0.0.1:{closed}")
    process.child.start()
    try:
        await asyncio.to_thread(wait_for, process.serving, timeout=30, what="SERVING")
        async with grpc.aio.insecure_channel(f"127.0.0.1:{process.grpc_port}") as channel:
            for prompt in ("first", "second"):
                call = pb_grpc.ExternalProcessorStub(channel).Process()
                await call.write(request_headers(envoy_headers()))
                text = "a long shared system prompt " * 200 + prompt  # several blocks
                body = f'{{"model": "m", "prompt": "{text}"}}'.encode()
                await call.write(request_body(body, end_of_stream=True))
                reply = await call.read()
                await call.done_writing()
                chosen = dict(set_headers(reply.request_headers.response))
                destination = chosen["x-gateway-destination-endpoint"]
                assert destination in {"127.0.0.41:8000", "127.0.0.42:8000"}
        process.child.signal(signal.SIGTERM)
        assert await asyncio.to_thread(process.child.wait, 30) == 0
    finally:
        process.child.stop()
    log = process.child.log()
    assert "Traceback" not in log
    assert "hunter2" not in log
    # Degraded once (one line per shared part), not once per request or per retry.
    assert log.count("shared load: redis failed, using local state") == 1, log
    assert log.count("shared prefix index degraded") == 1, log


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    if not redis_available():
        pytest.fail("redis-server and redis-cli are not on PATH: run `make install`")
    server = RedisServer()
    server.start()
    yield server
    server.close()


async def test_redis_coming_up_later_heals_the_shared_state(tmp_path: Path) -> None:
    if not redis_available():
        pytest.fail("redis-server and redis-cli are not on PATH: run `make install`")
    server = RedisServer(port=free_port())  # not started yet: the port is closed
    # The default 5 ms routing budget: the recovery probe has its own timeout (its first
    # call after the outage also connects), so even a loaded machine heals.
    process = Epp(tmp_path, "--redis-url", server.url)
    process.child.start()
    try:
        await asyncio.to_thread(wait_for, process.serving, timeout=30, what="SERVING")
        async with grpc.aio.insecure_channel(f"127.0.0.1:{process.grpc_port}") as channel:
            call = pb_grpc.ExternalProcessorStub(channel).Process()
            await call.write(request_headers(envoy_headers()))
            text = "a long shared system prompt " * 200
            await call.write(
                request_body(f'{{"model": "m", "prompt": "{text}"}}'.encode(), end_of_stream=True)
            )
            await call.read()  # routed on local state; the index is degraded
            await call.done_writing()
        await asyncio.to_thread(
            wait_for,
            lambda: "shared prefix index degraded" in process.child.log(),
            timeout=10,
            what="the index to degrade",
        )
        server.start()
        log_lines = (
            "shared prefix index healthy again",
            "shared load: redis answers again",
        )
        await asyncio.to_thread(
            wait_for,
            lambda: all(line in process.child.log() for line in log_lines),
            timeout=30,
            what="the shared state to heal",
        )
        # The add made while degraded was re-sent: the prompt's blocks are in redis.
        await asyncio.to_thread(
            wait_for,
            lambda: server.cli("--raw", "KEYS", "epp:static:c:*").strip(),
            timeout=10,
            what="the re-sent prefix blocks",
        )
    finally:
        process.child.stop()
        server.close()


#: Only the in-flight load decides: the one scorer reads it, its producer is created with it.
LOAD_ONLY = """
plugins:
- type: token-load-scorer
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: token-load-scorer
"""


async def test_one_replicas_in_flight_load_steers_another(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    prefix = "epp:load-test"
    shared = ["--redis-url", redis_server.url, "--redis-key-prefix", prefix]
    first = Epp(tmp_path / "a", *shared, "--config-text", LOAD_ONLY)
    second = Epp(tmp_path / "b", *shared, "--config-text", LOAD_ONLY)
    for process in (first, second):
        process.child.log_path.parent.mkdir()
        process.child.start()
    body = b'{"model": "m", "prompt": "' + b"load " * 200 + b'"}'
    try:
        for process in (first, second):
            await asyncio.to_thread(wait_for, process.serving, timeout=30, what="SERVING")
        async with (
            grpc.aio.insecure_channel(f"127.0.0.1:{first.grpc_port}") as first_channel,
            grpc.aio.insecure_channel(f"127.0.0.1:{second.grpc_port}") as second_channel,
        ):
            # A request held in flight on the first replica: its load is booked there.
            held = pb_grpc.ExternalProcessorStub(first_channel).Process()
            await held.write(request_headers(envoy_headers()))
            await held.write(request_body(body, end_of_stream=True))
            reply = await held.read()
            busy = dict(set_headers(reply.request_headers.response))[
                "x-gateway-destination-endpoint"
            ]
            idle = ({"127.0.0.41:8000", "127.0.0.42:8000"} - {busy}).pop()
            # ... and published (the first replica's hash holds it).
            own_keys = f"{prefix}:load:{{{prefix}}}:p:*"
            await asyncio.to_thread(
                wait_for,
                lambda: redis_server.cli("--raw", "KEYS", own_keys).strip(),
                timeout=10,
                what="the first replica's load in redis",
            )

            async def route_on_second() -> str:
                call = pb_grpc.ExternalProcessorStub(second_channel).Process()
                await call.write(request_headers(envoy_headers()))
                await call.write(request_body(body, end_of_stream=True))
                answer = await call.read()
                await call.read()  # the body
                await call.done_writing()
                assert await call.code() == grpc.StatusCode.OK  # own booking released
                return dict(set_headers(answer.request_headers.response))[
                    "x-gateway-destination-endpoint"
                ]

            # The second replica reads the others' load every 20 ms: once it goes to the
            # idle endpoint, it keeps going there (without the shared load, each of these
            # would be a coin toss: both endpoints look idle to it).
            deadline = time.monotonic() + 10
            while await route_on_second() != idle:
                assert time.monotonic() < deadline, "the second replica never saw the load"
            chosen = [await route_on_second() for _ in range(6)]
            if chosen != [idle] * 6:
                notes = [
                    line
                    for process in (first, second)
                    for line in process.child.log().splitlines()
                    if "redis" in line or "shared" in line
                ]
                pytest.fail(f"went to {chosen}, idle is {idle}; shared-state log: {notes[-8:]}")
            await held.done_writing()
    finally:
        first.child.stop()
        second.child.stop()
