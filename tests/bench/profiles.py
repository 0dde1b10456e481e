"""EndpointPickerConfigs the benchmarks compare, besides the default (no config).

``default_without_freshness`` and ``default_with_no_hit_lru`` are the default with
``metrics-freshness-filter`` removed, or with ``no-hit-lru-scorer`` added at a weight: the
variants decision 0014 measured.

``sticky_config`` is "sticky until saturated": ``prefix-cache-affinity-filter`` (its TTFT
gate on) -> ``token-load-scorer`` (with the prompt look-ahead) -> ``max-score-picker``,
with the ``inflight-load-producer`` booking uncached input tokens only (the reference's
``addEstimatedOutputTokens: false``). ``peak`` is ``peakPrefillThroughput``: the
simulator's ``h100-8b`` preset prefills 4,000 tokens/s (0.25 ms per uncached token), so
the benchmarks pass that, as an operator would pass their calibrated figure.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from app.config import DEFAULT_CONFIG

__all__ = [
    "RANDOM_CONFIG",
    "SIMULATOR_PREFILL_TOKENS_PER_S",
    "default_as_of_2026_11_25",
    "default_with_no_hit_lru",
    "default_without_freshness",
    "default_without_kv_gate",
    "predicted_band_blend_config",
    "predicted_break_config",
    "predicted_leave_config",
    "predicted_sticky_config",
    "reported_load_config",
    "sticky_config",
]

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


def default_without_freshness() -> str:
    """The no-config default without ``metrics-freshness-filter`` (JSON, valid YAML)."""
    config: dict[str, Any] = copy.deepcopy(DEFAULT_CONFIG)
    kept = "metrics-freshness-filter"
    config["plugins"] = [p for p in config["plugins"] if p["type"] != kept]
    for profile in config["schedulingProfiles"]:
        profile["plugins"] = [p for p in profile["plugins"] if p["pluginRef"] != kept]
    return json.dumps(config)


def default_with_no_hit_lru(weight: float) -> str:
    """The no-config default plus ``no-hit-lru-scorer`` at ``weight`` after
    ``token-load-scorer`` (JSON, valid YAML)."""
    config: dict[str, Any] = copy.deepcopy(DEFAULT_CONFIG)
    config["plugins"].insert(-1, {"type": "no-hit-lru-scorer"})
    for profile in config["schedulingProfiles"]:
        profile["plugins"].insert(-1, {"pluginRef": "no-hit-lru-scorer", "weight": weight})
    return json.dumps(config)


def default_without_kv_gate() -> str:
    """The no-config default without ``kv-capacity-gate`` (JSON, valid YAML): the default
    until 2026-11-25."""
    config: dict[str, Any] = copy.deepcopy(DEFAULT_CONFIG)
    config["plugins"] = [p for p in config["plugins"] if p["type"] != "kv-capacity-gate"]
    return json.dumps(config)


def default_with_flow_control(queue_per_server: int = 1) -> str:
    """The no-config default with flow control on, FCFS with no TTL, gated by
    ``standing-queue-detector`` (JSON, valid YAML): decision 0030's candidate default."""
    config: dict[str, Any] = copy.deepcopy(DEFAULT_CONFIG)
    detector: dict[str, Any] = {"type": "standing-queue-detector"}
    if queue_per_server != 1:
        detector["parameters"] = {"queuePerServer": queue_per_server}
    config["plugins"].append(detector)
    config["featureGates"] = ["flowControl"]
    config["flowControl"] = {"saturationDetector": {"pluginRef": "standing-queue-detector"}}
    return json.dumps(config)


