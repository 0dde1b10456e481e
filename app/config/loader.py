"""Loading an EndpointPickerConfig: decode, instantiate plugins, apply defaults, validate.

``load_config`` turns the YAML text into the running objects: every plugin (configured,
defaulted and auto-created data producers), the scheduler profiles, the profile handler,
parser and saturation detector, the request-control hook lists in order, the data-layer
wiring and the flow-control section. Every problem raises one ``ConfigError`` whose message
starts with the path of the offending entry (``plugins[2].parameters.blockSizeTokens: must
be > 0``); the process refuses to start on it.

Order of work: configured plugins (config order); ``max-score-picker`` when no picker is
configured; the flow-control policy plugins whose types are registered; the parser and the
saturation detector (referenced or defaulted; a configured plugin of the default type is
reused); the profiles (or the ``default`` profile of every configured filter, scorer and
picker); the profile handler; the data layer; the flow-control section; last, the default
producer of every consumed data key nothing produces, built with the parameters the consumer
hands over (its ``producer_parameters()``, else its own ``parameters`` when they are of the
producer's parameters type).

Each concern has its module: ``decoding`` (YAML and schema), ``instances`` (building
plugins), ``profiles``, ``datalayer``, ``flowcontrol`` and ``producers``. The optional
plugin hooks they call are declared in ``domain.plugins.hooks``.

The reference's and the llm-d router's keys and plugin types this EPP does not act on are
in ``compatibility``: a type or key it refuses stops the load saying why; one it accepts
without an effect becomes a notice (``notices``), which ``load_config`` logs once per
process, so a config reload does not repeat it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from app.config.compatibility import NOOP_TYPES, gate_reason
from app.config.datalayer import DataLayerSpec, SourceSpec, build_data_layer
from app.config.decoding import decode, parse_yaml
from app.config.errors import ConfigError
from app.config.flowcontrol import add_policy_plugins, check_flow_control
from app.config.instances import PluginInstances
from app.config.notices import PROCESS_NOTICES, ConfigNotices, NoticeLog
from app.config.overrides import ConfigOverrides
from app.config.producers import add_missing_producers, check_producers, sorted_producers
from app.config.profiles import add_default_picker, build_profiles, choose_profile_handler
from app.config.schema import EndpointPickerConfigSpec, FlowControlSpec
from domain.plugins.base import Plugin, PluginRegistry, plugins_with
from domain.plugins.handle import Handle
from domain.plugins.hooks import ConfigNoticePlugin
from domain.requestcontrol.interfaces import (
    Admitter,
    DataProducer,
    Parser,
    PlacementClaimer,
    PreRequest,
    ResponseBodyProcessor,
    ResponseHeaderProcessor,
    SaturationDetector,
)
from domain.requestcontrol.parsers import ParserRouter
from domain.scheduling.interfaces import ProfileHandler
from domain.scheduling.profile import SchedulerProfile

__all__ = [
    "DEFAULT_CONFIG",
    "FEATURE_GATES",
    "REFERENCE_DEFAULT_CONFIG_TEXT",
    "ConfigError",
    "DataLayerSpec",
    "LoadedConfig",
    "ParsedConfig",
    "SourceSpec",
    "build_config",
    "load_config",
    "parse_config",
]

logger = logging.getLogger(__name__)

#: The feature gates the reference registers. ``dataLayer`` is accepted and has no effect.
FEATURE_GATES = ("dataLayer", "enableLegacyMetrics", "flowControl")
#: The llm-d router's gates that only name what this EPP always does (said when turned off).
NOOP_FEATURE_GATES = ("haPopulateNonLeaderDatastore",)

#: What runs without any config: "sticky until saturated", chosen from
#: ``tests.bench.routing_quality`` (README "Routing quality"): a request stays on the
#: endpoints holding at least ``affinityThreshold`` of its prefix
#: (``prefix-cache-affinity-filter``) unless their estimated TTFT is ``maxTTFTPenaltyMs``
#: worse than another's, then goes to the one with the fewest in-flight uncached tokens
#: counting this prompt's (``token-load-scorer``), among the endpoints whose scraped metrics
#: are fresh (``metrics-freshness-filter``: a new prefix avoids a server whose ``/metrics``
#: fails; a prefix sticky to it alone stays). The approximate prefix index remembers
#: ``lruCapacityPerServer`` blocks per endpoint (``autoTune: false``) rather than the
#: server's KV size, so a prefix keeps going back to the endpoint that had it. After
#: scheduling, ``kv-capacity-gate`` holds a request in the EPP while its endpoint's KV cache
#: has no room for it and lets the held ones in cache hits first (since 2026-11-25). The
#: reference's own default (queue 2, KV-cache utilization 2, prefix 3) is
#: ``REFERENCE_DEFAULT_CONFIG_TEXT``. The data-layer default is added like for any config without
#: a ``dataLayer`` section.
DEFAULT_CONFIG: dict[str, Any] = {
    "plugins": [
        {"type": "approx-prefix-cache-producer", "parameters": {"autoTune": False}},
        {"type": "inflight-load-producer", "parameters": {"addEstimatedOutputTokens": False}},
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

#: The reference's no-config default (``loader/defaults.go``), as a config document.
REFERENCE_DEFAULT_CONFIG_TEXT = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
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

DEFAULT_PARSER = "openai-parser"
#: Added beside the default parser when no parser is configured (``/v1/messages``).
ANTHROPIC_PARSER = "anthropic-parser"
DEFAULT_SATURATION_DETECTOR = "utilization-detector"


@dataclass(slots=True, kw_only=True)
class LoadedConfig:
    """Everything a loaded config instantiates, ready to wire into the app.

    ``plugins`` holds every plugin by name: configured ones in config order, then the
    defaulted and auto-created ones. Hook lists follow that order; ``data_producers`` is
    in dependency order. ``flow_control`` is set only when the ``flowControl`` gate is on.
    ``notices`` are the lines (log level, text) the load said about keys and plugins that
    have no effect here.
    """

    feature_gates: frozenset[str]
    plugins: dict[str, Plugin]
    profiles: dict[str, SchedulerProfile]
    profile_handler: ProfileHandler
    parser: Parser
    saturation_detector: SaturationDetector
    data_producers: list[DataProducer]
    admitters: list[Admitter]
    placement_claimers: list[PlacementClaimer]
    pre_request: list[PreRequest]
    response_header: list[ResponseHeaderProcessor]
    response_body: list[ResponseBodyProcessor]
    data_layer: DataLayerSpec | None
    flow_control: FlowControlSpec | None
    notices: tuple[tuple[int, str], ...] = ()


@dataclass(frozen=True, slots=True)
class ParsedConfig:
    """A config's text decoded and checked against the schema, nothing built yet:
    ``document`` is the YAML mapping (``None``: no document, the defaults), ``spec`` the
    typed config."""

    document: dict[str, Any] | None
    spec: EndpointPickerConfigSpec


def parse_config(text: str | None) -> ParsedConfig:
    """The YAML and schema half of a load: pure and thread-safe (a reload runs it in a
    worker thread), bounded in size and depth (``app.config.decoding``). ``None`` or blank
    text, or only comments, is the no-config default. Raises ``ConfigError``."""
    raw = parse_yaml(text)
    return ParsedConfig(raw, decode(DEFAULT_CONFIG if raw is None else raw))


def load_config(
    text: str | None,
    *,
    registry: PluginRegistry,
    handle: Handle,
    overrides: ConfigOverrides | None = None,
    notice_log: NoticeLog = PROCESS_NOTICES,
) -> LoadedConfig:
    """Builds the configuration described by ``text`` (YAML): ``parse_config`` then
    ``build_config``."""
    return build_config(
        parse_config(text),
        registry=registry,
        handle=handle,
        overrides=overrides,
        notice_log=notice_log,
    )


def build_config(
    parsed: ParsedConfig,
    *,
    registry: PluginRegistry,
    handle: Handle,
    overrides: ConfigOverrides | None = None,
    notice_log: NoticeLog = PROCESS_NOTICES,
) -> LoadedConfig:
    """Builds the configuration ``parsed`` describes (on the event loop: plugins subscribe to
    the datastore as they are built).

    Plugins are created with ``registry.create`` and added to ``handle`` as they are built,
    so a factory finds the plugins configured before it. ``overrides`` are the flags'
    changes (``app.config.overrides``). The notices of a config that loads are logged
    through ``notice_log``, each line once (the process's log unless one is given). Raises
    ``ConfigError``.
    """
    loaded = _build(PluginInstances(registry, handle, overrides), parsed.spec)
    notice_log.say(loaded.notices)
    logger.info(
        "config loaded: %d plugin(s), profiles %s, handler %s, parser %s, saturation %s",
        len(loaded.plugins),
        ", ".join(loaded.profiles),
        loaded.profile_handler.typed_name,
        loaded.parser.typed_name,
        loaded.saturation_detector.typed_name,
    )
    return loaded


def _build(instances: PluginInstances, spec: EndpointPickerConfigSpec) -> LoadedConfig:
    """One load, in the order the module docstring gives."""
    gates = instances.overrides.apply_gates(_feature_gates(spec, instances.notices), FEATURE_GATES)
    for index, entry in enumerate(spec.plugins):
        instances.configure(index, entry)
    configured = list(instances.plugins)
    add_default_picker(instances)
    scheduling_plugins = list(instances.plugins.values())
    add_policy_plugins(instances)
    parser = _parser(instances, spec)
    saturation_detector = _saturation_detector(instances, spec)
    profiles = build_profiles(instances, spec.scheduling_profiles, scheduling_plugins, configured)
    handler = choose_profile_handler(instances, profiles)
    data_layer = build_data_layer(
        instances, spec.data_layer, gates, llm_d=_llm_d_dialect(spec.api_version)
    )
    flow_control = check_flow_control(instances, spec.flow_control, gates)
    add_missing_producers(instances)
    check_producers(instances)
    plugins = list(instances.plugins.values())
    _plugin_notices(instances)
    return LoadedConfig(
        feature_gates=gates,
        plugins=dict(instances.plugins),
        profiles=profiles,
        profile_handler=handler,
        parser=parser,
        saturation_detector=saturation_detector,
        data_producers=sorted_producers(plugins),
        admitters=plugins_with(plugins, Admitter),
        placement_claimers=plugins_with(plugins, PlacementClaimer),
        pre_request=plugins_with(plugins, PreRequest),
        response_header=plugins_with(plugins, ResponseHeaderProcessor),
        response_body=plugins_with(plugins, ResponseBodyProcessor),
        data_layer=data_layer,
        flow_control=flow_control,
        notices=instances.notices.lines(),
    )


def _llm_d_dialect(api_version: str | None) -> bool:
    """Whether the document is written for the llm-d router (its ``apiVersion`` group),
    where a listed data source does not replace the default metrics source."""
    return api_version is not None and api_version.startswith("llm-d.ai/")


_TRUE = frozenset({"1", "t", "true"})
_FALSE = frozenset({"0", "f", "false"})


def _feature_gates(spec: EndpointPickerConfigSpec, notices: ConfigNotices) -> frozenset[str]:
    """The gates turned on: each entry is ``name``, ``name=true`` or ``name=false`` (a later
    entry wins). Gates known but without an effect here are accepted and said once."""
    known = (*FEATURE_GATES, *NOOP_FEATURE_GATES)
    values: dict[str, bool] = {}
    for index, entry in enumerate(spec.feature_gates):
        name, sep, text = entry.partition("=")
        name = name.strip()
        if name not in known:
            raise ConfigError(
                f'featureGates[{index}]: unknown feature gate "{name}" (known: {", ".join(known)})'
            )
        value = True
        if sep:
            word = text.strip().lower()
            if word not in _TRUE | _FALSE:
                raise ConfigError(
                    f'featureGates[{index}]: "{entry}": the value must be true or false'
                )
            value = word in _TRUE
        values[name] = value
    for name, value in values.items():
        if name == "dataLayer" and value:
            notices.ignored("featureGates: dataLayer", gate_reason("dataLayer"))
        elif name == "haPopulateNonLeaderDatastore" and not value:
            notices.ignored(
                "featureGates: haPopulateNonLeaderDatastore=false",
                "a standby replica here always discovers endpoints and collects metrics",
            )
    return frozenset(name for name, value in values.items() if value and name in FEATURE_GATES)


def _plugin_notices(instances: PluginInstances) -> None:
    """What the plugins say has no effect here (``ConfigNoticePlugin``), and plugin types
    accepted without an effect."""
    for plugin in instances.plugins.values():
        path = instances.path_of(plugin)
        kind = plugin.typed_name.type
        if kind in NOOP_TYPES:
            instances.notices.ignored(f"{path} ({kind})", NOOP_TYPES[kind])
        if isinstance(plugin, ConfigNoticePlugin):
            instances.notices.extend(
                (logging.INFO, f"{path}.parameters.{line}") for line in plugin.config_notices()
            )


def _parser(instances: PluginInstances, spec: EndpointPickerConfigSpec) -> Parser:
    """``requestHandler.parsers`` (several: a ``ParserRouter``), else the legacy ``parser``,
    else ``openai-parser`` plus, when registered, ``anthropic-parser``."""
    handler = spec.request_handler
    if handler is not None and handler.parsers:
        if spec.parser is not None:
            raise ConfigError("parser: give either parser or requestHandler.parsers, not both")
        parsers: list[Parser] = [
            instances.section_ref(
                ref.plugin_ref, f"requestHandler.parsers[{i}].pluginRef", Parser, "parser"
            )
            for i, ref in enumerate(handler.parsers)
        ]
        names = [p.typed_name.name for p in parsers]
        for i, name in enumerate(names):
            if name in names[:i]:
                raise ConfigError(f'requestHandler.parsers[{i}]: "{name}" is listed twice')
        return parsers[0] if len(parsers) == 1 else ParserRouter(parsers)
    ref = spec.parser
    if ref is not None:
        found: Parser = instances.section_ref(ref.plugin_ref, "parser.pluginRef", Parser, "parser")
        return found
    parser: Parser = instances.required_default(DEFAULT_PARSER, "parser", Parser, "parser")
    if ANTHROPIC_PARSER not in instances.registry:
        return parser
    anthropic: Parser = instances.required_default(ANTHROPIC_PARSER, "parser", Parser, "parser")
    return ParserRouter([parser, anthropic])


def _saturation_detector(
    instances: PluginInstances, spec: EndpointPickerConfigSpec
) -> SaturationDetector:
    """``flowControl.saturationDetector`` (whether or not flow control is on), else the
    top-level ``saturationDetector``, else ``utilization-detector``; a section without a
    ``pluginRef`` means the default."""
    top = spec.saturation_detector
    nested = spec.flow_control.saturation_detector if spec.flow_control is not None else None
    path = "saturationDetector"
    ref = top
    if nested is not None:
        path, ref = "flowControl.saturationDetector", nested
        if top is not None and top.plugin_ref != nested.plugin_ref:
            instances.notices.note(
                "saturationDetector",
                "not used: flowControl.saturationDetector is set and wins",
                logging.WARNING,
            )
    if ref is not None and ref.plugin_ref is not None:
        found: SaturationDetector = instances.section_ref(
            ref.plugin_ref, f"{path}.pluginRef", SaturationDetector, "saturation detector"
        )
        return found
    detector: SaturationDetector = instances.required_default(
        DEFAULT_SATURATION_DETECTOR, path, SaturationDetector, "saturation detector"
    )
    return detector
