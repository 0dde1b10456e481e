"""The EPP's image, built from the Containerfile and run from its own entrypoint and
filesystem as its non-root user: it becomes SERVING, routes a request through Envoy and, with
the shipped defaults, prints no span.

How the image is built and run without a registry: ``tests.support.image``. The figures
(size, seconds per step, the smoke run's times) are printed: ``make image-test`` shows them.
"""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2

from tests.simulator.config import DEFAULT_MODEL
from tests.simulator.server import INSTANCE_HEADER
from tests.support.image import BuiltImage, build_image, image_tools_missing, run_entrypoint
from tests.support.stack import Stack, StackOptions, free_port, health_status, wait_for

pytestmark = pytest.mark.e2e

SERVING = health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="module")
def image() -> BuiltImage:
    missing = image_tools_missing()
    assert not missing, f"missing {', '.join(missing)}: run make install (as root)"
    built = build_image()
    seconds = ", ".join(f"{step} {value:.0f}" for step, value in built.seconds.items())
    print(f"\nimage {built.name}: {built.size_bytes / 1e6:.0f} MB; seconds: {seconds}")
    return built


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
        started = time.monotonic()
        # every request sampled: the shipped defaults still print no span
        with run_entrypoint(image, args, log, ["OTEL_TRACES_SAMPLER=always_on"]) as epp:

            def serving() -> bool:
                assert epp.poll() is None, log.read_text()[-3000:]
                return bool(health_status(health_port) == SERVING)

            wait_for(serving, timeout=60, what="the EPP from the image to be SERVING")
            serving_after = time.monotonic() - started
            uids = next(
                line.split()[1:]
                for line in Path(f"/proc/{epp.pid}/status").read_text().splitlines()
                if line.startswith("Uid:")
            )
            assert uids == ["65532"] * 4  # real, effective, saved, filesystem
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
            routed_after = time.monotonic() - started
        lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
        assert any(line["msg"].startswith("stopped") for line in lines), log.read_text()[-2000:]
        tracing = [line["msg"] for line in lines if line["msg"].startswith("tracing on")]
        assert tracing == ["tracing on: sampler AlwaysOnSampler, exporter none"], tracing
        assert not [line for line in lines if "span" in line], log.read_text()[-2000:]
        print(
            f"\nsmoke run: SERVING after {serving_after:.1f} s, a request routed after "
            f"{routed_after:.1f} s, stopped after {time.monotonic() - started:.1f} s"
        )
