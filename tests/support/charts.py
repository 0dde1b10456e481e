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


#: The reference chart's ``default-plugins.yaml`` for vLLM over HTTP.
GIE_DEFAULT_PLUGINS = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
- type: metrics-data-source
  parameters:
    scheme: "http"
    path: "/metrics"
    insecureSkipVerify: true
- type: core-metrics-extractor
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
    weight: 2
  - pluginRef: kv-cache-utilization-scorer
    weight: 2
  - pluginRef: prefix-cache-scorer
    weight: 3
"""

#: The llm-d router chart's ``default-plugins.yaml`` for vLLM over HTTP.
LLMD_DEFAULT_PLUGINS = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
- type: metrics-data-source
  parameters:
    scheme: "http"
    path: "/metrics"
    insecureSkipVerify: true
- type: core-metrics-extractor
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
    weight: 2
  - pluginRef: kv-cache-utilization-scorer
    weight: 2
  - pluginRef: prefix-cache-scorer
    weight: 3
"""

#: The llm-d router chart's ``default-plugins.yaml`` for vLLM over HTTP with
#: ``router.latencyPredictor.enabled: true``: ``config/charts/routerlib/templates/
#: _config.yaml`` of llm-d/llm-d-router at ``ebab6879`` rendered as Helm renders it, comments
#: included (that file's last change is 4931d26a, 2026-06-13).
LLMD_LATENCY_PREDICTOR_PLUGINS = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
- type: metrics-data-source
  parameters:
    scheme: "http"
    path: "/metrics"
    insecureSkipVerify: true
- type: core-metrics-extractor
- type: predicted-latency-producer
# Two-gate prefix cache affinity: strict (0.99) runs before the SLO tier
# filter to prefer near-exact cache matches across all endpoints; loose
# (0.80) runs after the tier filter to prefer partial matches within the
# SLO-qualified tier.
- name: strict-affinity-filter
  type: prefix-cache-affinity-filter
  parameters:
    affinityThreshold: 0.99
    ttftSource: latencyPredictor
    maxTTFTPenaltyMs: 5000
- name: loose-affinity-filter
  type: prefix-cache-affinity-filter
  parameters:
    affinityThreshold: 0.80
    ttftSource: latencyPredictor
    maxTTFTPenaltyMs: 5000
- type: latency-scorer
- type: weighted-random-picker
- type: slo-headroom-tier-filter
- type: latency-slo-admitter
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: predicted-latency-producer
  - pluginRef: strict-affinity-filter
  - pluginRef: slo-headroom-tier-filter
  - pluginRef: loose-affinity-filter
  - pluginRef: latency-scorer
  - pluginRef: weighted-random-picker
"""

#: The llm-d router chart's ``payload-agnostic.yaml``.
LLMD_PAYLOAD_AGNOSTIC = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: passthrough-parser
- type: active-request-scorer
- type: session-affinity-scorer
requestHandler:
  parsers:
  - pluginRef: passthrough-parser
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: active-request-scorer
    weight: 1
  - pluginRef: session-affinity-scorer
    weight: 1
"""


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
