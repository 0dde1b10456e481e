"""EndpointPickerConfigs the benchmarks compare, besides the default (no config).

``sticky_config`` is "sticky until saturated": ``prefix-cache-affinity-filter`` (its TTFT
gate on) -> ``token-load-scorer`` (with the prompt look-ahead) -> ``max-score-picker``,
with the ``inflight-load-producer`` booking uncached input tokens only (the reference's
``addEstimatedOutputTokens: false``). ``peak`` is ``peakPrefillThroughput``: the
simulator's ``h100-8b`` preset prefills 4,000 tokens/s (0.25 ms per uncached token), so
the benchmarks pass that, as an operator would pass their calibrated figure.
"""

from __future__ import annotations

__all__ = ["RANDOM_CONFIG", "SIMULATOR_PREFILL_TOKENS_PER_S", "sticky_config"]

#: Prefill throughput of the simulator's ``h100-8b`` preset (1 / 0.25 ms per token).
SIMULATOR_PREFILL_TOKENS_PER_S = 4000.0

RANDOM_CONFIG = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: random-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: random-picker
"""


def sticky_config(
    peak: float = SIMULATOR_PREFILL_TOKENS_PER_S,
    penalty_ms: float = 18000.0,
    exploration: float = 0.0,
) -> str:
    """The "sticky until saturated" profile as an ``llm-d.ai/v1alpha1`` config."""
    return f"""\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: inflight-load-producer
  parameters:
    addEstimatedOutputTokens: false
- type: prefix-cache-affinity-filter
  parameters:
    peakPrefillThroughput: {peak}
    maxTTFTPenaltyMs: {penalty_ms}
    explorationProbability: {exploration}
- type: token-load-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: prefix-cache-affinity-filter
  - pluginRef: token-load-scorer
  - pluginRef: max-score-picker
"""
