"""The EndpointPickerConfig against the reference's and the llm-d router's: keys and types.

One table for each: every config key and feature gate of the reference
(kubernetes-sigs/gateway-api-inference-extension at ``1748e829``, 2026-06-16, the last commit
with the EPP) and of the llm-d router (llm-d/llm-d-router at ``ebab6879``, 2026-08-22, and the
llm-d guides' shipped configs), and every plugin type either registers, with what this EPP
does with it: supported, accepted and ignored (said once at start-up, with the reason given
here), or refused (start-up stops naming the entry and the reason given here).

The loader takes its reasons from here (``unavailable_reason``, ``ignored_reason``), so the
page and the messages say the same; ``python -m app.config`` prints the tables of
``docs/drop-in.md`` ("Config keys and plugin types"), and a test keeps them equal.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "CONFIG_KEYS",
    "FEATURE_GATE_ROWS",
    "LLMD_TYPES",
    "NOOP_TYPES",
    "REFERENCE_TYPES",
    "UNAVAILABLE_TYPES",
    "GateRow",
    "KeyRow",
    "gate_reason",
    "ignored_reason",
    "refused_reason",
    "render_markdown",
    "unavailable_reason",
]

Status = Literal["supported", "ignored", "refused"]
Origin = Literal["reference, llm-d", "llm-d", "llm-d guides", "this EPP"]


@dataclass(frozen=True, slots=True, kw_only=True)
class KeyRow:
    """One config key (``[]``: every item of a list) and what happens to it here."""

    path: str
    origin: Origin
    status: Status
    note: str = ""


_BAND_KEYS: tuple[tuple[str, Status, str], ...] = (
    ("maxBytes", "supported", "a Kubernetes quantity; unset or 0: 1 GB"),
    ("maxRequests", "supported", "a Kubernetes quantity; unset or 0: no limit"),
    ("fairnessPolicyRef", "supported", ""),
    ("orderingPolicyRef", "supported", ""),
)


def _band_rows(band: str, origin: Origin) -> list[KeyRow]:
    prefix = f"flowControl.{band}"
    rows = [
        KeyRow(path=f"{prefix}.{key}", origin=origin, status=status, note=note)
        for key, status, note in _BAND_KEYS
    ]
    rows.append(
        KeyRow(
            path=f"{prefix}.defaultRequestTTL",
            origin="llm-d guides",
            status="supported",
            note="how long a request of the band may wait; unset: flowControl.defaultRequestTTL",
        )
    )
    if band == "priorityBands[]":
        rows.insert(0, KeyRow(path=f"{prefix}.priority", origin=origin, status="supported"))
    else:
        rows.insert(
            0,
            KeyRow(
                path=f"{prefix}.priority",
                origin=origin,
                status="ignored",
                note="a band made from the template takes the priority of its requests",
            ),
        )
    return rows


#: Every key of the EndpointPickerConfig, in document order.
CONFIG_KEYS: tuple[KeyRow, ...] = (
    KeyRow(
        path="apiVersion",
        origin="reference, llm-d",
        status="supported",
        note="`llm-d.ai/v1`, `llm-d.ai/v1alpha1` or `inference.networking.x-k8s.io/v1alpha1`",
    ),
    KeyRow(path="kind", origin="reference, llm-d", status="supported"),
    KeyRow(
        path="featureGates[]",
        origin="reference, llm-d",
        status="supported",
        note="`name`, `name=true` or `name=false`; the gates are in the next table",
    ),
    KeyRow(path="plugins[].name", origin="reference, llm-d", status="supported"),
    KeyRow(
        path="plugins[].type",
        origin="reference, llm-d",
        status="supported",
        note="the plugin types are in the table after the gates",
    ),
    KeyRow(path="plugins[].parameters", origin="reference, llm-d", status="supported"),
    KeyRow(path="schedulingProfiles[].name", origin="reference, llm-d", status="supported"),
    KeyRow(
        path="schedulingProfiles[].plugins[].pluginRef",
        origin="reference, llm-d",
        status="supported",
    ),
    KeyRow(
        path="schedulingProfiles[].plugins[].weight", origin="reference, llm-d", status="supported"
    ),
    KeyRow(
        path="saturationDetector.pluginRef",
        origin="reference, llm-d",
        status="supported",
        note="deprecated in llm-d for flowControl.saturationDetector, which wins when both are set",
    ),
    KeyRow(
        path="parser.pluginRef",
        origin="reference, llm-d",
        status="supported",
        note="deprecated in llm-d for requestHandler.parsers; give one or the other",
    ),
    KeyRow(path="requestHandler.parsers[].pluginRef", origin="llm-d", status="supported"),
    KeyRow(
        path="dataLayer.injectDefaults",
        origin="llm-d",
        status="supported",
        note="false: only the listed sources; true: `metrics-data-source` and "
        "`core-metrics-extractor` are added unless a metrics source is listed; unset: true "
        "under `llm-d.ai/*`, false under the reference's apiVersion (as each does)",
    ),
    KeyRow(path="dataLayer.sources[].pluginRef", origin="reference, llm-d", status="supported"),
    KeyRow(
        path="dataLayer.sources[].extractors[].pluginRef",
        origin="reference, llm-d",
        status="supported",
    ),
    KeyRow(
        path="dataLayer.sources[].interval",
        origin="this EPP",
        status="supported",
        note="how often the source is polled; llm-d sets it as the source's `interval` "
        "parameter, accepted as well (see `metrics-data-source`)",
    ),
    KeyRow(
        path="dataLayer.discovery",
        origin="llm-d",
        status="refused",
        note="endpoint discovery plugins are not implemented: endpoints come from the "
        "InferencePool, or from --static-endpoints",
    ),
    KeyRow(
        path="dataLayer.peerDiscovery",
        origin="llm-d",
        status="refused",
        note="peer discovery plugins are not implemented: replicas share state through --redis-url",
    ),
    KeyRow(
        path="dataLayer.crossReplicaSyncerPluginRef",
        origin="llm-d",
        status="refused",
        note="cross-replica syncer plugins are not implemented: replicas share in-flight "
        "load, prefixes and sessions through --redis-url",
    ),
    KeyRow(
        path="dataLayer.crossReplicaSyncInterval",
        origin="llm-d",
        status="ignored",
        note="no cross-replica syncer here; with --redis-url each request's load is shared "
        "as it is booked",
    ),
    KeyRow(
        path="flowControl.maxBytes",
        origin="reference, llm-d",
        status="supported",
        note="unset or 0: no limit",
    ),
    KeyRow(
        path="flowControl.maxRequests",
        origin="reference, llm-d",
        status="supported",
        note="unset or 0: no limit",
    ),
    KeyRow(
        path="flowControl.defaultRequestTTL",
        origin="reference, llm-d",
        status="supported",
        note="unset or 0: a request waits until its client gives up (the reference's "
        "default; llm-d's is 60s)",
    ),
    KeyRow(
        path="flowControl.noEndpointRequestTTL",
        origin="llm-d",
        status="ignored",
        note="one budget here: a request waits under defaultRequestTTL whether or not the "
        "pool has endpoints",
    ),
    *_band_rows("defaultPriorityBand", "reference, llm-d"),
    *_band_rows("defaultNegativePriorityBand", "llm-d"),
    *_band_rows("priorityBands[]", "reference, llm-d"),
    KeyRow(
        path="flowControl.usageLimitPolicyPluginRef",
        origin="reference, llm-d",
        status="supported",
    ),
    KeyRow(
        path="flowControl.saturationDetector.pluginRef",
        origin="llm-d",
        status="supported",
        note="used with or without the flowControl gate",
    ),
    KeyRow(
        path="flowControl.enableEviction",
        origin="llm-d",
        status="ignored",
        note="in-flight requests are never cancelled here to make room; a queued request "
        "of a lower priority band is displaced when a higher one does not fit",
    ),
)

_KEYS_BY_PATH = {row.path: row for row in CONFIG_KEYS}


def ignored_reason(path: str) -> str:
    """Why the key at ``path`` (``[]`` for list items) has no effect here."""
    row = _KEYS_BY_PATH[path]
    assert row.status == "ignored", path
    return row.note


def refused_reason(path: str) -> str:
    """Why the key at ``path`` is refused here."""
    row = _KEYS_BY_PATH[path]
    assert row.status == "refused", path
    return row.note


@dataclass(frozen=True, slots=True, kw_only=True)
class GateRow:
    """One feature gate and what turning it on does here."""

    name: str
    origin: Origin
    status: Status
    note: str = ""


FEATURE_GATE_ROWS: tuple[GateRow, ...] = (
    GateRow(
        name="flowControl",
        origin="reference, llm-d",
        status="supported",
        note="off by default, as in both",
    ),
    GateRow(
        name="enableLegacyMetrics",
        origin="reference, llm-d",
        status="supported",
        note="no default metrics source (removed from llm-d)",
    ),
    GateRow(
        name="dataLayer",
        origin="reference, llm-d",
        status="ignored",
        note="the data layer is always on here (the gate was removed from llm-d)",
    ),
    GateRow(
        name="haPopulateNonLeaderDatastore",
        origin="llm-d",
        status="supported",
        note="on, as in llm-d: every replica discovers endpoints and collects metrics; "
        "`=false` is accepted and ignored (a standby replica here is always warm)",
    ),
)


def gate_reason(name: str) -> str:
    """Why the feature gate ``name`` has no effect here."""
    return next(g.note for g in FEATURE_GATE_ROWS if g.name == name)


#: The plugin types the llm-d router registers at ``ebab6879`` (``cmd/epp/runner``), and
#: the types its guides configure that it does not register there.
LLMD_TYPES: frozenset[str] = frozenset(
    {
        "active-request-scorer",
        "agent-identity",
        "always-disagg-multimodal-decider",
        "always-disagg-pd-decider",
        "anthropic-parser",
        "approx-prefix-cache-producer",
        "burst-prefix-cache-producer",
        "by-label",
        "by-label-selector",
        "concurrency-detector",
        "context-length-aware",
        "core-metrics-extractor",
        "data-parallel-profile-handler",
        "dcgm-data-source",
        "dcgm-extractor",
        "decode-filter",
        "destination-endpoint-served-verifier",
        "disagg-headers-handler",
        "disagg-profile-handler",
        "disaggregatedset-rollout-screener",
        "edf-ordering-policy",
        "encode-filter",
        "endpoint-attribute-filter",
        "endpoint-attribute-scorer",
        "endpoint-notification-source",
        "fcfs-ordering-policy",
        "file-discovery",
        "global-strict-fairness-policy",
        "header-based-testing-filter",
        "header-label-affinity-scorer",
        "header-profile-handler",
        "inflight-load-producer",
        "k8s-notification-source",
        "kv-cache-utilization-scorer",
        "label-selector-filter",
        "latency-scorer",
        "latency-slo-admitter",
        "lmetric-scorer",
        "load-aware-scorer",
        "lora-affinity-scorer",
        "max-score-picker",
        "metrics-data-source",
        "mm-embeddings-cache-producer",
        "mm-embeddings-cache-scorer",
        "models-data-extractor",
        "models-data-source",
        "multicluster-approx-prefix-cache-producer",
        "multicluster-file-discovery",
        "multicluster-kv-cache-utilization-scorer",
        "multicluster-metrics-data-source",
        "multicluster-metrics-extractor",
        "multicluster-prefix-cache-scorer",
        "multicluster-queue-scorer",
        "multicluster-session-affinity-filter",
        "no-hit-lru-scorer",
        "openai-parser",
        "p2p-source-producer",
        "passthrough-parser",
        "pd-profile-handler",
        "precise-prefix-cache-producer",
        "precise-prefix-cache-scorer",
        "predicted-latency-producer",
        "prefill-filter",
        "prefill-header-handler",
        "prefix-based-pd-decider",
        "prefix-cache-affinity-filter",
        "prefix-cache-scorer",
        "priority-holdback-policy",
        "priority-then-time-eviction-order-policy",
        "probabilistic-admitter",
        "program-aware-fairness",
        "queue-scorer",
        "random-picker",
        "request-attribute-reporter",
        "round-robin-fairness-policy",
        "running-requests-size-scorer",
        "session-affinity-filter",
        "session-affinity-scorer",
        "session-id-producer",
        "sglanghttp-parser",
        "sheddable-eviction-filter",
        "single-profile-handler",
        "slo-deadline-ordering-policy",
        "slo-headroom-tier-filter",
        "soft-reflective-ceiling-policy",
        "static-usage-limit-policy",
        "token-load-scorer",
        "token-producer",
        "tokenizer",
        "topology-affinity-filter",
        "topology-affinity-scorer",
        "topology-extractor",
        "utilization-detector",
        "utilization-filter",
        "vertexai-parser",
        "vllmgrpc-parser",
        "vllmhttp-parser",
        "weighted-random-picker",
    }
)

#: The plugin types the reference registers at ``1748e829`` (``cmd/epp/runner``).
REFERENCE_TYPES: frozenset[str] = frozenset(
    {
        "approx-prefix-cache-producer",
        "concurrency-detector",
        "core-metrics-extractor",
        "destination-endpoint-served-verifier",
        "edf-ordering-policy",
        "endpoint-notification-source",
        "fcfs-ordering-policy",
        "global-strict-fairness-policy",
        "header-based-testing-filter",
        "inflight-load-producer",
        "k8s-notification-source",
        "kv-cache-utilization-scorer",
        "latency-scorer",
        "latency-slo-admitter",
        "lora-affinity-scorer",
        "max-score-picker",
        "metrics-data-source",
        "openai-parser",
        "passthrough-parser",
        "predicted-latency-producer",
        "prefix-cache-affinity-filter",
        "prefix-cache-scorer",
        "queue-scorer",
        "random-picker",
        "request-attribute-reporter",
        "round-robin-fairness-policy",
        "running-requests-size-scorer",
        "single-profile-handler",
        "slo-deadline-ordering-policy",
        "slo-headroom-tier-filter",
        "static-usage-limit-policy",
        "token-load-scorer",
        "utilization-detector",
        "vllmgrpc-parser",
        "weighted-random-picker",
    }
)

_NOT_IMPLEMENTED = "not implemented"
_MULTICLUSTER = "multi-cluster routing is not implemented"
_TOKENS = (
    "tokenization by a separate service is not implemented: prompts are measured from their "
    "text here, and precise-prefix-cache-producer tokenizes with a local tokenizer.json "
    "(tokenProcessorConfig.tokenizerPath)"
)
_PARSER = (
    "request format not implemented (openai-parser, anthropic-parser and passthrough-parser are)"
)
_EVICTION = "in-flight eviction is not implemented (flowControl.enableEviction is ignored)"

#: Types of the reference or the llm-d router this EPP does not register, and why.
UNAVAILABLE_TYPES: dict[str, str] = {
    "agent-identity": "session and fairness IDs from coding-agent headers are not implemented",
    "always-disagg-multimodal-decider": "encode disaggregation (E/PD) is not implemented",
    "burst-prefix-cache-producer": _NOT_IMPLEMENTED,
    "by-label": "generic label filters are not implemented (decode-filter, prefill-filter and "
    "encode-filter filter on llm-d.ai/role)",
    "by-label-selector": "generic label filters are not implemented (decode-filter, "
    "prefill-filter and encode-filter filter on llm-d.ai/role)",
    "context-length-aware": "needs per-request token counts from token-producer; " + _TOKENS,
    "data-parallel-profile-handler": _NOT_IMPLEMENTED,
    "dcgm-data-source": "GPU telemetry from DCGM exporters is not implemented",
    "dcgm-extractor": "GPU telemetry from DCGM exporters is not implemented",
    "disaggregatedset-rollout-screener": "the Screener extension point is not implemented",
    "file-discovery": "endpoint discovery plugins are not implemented: endpoints come from "
    "the InferencePool, or from --static-endpoints",
    "header-label-affinity-scorer": _NOT_IMPLEMENTED,
    "label-selector-filter": "generic label filters are not implemented (decode-filter, "
    "prefill-filter and encode-filter filter on llm-d.ai/role)",
    "lmetric-scorer": _NOT_IMPLEMENTED,
    "load-aware-scorer": _NOT_IMPLEMENTED,
    "mm-embeddings-cache-producer": "multimodal encoder-cache affinity is not implemented",
    "mm-embeddings-cache-scorer": "multimodal encoder-cache affinity is not implemented",
    "models-data-extractor": _NOT_IMPLEMENTED,
    "models-data-source": _NOT_IMPLEMENTED,
    "multicluster-approx-prefix-cache-producer": _MULTICLUSTER,
    "multicluster-file-discovery": _MULTICLUSTER,
    "multicluster-kv-cache-utilization-scorer": _MULTICLUSTER,
    "multicluster-metrics-data-source": _MULTICLUSTER,
    "multicluster-metrics-extractor": _MULTICLUSTER,
    "multicluster-prefix-cache-scorer": _MULTICLUSTER,
    "multicluster-queue-scorer": _MULTICLUSTER,
    "multicluster-session-affinity-filter": _MULTICLUSTER,
    "p2p-source-producer": "peer-to-peer KV-cache transfer is not implemented",
    "precise-prefix-cache-scorer": "the llm-d router's deprecated wrapper: configure "
    "precise-prefix-cache-producer and prefix-cache-scorer",
    "priority-then-time-eviction-order-policy": _EVICTION,
    "probabilistic-admitter": _NOT_IMPLEMENTED,
    "program-aware-fairness": "fairness policy not implemented (global-strict-fairness-policy "
    "and round-robin-fairness-policy are)",
    "request-attribute-reporter": _NOT_IMPLEMENTED,
    "session-id-producer": "not implemented: session-affinity-filter and "
    "session-affinity-scorer read the session ID themselves (sessionIdConfig)",
    "sglanghttp-parser": _PARSER,
    "sheddable-eviction-filter": _EVICTION,
    "soft-reflective-ceiling-policy": "usage-limit policy not implemented "
    "(static-usage-limit-policy and priority-holdback-policy are)",
    "token-producer": _TOKENS,
    "tokenizer": _TOKENS,
    "topology-affinity-filter": _NOT_IMPLEMENTED,
    "topology-affinity-scorer": _NOT_IMPLEMENTED,
    "topology-extractor": _NOT_IMPLEMENTED,
    "vertexai-parser": _PARSER,
    "vllmgrpc-parser": "the vLLM gRPC protocol is not implemented (openai-parser, "
    "anthropic-parser and passthrough-parser are)",
    "vllmhttp-parser": _PARSER,
}

#: Types this EPP registers that do nothing here, and why (the loader says so once).
NOOP_TYPES: dict[str, str] = {
    "disagg-headers-handler": "disagg-profile-handler's prefill endpoint is always sent in "
    "the x-prefiller-host-port header here",
    "prefill-header-handler": "disagg-profile-handler's prefill endpoint is always sent in "
    "the x-prefiller-host-port header here",
}


def unavailable_reason(type_name: str) -> str | None:
    """Why a plugin type this EPP does not register is refused: ``None`` when it is not a
    type of the reference or the llm-d router."""
    reason = UNAVAILABLE_TYPES.get(type_name)
    if reason is None:
        return None
    return f"not available in this EPP: {reason}"


def _type_status(type_name: str, registered: frozenset[str]) -> tuple[Status, str]:
    if type_name in NOOP_TYPES:
        return "ignored", NOOP_TYPES[type_name]
    if type_name in registered:
        return "supported", ""
    reason = UNAVAILABLE_TYPES.get(type_name, _NOT_IMPLEMENTED)
    return "refused", reason


_LABELS: dict[Status, str] = {
    "supported": "supported",
    "ignored": "accepted and ignored",
    "refused": "refused",
}


def _yes(flag: bool) -> str:
    return "yes" if flag else ""


def _counts(statuses: Iterable[Status]) -> str:
    counted = Counter(statuses)
    return (
        f"{counted['supported']} supported, {counted['ignored']} accepted and ignored, "
        f"{counted['refused']} refused"
    )


def render_markdown(registered: Iterable[str]) -> str:
    """The tables of ``docs/drop-in.md`` for a registry holding ``registered`` types."""
    types = frozenset(registered)
    lines: list[str] = []
    add = lines.append
    add(f"**Config keys** ({len(CONFIG_KEYS)}): {_counts(r.status for r in CONFIG_KEYS)}.")
    add("")
    add("| key | from | here | note |")
    add("| --- | --- | --- | --- |")
    for row in CONFIG_KEYS:
        add(f"| `{row.path}` | {row.origin} | {_LABELS[row.status]} | {row.note} |")
    add("")
    gates = FEATURE_GATE_ROWS
    add(f"**Feature gates** ({len(gates)}): {_counts(g.status for g in gates)}.")
    add("")
    add("| gate | from | here | note |")
    add("| --- | --- | --- | --- |")
    for gate in gates:
        add(f"| `{gate.name}` | {gate.origin} | {_LABELS[gate.status]} | {gate.note} |")
    add("")
    upstream = sorted(LLMD_TYPES | REFERENCE_TYPES)
    statuses = {name: _type_status(name, types) for name in upstream}
    add(
        f"**Plugin types** of the reference and the llm-d router ({len(upstream)}): "
        f"{_counts(s for s, _ in statuses.values())}. Of the reference's "
        f"{len(REFERENCE_TYPES)}: {_counts(statuses[n][0] for n in REFERENCE_TYPES)}."
    )
    add("")
    add("| type | reference | llm-d | here | why |")
    add("| --- | --- | --- | --- | --- |")
    for name in upstream:
        status, why = statuses[name]
        add(
            f"| `{name}` | {_yes(name in REFERENCE_TYPES)} | {_yes(name in LLMD_TYPES)} | "
            f"{_LABELS[status]} | {why} |"
        )
    own = sorted(types - LLMD_TYPES - REFERENCE_TYPES)
    add("")
    add(f"This EPP's own types ({len(own)}): {', '.join(f'`{n}`' for n in own)}.")
    add("")
    add("Accepted and ignored, and why (start-up logs one line for each one a config uses):")
    add("")
    for row in CONFIG_KEYS:
        if row.status == "ignored":
            add(f"- `{row.path}`: {row.note}.")
    for gate in gates:
        if gate.status == "ignored":
            add(f"- feature gate `{gate.name}`: {gate.note}.")
    for name in sorted(NOOP_TYPES):
        add(f"- plugin type `{name}`: {NOOP_TYPES[name]}.")
    return "\n".join(lines) + "\n"