def default_as_of_2026_11_25() -> str:
    """The no-config default from 2026-11-25 (decision 0026) until latency-aware routing:
    sticky until saturated, ``metrics-freshness-filter``, ``kv-capacity-gate`` (JSON)."""
    return json.dumps(
        {
            "plugins": [
                {"type": "approx-prefix-cache-producer", "parameters": {"autoTune": False}},
                {
                    "type": "inflight-load-producer",
                    "parameters": {"addEstimatedOutputTokens": False},
                },
                {"type": "prefix-cache-affinity-filter"},
                {"type": "metrics-freshness-filter"},
                {"type": "token-load-scorer"},
                {"type": "max-score-picker"},
                {"type": "kv-capacity-gate"},
            ],
            "schedulingProfiles": [
                {
                    "name": "default",
                    "plugins": [
                        {"pluginRef": "prefix-cache-affinity-filter"},
                        {"pluginRef": "metrics-freshness-filter"},
                        {"pluginRef": "token-load-scorer"},
                        {"pluginRef": "max-score-picker"},
                    ],
                }
            ],
        }
    )


def predicted_sticky_config(
    penalty_ms: float = 5000.0, *, gate: bool = True, tie_break: bool = False
) -> str:
    """Sticky until the predicted TTFT says otherwise: ``prefix-cache-affinity-filter``
    on ``ttftSource: latencyPredictor`` with ``penalty_ms``, ``metrics-freshness-filter``,
    ``latency-scorer`` (the lowest predicted TTFT, idle endpoints first) plus, with
    ``tie_break``, ``token-load-scorer`` (whose scores differ by thousandths: it decides
    between endpoints the predictions cannot tell apart), ``max-score-picker``, then
    ``kv-capacity-gate`` unless ``gate`` is false (JSON)."""
    plugins: list[dict[str, Any]] = [
        {"type": "approx-prefix-cache-producer", "parameters": {"autoTune": False}},
        {"type": "inflight-load-producer", "parameters": {"addEstimatedOutputTokens": False}},
        {"type": "predicted-latency-producer", "parameters": {"streamingMode": True}},
        {
            "type": "prefix-cache-affinity-filter",
            "parameters": {"ttftSource": "latencyPredictor", "maxTTFTPenaltyMs": penalty_ms},
        },
        {"type": "metrics-freshness-filter"},
        {"type": "latency-scorer"},
        {"type": "max-score-picker"},
    ]
    scorers: list[dict[str, Any]] = [{"pluginRef": "latency-scorer"}]
    if tie_break:
        plugins.insert(-1, {"type": "token-load-scorer"})
        scorers.append({"pluginRef": "token-load-scorer"})
    if gate:
        plugins.append({"type": "kv-capacity-gate"})
    return json.dumps(
        {
            "plugins": plugins,
            "schedulingProfiles": [
                {
                    "name": "default",
                    "plugins": [
                        {"pluginRef": "prefix-cache-affinity-filter"},
                        {"pluginRef": "metrics-freshness-filter"},
                        *scorers,
                        {"pluginRef": "max-score-picker"},
                    ],
                }
            ],
        }
    )


def _with_parameters(config: dict[str, Any], plugin_type: str, **parameters: Any) -> None:
    """Merges ``parameters`` into the entry of ``plugin_type`` in ``config``."""
    for entry in config["plugins"]:
        if entry["type"] == plugin_type:
            entry["parameters"] = {**entry.get("parameters", {}), **parameters}
            return
    raise ValueError(plugin_type)


def reported_load_config(tokens: int = 1000) -> str:
    """The no-config default whose in-flight token view (``token-load-scorer`` and the
    affinity filter's gate) also counts ``tokens`` per request a server reports waiting or
    running beyond this EPP's own in-flight requests there (JSON)."""
    config: dict[str, Any] = copy.deepcopy(DEFAULT_CONFIG)
    _with_parameters(config, "prefix-cache-affinity-filter", reportedRequestTokens=tokens)
    _with_parameters(config, "token-load-scorer", reportedRequestTokens=tokens)
    return json.dumps(config)


