"""What the reference's and the llm-d router's Helm charts run: the EPP container's arguments
and the EndpointPickerConfig files they mount, rendered by hand from the charts' templates
(no Helm here), for the release ``vllm-qwen`` in namespace ``default``.

- the reference: ``config/charts/inferencepool`` with ``config/charts/epplib/templates/
  _deployment.yaml`` and ``_config.yaml`` of kubernetes-sigs/gateway-api-inference-extension at
  ``1748e829`` (2026-06-16, the last commit before the charts left that repository);
- the llm-d router: ``config/charts/llm-d-router-gateway`` with ``config/charts/routerlib/
  templates/_deployment.yaml`` and ``_config.yaml`` of llm-d/llm-d-router at ``ebab6879``
  (2026-08-22).

The charts mount the config at ``/config``; ``config_path`` names the file in a test's own
directory instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "GIE_DEFAULT_PLUGINS",
    "LLMD_DEFAULT_PLUGINS",
    "LLMD_LATENCY_PREDICTOR_PLUGINS",
    "LLMD_PAYLOAD_AGNOSTIC",
    "RELEASE",
    "ChartPod",
    "gie_args",
    "llmd_args",
]

RELEASE = "vllm-qwen"
NAMESPACE = "default"

_POOL = ["--pool-name", RELEASE, "--pool-namespace", NAMESPACE, "--pool-group"]
_POOL.append("inference.networking.k8s.io")


def gie_args(
    *,
    replicas: int = 1,
    tracing: bool = False,
    engine: str = "vllm",
    plugins_file: str = "default-plugins.yaml",
    metrics_auth: bool = True,
) -> list[str]:
    """The reference chart's ``args`` for ``inferenceExtension.replicas``,
    ``.tracing.enabled``, ``inferencePool.modelServerType`` (``engine``) and
    ``.monitoring.prometheus.auth.enabled``."""
    args = list(_POOL)
    # the legacy metric flags the chart passes per model server type, as rendered (the
    # quotes inside the values are the chart's own)
    if engine == "sglang":
        args += [
            '--total-queued-requests-metric="sglang:num_queue_reqs"',
            '--total-running-requests-metric="sglang:num_running_reqs"',
            '--kv-cache-usage-percentage-metric="sglang:token_usage"',
            '--cache-info-metric="sglang:cache_config_info"',
        ]
    elif engine == "triton-tensorrt-llm":
        args += [
            "--total-queued-requests-metric",
            "nv_trt_llm_request_metrics{request_type=waiting}",
            "--total-running-requests-metric",
            "nv_trt_llm_request_metrics{request_type=scheduled}",
            "--kv-cache-usage-percentage-metric",
            "nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=fraction}",
            "--lora-info-metric",
            "",
        ]
    elif engine == "trtllm-serve":
        args += [
            '--total-queued-requests-metric="trtllm_num_requests_waiting"',
            '--total-running-requests-metric="trtllm_num_requests_running"',
            '--kv-cache-usage-percentage-metric="trtllm_kv_cache_utilization"',
            '--cache-info-metric="trtllm_cache_config_info"',
            '--model-server-metrics-path="/prometheus/metrics"',
            "--lora-info-metric",
            "",
        ]
    args += ["--zap-encoder", "json", "--config-file", f"/config/{plugins_file}"]
    if replicas > 1:
        args.append("--ha-enable-leader-election")
    args.append(f"--tracing={str(tracing).lower()}")
    if not metrics_auth:
        args.append("--metrics-endpoint-auth=false")
    return args


def llmd_args(
    *,
    replicas: int = 1,
    tracing: bool = False,
    plugins_file: str = "default-plugins.yaml",
    flags: Sequence[tuple[str, str]] = (),
    metrics_auth: bool = True,
) -> list[str]:
    """The llm-d router chart's ``args`` for ``router.epp.replicas``, ``router.tracing.
    enabled``, ``router.epp.pluginsConfigFile``, ``router.epp.flags`` (rendered sorted, as
    ``--key=value``, as Helm ranges over a map) and ``router.monitoring.prometheus.auth``."""
    args = [*_POOL, "--zap-encoder", "json", "--config-file", f"/config/{plugins_file}"]
    if replicas > 1:
        args.append("--ha-enable-leader-election")
    args += ["--grpc-health-port", "9003"]
    args += [f"--{key}={value}" for key, value in sorted(flags)]
    args.append(f"--tracing={str(tracing).lower()}")
    if not metrics_auth:
        args.append("--metrics-endpoint-auth=false")
    return args


#: The env the charts give the EPP container with tracing on (the node name left out).
def tracing_env(service: str, endpoint: str = "http://localhost:4317") -> dict[str, str]:
    return {
        "OTEL_SERVICE_NAME": service,
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_RESOURCE_ATTRIBUTES": f"k8s.namespace.name={NAMESPACE},k8s.pod.name=epp-0",
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": "0.1",
    }


#: The charts' EndpointPickerConfig files, rendered by hand (the files say from what).
FIXTURES = Path(__file__).resolve().parents[1] / "unit" / "config" / "fixtures"
#: The reference chart's ``default-plugins.yaml`` for vLLM over HTTP.
GIE_DEFAULT_PLUGINS = (FIXTURES / "gie-chart" / "default-plugins.yaml").read_text()
#: The llm-d router chart's ``default-plugins.yaml`` for vLLM over HTTP.
LLMD_DEFAULT_PLUGINS = (FIXTURES / "llm-d-router-chart" / "default-plugins.yaml").read_text()
#: The llm-d router chart's ``default-plugins.yaml`` with ``router.latencyPredictor.enabled``.
LLMD_LATENCY_PREDICTOR_PLUGINS = (
    FIXTURES / "llm-d-router-chart" / "default-plugins-latency-predictor.yaml"
).read_text()
#: The llm-d router chart's ``payload-agnostic.yaml``.
LLMD_PAYLOAD_AGNOSTIC = (FIXTURES / "llm-d-router-chart" / "payload-agnostic.yaml").read_text()


@dataclass
class ChartPod:
    """One EPP container as a chart runs it: ``args`` with ``/config/`` pointing at
    ``config_dir``, where ``configs`` (file name → text) are written."""

    args: list[str]
    configs: dict[str, str]
    config_dir: Path
    env: dict[str, str] = field(default_factory=dict)

    def command_args(self) -> list[str]:
        self.config_dir.mkdir(parents=True, exist_ok=True)
        for name, text in self.configs.items():
            (self.config_dir / name).write_text(text)
        return [a.replace("/config/", f"{self.config_dir}/") for a in self.args]
