"""What command-line flags change in a loaded config: feature gates and plugin parameters.

The reference's deprecated model-server metrics flags (``--model-server-metrics-*`` and the
``--*-metric`` specs, which its Helm chart still passes for SGLang, Triton and trtllm-serve)
are applied over the parameters of every ``metrics-data-source`` and over the default
engine's metric specs of every ``core-metrics-extractor``, configured or defaulted: the
flag, given explicitly, wins over the config. ``--feature-gates`` turns gates on or off over
the config's ``featureGates``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from app.settings import Settings
from domain.datalayer.plugins.core_metrics_extractor import (
    BUILTIN_ENGINES,
    DEFAULT_ENGINE,
    EngineConfig,
)

__all__ = ["ConfigOverrides", "ParameterTransform", "legacy_metrics_transforms"]

#: Raw (camelCase) parameters in, raw parameters out.
ParameterTransform = Callable[[Mapping[str, Any]], dict[str, Any]]

_SOURCE_KEYS = {"scheme": "scheme", "path": "path", "insecure_skip_verify": "insecureSkipVerify"}
_SPEC_KEYS = {
    "queued_requests_spec": "queuedRequestsSpec",
    "running_requests_spec": "runningRequestsSpec",
    "kv_usage_spec": "kvUsageSpec",
    "lora_spec": "loraSpec",
    "cache_info_spec": "cacheInfoSpec",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class ConfigOverrides:
    """``gates``: feature gates turned on (true) or off (false) over the config's;
    ``parameters``: per plugin type, a transform of every instance's raw parameters."""

    gates: Mapping[str, bool] = field(default_factory=dict)
    parameters: Mapping[str, ParameterTransform] = field(default_factory=dict)

    @classmethod
    def from_settings(cls, settings: Settings) -> ConfigOverrides:
        return cls(
            gates=dict(settings.feature_gates),
            parameters=legacy_metrics_transforms(settings.legacy_metrics.given()),
        )

    def apply_gates(self, gates: frozenset[str], known: tuple[str, ...]) -> frozenset[str]:
        """``gates`` with the flag's known gates turned on or off (start-up names the
        others as ignored)."""
        on = {name for name, enabled in self.gates.items() if enabled and name in known}
        off = {name for name, enabled in self.gates.items() if not enabled}
        return frozenset((gates | on) - off)

    def parameters_of(self, type_name: str, raw: Mapping[str, Any] | None) -> Any:
        """``raw`` after this type's transform (``raw`` itself when it has none)."""
        transform = self.parameters.get(type_name)
        if transform is None:
            return raw
        return transform(raw or {})


def legacy_metrics_transforms(given: Mapping[str, object]) -> dict[str, ParameterTransform]:
    """The transforms of the deprecated metrics flags given (``LegacyMetrics.given()``)."""
    transforms: dict[str, ParameterTransform] = {}
    source = {_SOURCE_KEYS[k]: v for k, v in given.items() if k in _SOURCE_KEYS}
    if given.get("port"):
        source["port"] = given["port"]
    if source:
        transforms["metrics-data-source"] = lambda raw: {**raw, **source}
    specs = {_SPEC_KEYS[k]: v for k, v in given.items() if k in _SPEC_KEYS}
    if specs:
        transforms["core-metrics-extractor"] = lambda raw: _with_engine_specs(raw, specs)
    return transforms


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.capitalize() for part in rest)


def _with_engine_specs(raw: Mapping[str, Any], specs: Mapping[str, object]) -> dict[str, Any]:
    """``raw`` with the default engine's metric specs replaced by ``specs``: its entry in
    ``engineConfigs`` when configured, else a copy of the built-in engine of that name."""
    engine = raw.get("defaultEngine") or DEFAULT_ENGINE
    configs = [dict(c) for c in raw.get("engineConfigs") or () if isinstance(c, Mapping)]
    entry = next((c for c in configs if c.get("name") == engine), None)
    if entry is None:
        builtin = BUILTIN_ENGINES.get(engine, EngineConfig(name=engine))
        entry = {_camel(f.name): getattr(builtin, f.name) for f in dataclasses.fields(builtin)}
        configs.append(entry)
    entry.update(specs)
    return {**raw, "engineConfigs": configs}
