"""The EPP run as the reference's and the llm-d router's Helm charts run it.

Each test starts the EPP with the exact argument list a chart renders (``tests.support.
charts``; only the ports are moved to free ones, after the chart's arguments, and ``/config``
to the test's directory), the chart's EndpointPickerConfig, and the chart's environment,
against a loopback Kubernetes API server holding the InferencePool and its pods, which are
simulated model servers. It checks what the chart's probes ask (gRPC health on the health
port, services ``inference-extension`` with one replica, ``liveness``/``readiness`` with
more) and that requests through a real Envoy are routed to the pool.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2

from tests.integration.observability.otlp_receiver import OtlpReceiver
from tests.simulator.config import DEFAULT_MODEL
from tests.simulator.server import INSTANCE_HEADER
from tests.support.charts import (
    GIE_DEFAULT_PLUGINS,
    LLMD_DEFAULT_PLUGINS,
    LLMD_LATENCY_PREDICTOR_PLUGINS,
    LLMD_PAYLOAD_AGNOSTIC,
    RELEASE,
    ChartPod,
    gie_args,
    llmd_args,
    tracing_env,
)
from tests.support.kube_api import (
    INFERENCE_POOLS_V1,
    PODS,
    KubeApiServer,
    inference_pool_v1,
    pod,
    write_kubeconfig,
)
from tests.support.stack import (
    Stack,
    StackOptions,
    free_port,
    health_status,
    metric_sum,
    wait_for,
)

pytestmark = pytest.mark.e2e

SERVING = health_pb2.HealthCheckResponse.SERVING
LABELS = {"app": "vllm-qwen"}
POD_IPS = ("127.0.0.121", "127.0.0.122", "127.0.0.123")
#: After the chart's arguments: free ports instead of the chart's fixed ones.
SAMPLED = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
PORTS = ["--grpc-port", "0", "--grpc-health-port", "0", "--metrics-port", "0"]


@contextmanager
def chart_stack(
    tmp_path: Path,
    args: Sequence[str],
    configs: Mapping[str, str],
    *,
    replicas: int = 1,
    env: Mapping[str, str] | None = None,
) -> Iterator[Stack]:
    port = free_port(POD_IPS[0])
    with KubeApiServer() as api:
        kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", api.url)
        api.create(INFERENCE_POOLS_V1, inference_pool_v1(RELEASE, selector=LABELS, ports=[port]))
        for index, ip in enumerate(POD_IPS):
            api.create(PODS, pod(f"vllm-{index}", ip=ip, labels=LABELS))
        epp_args = ChartPod(
            args=list(args), configs=dict(configs), config_dir=tmp_path / "config"
        ).command_args()
        options = StackOptions(
            simulators=len(POD_IPS),
            simulator_base_ip=POD_IPS[0],
            simulator_port=port,
            # the chart's arguments, in place of the stack's discovery flags
            epp_discovery=[*epp_args, *PORTS],
            # the chart's secure serving (its default): Envoy speaks TLS to the EPP
            epp_tls=True,
            epp_replicas=replicas,
            epp_env={"KUBECONFIG": str(kubeconfig), "NAMESPACE": "default", **(env or {})},
            wait_for_serving=False,
        )
        with Stack.run(options) as stack:
            yield stack


def served_by(stack: Stack, count: int, headers: Mapping[str, str] | None = None) -> Counter[str]:
    """Sends ``count`` chat completions through Envoy; the simulators that answered."""
    served: Counter[str] = Counter()
    for index in range(count):
        body = json.dumps(
            {
                "model": DEFAULT_MODEL,
                "messages": [{"role": "user", "content": f"question {index} " * 20}],
                "max_tokens": 4,
            }
        ).encode()
        request = urllib.request.Request(
            f"{stack.url}/v1/chat/completions",
            data=body,
            headers={"content-type": "application/json", **(headers or {})},
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            assert response.status == 200
            json.loads(response.read())
            served[response.headers[INSTANCE_HEADER]] += 1
    return served


def test_the_references_chart_with_its_default_values(tmp_path: Path) -> None:
    with chart_stack(tmp_path, gie_args(), {"default-plugins.yaml": GIE_DEFAULT_PLUGINS}) as stack:
        assert stack.epp is not None
        # the chart's probes: service "inference-extension" on the health port
        wait_for(
            lambda: health_status(stack.epp_health_port, "inference-extension") == SERVING,
            timeout=30,
            what="the readiness probe of the reference's chart",
        )
        served = served_by(stack, 12)
        assert sum(served.values()) == 12
        assert set(served) <= set(stack.simulator_urls)
        # JSON lines (--zap-encoder json), and the pool from the API server
        lines = [json.loads(line) for line in stack.epp.log().splitlines() if line.startswith("{")]
        assert any("InferencePool default/vllm-qwen: 3 pods" in line["msg"] for line in lines)


def test_the_llm_d_charts_default_values(tmp_path: Path) -> None:
    with chart_stack(
        tmp_path, llmd_args(), {"default-plugins.yaml": LLMD_DEFAULT_PLUGINS}
    ) as stack:
        wait_for(
            lambda: health_status(stack.epp_health_port, "inference-extension") == SERVING,
            timeout=30,
            what="the readiness probe of the llm-d router's chart",
        )
        assert sum(served_by(stack, 12).values()) == 12


def test_the_llm_d_chart_with_its_flags_exports_the_llm_d_metric_names(tmp_path: Path) -> None:
    args = llmd_args(flags=[("enable-grpc-stream-metrics", "true"), ("v", "2")], metrics_auth=False)
    with chart_stack(tmp_path, args, {"default-plugins.yaml": LLMD_DEFAULT_PLUGINS}) as stack:
        wait_for(
            lambda: health_status(stack.epp_health_port, "inference-extension") == SERVING,
            timeout=30,
            what="the readiness probe of the llm-d router's chart",
        )
        assert sum(served_by(stack, 12).values()) == 12

        def streams_ended() -> float:
            return metric_sum(stack.epp_metrics_url, "llm_d_epp_extproc_streams_total")

        # a stream ends when its response has (Envoy's last message can trail the reply)
        wait_for(lambda: streams_ended() == 12, timeout=10, what="12 ext_proc streams ended")
        with urllib.request.urlopen(stack.epp_metrics_url, timeout=10) as response:
            text = response.read().decode()
        assert 'llm_d_epp_extproc_streams_total{code="OK"} 12.0' in text
        assert metric_sum(stack.epp_metrics_url, "llm_d_epp_request_total") == 12
        assert metric_sum(stack.epp_metrics_url, "inference_objective_request_total") == 12
        assert 'fairness_id="default-flow"' in text


def test_the_llm_d_chart_with_3_replicas_tracing_and_the_payload_agnostic_config(
    tmp_path: Path,
) -> None:
    receiver = OtlpReceiver().start()
    try:
        args = llmd_args(replicas=3, tracing=True, plugins_file="payload-agnostic.yaml")
        env = {
            **tracing_env("llm-d-router/epp", receiver.endpoint),
            "OTEL_BSP_SCHEDULE_DELAY": "50",
        }
        configs = {
            "default-plugins.yaml": LLMD_DEFAULT_PLUGINS,
            "payload-agnostic.yaml": LLMD_PAYLOAD_AGNOSTIC,
        }
        with chart_stack(tmp_path, args, configs, replicas=3, env=env) as stack:
            health_ports = [ports[1] for ports in stack.replica_ports]
            # liveness: every replica; readiness: the one that holds the Lease
            wait_for(
                lambda: [health_status(p) for p in health_ports].count(SERVING) == 1,
                timeout=30,
                what="one replica (the leader) to be ready",
            )
            assert [health_status(p, "liveness") for p in health_ports] == [SERVING] * 3
            assert sum(served_by(stack, 12, {"traceparent": SAMPLED}).values()) == 12
            spans = receiver.wait_for(
                lambda spans: any(s.name == "gateway.request" for s in spans),
                timeout=15,
                what="the EPP's spans at the chart's OTLP endpoint",
            )
            assert {s.service_name for s in spans} == {"llm-d-router/epp"}
    finally:
        receiver.stop()


def test_the_llm_d_charts_latency_predictor_values(tmp_path: Path) -> None:
    # router.latencyPredictor.enabled: its default-plugins.yaml as the chart renders it
    configs = {"default-plugins.yaml": LLMD_LATENCY_PREDICTOR_PLUGINS}
    with chart_stack(tmp_path, llmd_args(metrics_auth=False), configs) as stack:
        wait_for(
            lambda: health_status(stack.epp_health_port, "inference-extension") == SERVING,
            timeout=30,
            what="the readiness probe of the llm-d router's chart",
        )
        assert sum(served_by(stack, 12, {"x-slo-ttft-ms": "2000"}).values()) == 12
        # every answer taught the predictor and left a receipt
        count = "inference_objective_request_ttft_seconds_count"
        wait_for(
            lambda: metric_sum(stack.epp_metrics_url, count) >= 12,
            timeout=10,
            what="the observed TTFT of every request",
        )
        errors = "inference_extension_latency_prediction_error_seconds_count"
        assert metric_sum(stack.epp_metrics_url, errors) >= 12
        # an absurd SLO is the client's error, naming the header
        request = urllib.request.Request(
            f"{stack.url}/v1/chat/completions",
            data=json.dumps(
                {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "hi"}]}
            ).encode(),
            headers={"content-type": "application/json", "x-slo-ttft-ms": "-1"},
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=30)
        assert refused.value.code == 400
        assert b"x-slo-ttft-ms: must be a number of milliseconds" in refused.value.read()