def predicted_break_config(
    penalty_ms: float = 1000.0, *, exclude: bool = True, reported_tokens: int = 1000
) -> str:
    """The no-config default with stickiness broken on the predicted TTFT only: the
    affinity filter on ``ttftSource: latencyPredictor`` with ``penalty_ms`` (and, with
    ``exclude``, ``excludeSaturated``: no endpoint predicted more than ``penalty_ms`` above
    the fastest passes),
    ``predicted-latency-producer`` added; a new prefix is still placed by
    ``token-load-scorer``, which with ``reported_tokens`` > 0 counts that many tokens per
    request a server reports beyond this EPP's own (JSON)."""
    config: dict[str, Any] = copy.deepcopy(DEFAULT_CONFIG)
    _with_parameters(
        config,
        "prefix-cache-affinity-filter",
        ttftSource="latencyPredictor",
        maxTTFTPenaltyMs=penalty_ms,
        excludeSaturated=exclude,
    )
    if reported_tokens:
        _with_parameters(config, "token-load-scorer", reportedRequestTokens=reported_tokens)
    at = [p["type"] for p in config["plugins"]].index("prefix-cache-affinity-filter")
    config["plugins"].insert(at, {"type": "predicted-latency-producer"})
    return json.dumps(config)


def predicted_band_blend_config(
    penalty_ms: float = 1000.0,
    *,
    queue_weight: float = 2.0,
    kv_weight: float = 2.0,
    gate: bool = True,
) -> str:
    """``predicted_break_config(penalty_ms)`` with the reference's balancing after the
    band: ``queue-scorer`` at ``queue_weight`` and ``kv-cache-utilization-scorer`` at
    ``kv_weight`` (0: left out) before ``token-load-scorer`` (weight 1, whose scores
    differ by thousandths: a tie-break), so the endpoint among those the band passes is
    chosen by the queue and KV usage the servers report; without ``kv-capacity-gate``
    unless ``gate`` (JSON)."""
    config: dict[str, Any] = json.loads(predicted_break_config(penalty_ms))
    if not gate:
        config["plugins"] = [p for p in config["plugins"] if p["type"] != "kv-capacity-gate"]
    added = [
        (plugin_type, weight)
        for plugin_type, weight in (
            ("queue-scorer", queue_weight),
            ("kv-cache-utilization-scorer", kv_weight),
        )
        if weight
    ]
    at = [p["type"] for p in config["plugins"]].index("token-load-scorer")
    config["plugins"][at:at] = [{"type": plugin_type} for plugin_type, _ in added]
    for profile in config["schedulingProfiles"]:
        refs = [p["pluginRef"] for p in profile["plugins"]]
        at = refs.index("token-load-scorer")
        profile["plugins"][at:at] = [
            {"pluginRef": plugin_type, "weight": weight} for plugin_type, weight in added
        ]
    return json.dumps(config)


def predicted_leave_config(
    penalty_ms: float = 1000.0,
    *,
    leave: bool = True,
    queued_penalty_ms: float | None = None,
    gate: bool = True,
) -> str:
    """``predicted_break_config(penalty_ms)`` with, if ``leave``, ``leaveByReportedQueue``
    (a request leaving its saturated sticky endpoints goes to those of the band with the
    shortest scraped waiting queue, ``token-load-scorer`` choosing among them, while a new
    prefix is still placed by ``token-load-scorer`` alone) and, with ``queued_penalty_ms``,
    ``queuedStickyPenaltyMs`` (the narrower band for a sticky endpoint reporting a longer
    queue than the shortest); without ``kv-capacity-gate`` unless ``gate`` (JSON)."""
    config: dict[str, Any] = json.loads(predicted_break_config(penalty_ms))
    if not gate:
        config["plugins"] = [p for p in config["plugins"] if p["type"] != "kv-capacity-gate"]
    if leave:
        _with_parameters(config, "prefix-cache-affinity-filter", leaveByReportedQueue=True)
    if queued_penalty_ms is not None:
        _with_parameters(
            config, "prefix-cache-affinity-filter", queuedStickyPenaltyMs=queued_penalty_ms
        )
    return json.dumps(config)
