"""The EPP's image, built from the Containerfile and run from its own entrypoint and
filesystem as its non-root user: it becomes SERVING and routes a request through Envoy.

How the image is built and run without a registry: ``tests.support.image``. The build's
figures (size, seconds per step) are printed (``pytest -s`` shows them).
"""

from __future__ import annotations

import json
import os
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2

from tests.simulator.config import DEFAULT_MODEL
from tests.simulator.server import INSTANCE_HEADER
from tests.support.image import (
    BuiltImage,
    build_image,
    image_tools_missing,
    remove_image,
    run_entrypoint,
)
from tests.support.stack import Stack, StackOptions, free_port, health_status, wait_for

pytestmark = pytest.mark.e2e

SERVING = health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="module")
def image() -> Iterator[BuiltImage]:
    missing = image_tools_missing()
    assert not missing, f"missing {', '.join(missing)}: run make install (as root)"
    built = build_image(f"test-{os.getpid()}")
    print(f"\nimage {built.name}: {built.size_bytes / 1e6:.0f} MB, seconds {built.seconds}")
    try:
        yield built
    finally:
        remove_image(built)


def test_the_image_runs_as_65532_from_its_own_entrypoint(image: BuiltImage) -> None:
    config = image.config()
    assert config["User"] == "65532:65532"
    assert config["Entrypoint"] == ["/opt/epp/bin/epp"]


def test_the_image_serves_and_routes_a_request(image: BuiltImage, tmp_path: Path) -> None:
    # a simulated model server and an Envoy on the host; the EPP from the image
    with Stack.run(StackOptions(simulators=1, epp=False, envoy=False)) as stack:
        grpc_port, health_port, metrics_port = free_port(), free_port(), free_port()
        args = [
            "--static-endpoints",
            ",".join(stack.simulator_addresses.values()),
            "--metrics-endpoint-auth=false",
            "--secure-serving=false",
            "--bind-address",
            "127.0.0.1",
            "--grpc-port",
            str(grpc_port),
            "--grpc-health-port",
            str(health_port),
            "--metrics-port",
            str(metrics_port),
            "--zap-encoder",
            "json",
        ]
        log = tmp_path / "epp.log"
        with run_entrypoint(image, args, log) as epp:

            def serving() -> bool:
                assert epp.poll() is None, log.read_text()[-3000:]
                return bool(health_status(health_port) == SERVING)

            wait_for(serving, timeout=60, what="the EPP from the image to be SERVING")
            stack.replica_ports = [(grpc_port, health_port, metrics_port)]
            stack.epp_port = grpc_port
            stack.options = StackOptions(simulators=1, epp_tls=False)
            stack.envoy, stack.envoy_port = stack.start_envoy(ext_proc=True, name="envoy")
            body = json.dumps(
                {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "hi"}]}
            ).encode()
            request = urllib.request.Request(
                f"{stack.url}/v1/chat/completions",
                data=body,
                headers={"content-type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=30) as response:
                assert response.status == 200
                assert response.headers[INSTANCE_HEADER] in stack.simulator_urls
                json.loads(response.read())
            with urllib.request.urlopen(
                f"http://127.0.0.1:{metrics_port}/metrics", timeout=10
            ) as metrics:
                assert b"inference_objective_request_total" in metrics.read()
        lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
        assert any(line["msg"].startswith("stopped") for line in lines), log.read_text()[-2000:]
