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
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, is_dataclass
from typing import Any

import yaml
from pydantic import ValidationError

from app.config.parameters import ParameterError, render_validation_error, validate_parameters
from app.config.schema import (
    EndpointPickerConfigSpec,
    FlowControlSpec,
    PluginEntry,
    PluginRefSpec,
)
from domain.datalayer.interfaces import NotificationExtractor
from domain.plugins.base import (
    Plugin,
    PluginConfigError,
    PluginRegistry,
    parameter_names,
    plugins_with,
)
from domain.plugins.handle import Handle
from domain.requestcontrol.interfaces import (
    Admitter,
    DataProducer,
    Parser,
    PreRequest,
    ResponseBodyProcessor,
    ResponseHeaderProcessor,
    SaturationDetector,
)
from domain.scheduling.interfaces import Filter, Picker, ProfileHandler, Scorer
from domain.scheduling.profile import SchedulerProfile, WeightedScorer
from ports.datalayer import NotificationSource

__all__ = [
    "DEFAULT_CONFIG",
    "FEATURE_GATES",
    "ConfigError",
    "DataLayerSpec",
    "LoadedConfig",
    "SourceSpec",
    "load_config",
]

logger = logging.getLogger(__name__)

#: The feature gates the reference registers. ``dataLayer`` is accepted and has no effect.
FEATURE_GATES = ("dataLayer", "enableLegacyMetrics", "flowControl")

#: What runs without any config (the reference's ``loader/defaults.go``); the data-layer
#: default is added like for any config without a ``dataLayer`` section.
DEFAULT_CONFIG: dict[str, Any] = {
    "plugins": [
        {"type": "queue-scorer"},
        {"type": "kv-cache-utilization-scorer"},
        {"type": "prefix-cache-scorer"},
    ],
    "schedulingProfiles": [
        {
            "name": "default",
            "plugins": [
                {"pluginRef": "queue-scorer", "weight": 2.0},
                {"pluginRef": "kv-cache-utilization-scorer", "weight": 2.0},
                {"pluginRef": "prefix-cache-scorer", "weight": 3.0},
            ],
        }
    ],
}

DEFAULT_PICKER = "max-score-picker"
DEFAULT_PROFILE_HANDLER = "single-profile-handler"
DEFAULT_PARSER = "openai-parser"
DEFAULT_SATURATION_DETECTOR = "utilization-detector"
DEFAULT_DATA_SOURCE = "metrics-data-source"
DEFAULT_EXTRACTOR = "core-metrics-extractor"
DEFAULT_PROFILE = "default"
#: Flow-control policy plugins always added (when their types are registered).
FLOW_CONTROL_POLICIES = (
    "fcfs-ordering-policy",
    "global-strict-fairness-policy",
    "static-usage-limit-policy",
)


class ConfigError(ValueError):
    """The configuration is invalid. The message starts with the offending entry's path."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SourceSpec:
    """One data source and the extractors it feeds, in order."""

    source: Plugin
    extractors: list[Plugin]


@dataclass(frozen=True, slots=True, kw_only=True)
class DataLayerSpec:
    """The data-layer wiring. No sources: metric collection is off."""

    sources: list[SourceSpec]


@dataclass(slots=True, kw_only=True)
class LoadedConfig:
    """Everything a loaded config instantiates, ready to wire into the app.

    ``plugins`` holds every plugin by name: configured ones in config order, then the
    defaulted and auto-created ones. Hook lists follow that order; ``data_producers`` is
    in dependency order. ``flow_control`` is set only when the ``flowControl`` gate is on.
    """

    feature_gates: frozenset[str]
    plugins: dict[str, Plugin]
    profiles: dict[str, SchedulerProfile]
    profile_handler: ProfileHandler
    parser: Parser
    saturation_detector: SaturationDetector
    data_producers: list[DataProducer]
    admitters: list[Admitter]
    pre_request: list[PreRequest]
    response_header: list[ResponseHeaderProcessor]
    response_body: list[ResponseBodyProcessor]
    data_layer: DataLayerSpec | None
    flow_control: FlowControlSpec | None


def load_config(text: str | None, *, registry: PluginRegistry, handle: Handle) -> LoadedConfig:
    """Builds the configuration described by ``text`` (YAML); ``None`` or blank text (or a
    document with nothing but comments) gives the no-config defaults.

    Plugins are created with ``registry.create`` and added to ``handle`` as they are built,
    so a factory finds the plugins configured before it. Raises ``ConfigError``.
    """
    raw = _parse_yaml(text)
    spec = _decode(DEFAULT_CONFIG if raw is None else raw)
    loaded = _Builder(registry, handle, spec).build()
    logger.info(
        "config loaded: %d plugin(s), profiles %s, handler %s, parser %s, saturation %s",
        len(loaded.plugins),
        ", ".join(loaded.profiles),
        loaded.profile_handler.typed_name,
        loaded.parser.typed_name,
        loaded.saturation_detector.typed_name,
    )
    return loaded


class _StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key repeated in one mapping (strict decoding)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                repeated = key in seen
            except TypeError:  # unhashable: the base class reports it
                continue
            if repeated:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping",
                    node.start_mark,
                    f"found duplicate key {key!r}",
                    key_node.start_mark,
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _parse_yaml(text: str | None) -> dict[str, Any] | None:
    if text is None or not text.strip():
        return None
    try:
        raw = yaml.load(text, Loader=_StrictLoader)  # a SafeLoader subclass
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"config: invalid YAML{where}: {exc.problem or exc.context}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config: invalid YAML: {exc}") from None
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ConfigError(f"config: must be a mapping, got {type(raw).__name__}")
    return raw


def _decode(raw: dict[str, Any]) -> EndpointPickerConfigSpec:
    try:
        return EndpointPickerConfigSpec.model_validate(raw)
    except ValidationError as exc:
        path, reason = render_validation_error(exc)
        if path == "data" and reason == "unknown field":
            reason = "unknown field (the data-layer section is called dataLayer)"
        raise ConfigError(f"{path or 'config'}: {reason}") from None


def _keys(declared: Iterable[Any]) -> list[str]:
    """Data keys from ``produces()``/``consumes()`` (a sequence or a mapping's keys)."""
    return [str(key) for key in declared]


def _declared(plugin: Plugin, method: str) -> list[str]:
    call = getattr(plugin, method, None)
    return _keys(call()) if callable(call) else []


def _describe(plugin: Plugin) -> str:
    return f'"{plugin.typed_name.name}" (type {plugin.typed_name.type})'


class _Builder:
    """One load: the plugins built so far and where each came from (its config path)."""

    def __init__(
        self, registry: PluginRegistry, handle: Handle, spec: EndpointPickerConfigSpec
    ) -> None:
        self.registry = registry
        self.handle = handle
        self.spec = spec
        self.plugins: dict[str, Plugin] = {}
        self.origin: dict[str, str] = {}

    # -- building blocks -------------------------------------------------------------------

    def _create(self, type_name: str, name: str, parameters: Any, path: str) -> Plugin:
        try:
            plugin = self.registry.create(type_name, name, parameters, self.handle)
        except (PluginConfigError, ValueError) as exc:
            raise ConfigError(self._factory_error(type_name, path, str(exc))) from exc
        if plugin.typed_name.name != name:
            raise ConfigError(
                f'{path}: plugin type "{type_name}" built a plugin named '
                f'"{plugin.typed_name.name}", expected "{name}"'
            )
        try:
            self.handle.add_plugin(plugin)
        except PluginConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from exc
        self.plugins[name] = plugin
        self.origin[name] = path
        return plugin

    def _factory_error(self, type_name: str, path: str, message: str) -> str:
        """A factory's ``"<camelCaseKey>: why"`` is placed under ``parameters``."""
        if path.startswith("plugins["):
            key, sep, reason = message.partition(":")
            parameters_type = self.registry.spec(type_name).parameters
            keys = parameter_names(parameters_type) if is_dataclass(parameters_type) else {}
            if sep and key.strip() in keys:
                return f"{path}.parameters.{key.strip()}:{reason}"
        return f"{path}: {message}"

    def _ref(self, name: str, path: str) -> Plugin:
        plugin = self.plugins.get(name)
        if plugin is None:
            raise ConfigError(f'{path}: no plugin named "{name}"')
        return plugin

    def _path_of(self, plugin: Plugin) -> str:
        return self.origin.get(plugin.typed_name.name, "plugins")

    def _default(self, type_name: str, path: str) -> Plugin:
        """The first plugin of ``type_name``, created (named by its type) when none exists."""
        for plugin in self.plugins.values():
            if plugin.typed_name.type == type_name:
                return plugin
        if type_name not in self.registry:
            raise ConfigError(f'{path}: the default plugin type "{type_name}" is not registered')
        taken = self.plugins.get(type_name)
        if taken is not None:
            raise ConfigError(
                f'{self._path_of(taken)}: the name "{type_name}" is taken by a plugin of type '
                f'"{taken.typed_name.type}", so the default "{type_name}" cannot be added'
            )
        return self._create(type_name, type_name, None, path)

    def _required_default(self, type_name: str, path: str, kind: type[Any], what: str) -> Any:
        plugin = self._default(type_name, path)
        if not isinstance(plugin, kind):
            raise ConfigError(f"{path}: the default plugin {_describe(plugin)} is not a {what}")
        return plugin

    # -- sections --------------------------------------------------------------------------

    def build(self) -> LoadedConfig:
        gates = self._feature_gates()
        for index, entry in enumerate(self.spec.plugins):
            self._configure(index, entry)
        configured = list(self.plugins)
        if not plugins_with(self.plugins.values(), Picker):
            self._required_default(DEFAULT_PICKER, "schedulingProfiles", Picker, "picker")
        scheduling_plugins = list(self.plugins.values())
        for policy in FLOW_CONTROL_POLICIES:
            if policy in self.registry:
                self._default(policy, "flowControl")
        parser = self._parser()
        saturation_detector = self._saturation_detector()
        profiles = self._profiles(scheduling_plugins, configured)
        handler = self._profile_handler(profiles)
        data_layer = self._data_layer(gates)
        flow_control = self._flow_control(gates)
        self._add_missing_producers()
        plugins = list(self.plugins.values())
        return LoadedConfig(
            feature_gates=gates,
            plugins=dict(self.plugins),
            profiles=profiles,
            profile_handler=handler,
            parser=parser,
            saturation_detector=saturation_detector,
            data_producers=self._sorted_producers(),
            admitters=plugins_with(plugins, Admitter),
            pre_request=plugins_with(plugins, PreRequest),
            response_header=plugins_with(plugins, ResponseHeaderProcessor),
            response_body=plugins_with(plugins, ResponseBodyProcessor),
            data_layer=data_layer,
            flow_control=flow_control,
        )

    def _feature_gates(self) -> frozenset[str]:
        for index, gate in enumerate(self.spec.feature_gates):
            if gate not in FEATURE_GATES:
                raise ConfigError(
                    f'featureGates[{index}]: unknown feature gate "{gate}" '
                    f"(known: {', '.join(FEATURE_GATES)})"
                )
        return frozenset(self.spec.feature_gates)

    def _configure(self, index: int, entry: PluginEntry) -> None:
        path = f"plugins[{index}]"
        if entry.type not in self.registry:
            raise ConfigError(f'{path}.type: unknown plugin type "{entry.type}"')
        parameters_type = self.registry.spec(entry.type).parameters
        try:
            parameters = validate_parameters(parameters_type, entry.parameters)
        except ParameterError as exc:
            where = f"{path}.parameters"
            if exc.path:
                where += exc.path if exc.path.startswith("[") else f".{exc.path}"
            raise ConfigError(f"{where}: {exc.reason}") from None
        # A type may name its unnamed instances after their parameters (e.g. a GVK).
        default_name = getattr(parameters, "default_name", None)
        name = entry.name or (default_name() if callable(default_name) else entry.type)
        if name in self.plugins:
            raise ConfigError(f'{path}.name: duplicate plugin name "{name}"')
        self._create(entry.type, name, parameters, path)

    def _parser(self) -> Parser:
        ref = self.spec.parser
        if ref is not None:
            found: Parser = self._section_ref(ref, "parser.pluginRef", Parser, "parser")
            return found
        parser: Parser = self._required_default(DEFAULT_PARSER, "parser", Parser, "parser")
        return parser

    def _saturation_detector(self) -> SaturationDetector:
        ref = self.spec.saturation_detector
        path = "saturationDetector"
        if ref is not None:
            found: SaturationDetector = self._section_ref(
                ref, f"{path}.pluginRef", SaturationDetector, "saturation detector"
            )
            return found
        detector: SaturationDetector = self._required_default(
            DEFAULT_SATURATION_DETECTOR, path, SaturationDetector, "saturation detector"
        )
        return detector

    def _section_ref(self, ref: PluginRefSpec, path: str, kind: type[Any], what: str) -> Any:
        plugin = self._ref(ref.plugin_ref, path)
        if not isinstance(plugin, kind):
            raise ConfigError(f"{path}: plugin {_describe(plugin)} is not a {what}")
        return plugin

    # -- scheduling ------------------------------------------------------------------------

    def _profiles(
        self, scheduling_plugins: Sequence[Plugin], configured: Sequence[str]
    ) -> dict[str, SchedulerProfile]:
        if not self.spec.scheduling_profiles:
            return {DEFAULT_PROFILE: self._default_profile(scheduling_plugins)}
        profiles: dict[str, SchedulerProfile] = {}
        referenced: set[str] = set()
        first_picker = next(iter(plugins_with(self.plugins.values(), Picker)))
        for index, profile_spec in enumerate(self.spec.scheduling_profiles):
            path = f"schedulingProfiles[{index}]"
            name = profile_spec.name
            if not name:
                raise ConfigError(f"{path}.name: must not be empty")
            if name in profiles:
                raise ConfigError(f'{path}.name: duplicate profile name "{name}"')
            filters: list[Filter] = []
            scorers: list[WeightedScorer] = []
            picker: Picker | None = None
            members: set[str] = set()
            for ref_index, ref in enumerate(profile_spec.plugins):
                ref_path = f"{path}.plugins[{ref_index}]"
                plugin = self._ref(ref.plugin_ref, f"{ref_path}.pluginRef")
                if ref.plugin_ref in members:
                    raise ConfigError(
                        f'{ref_path}.pluginRef: plugin "{ref.plugin_ref}" is already in '
                        f'profile "{name}"'
                    )
                members.add(ref.plugin_ref)
                is_filter = isinstance(plugin, Filter)
                is_scorer = isinstance(plugin, Scorer)
                is_picker = isinstance(plugin, Picker)
                if not (is_filter or is_scorer or is_picker):
                    raise ConfigError(
                        f"{ref_path}.pluginRef: plugin {_describe(plugin)} is not a filter, "
                        "scorer or picker"
                    )
                weight = 1.0 if ref.weight is None else ref.weight
                if not math.isfinite(weight):
                    raise ConfigError(f"{ref_path}.weight: must be a finite number")
                if ref.weight is not None and not is_scorer:
                    logger.warning(
                        "%s.weight: plugin %s is not a scorer; its weight is ignored",
                        ref_path,
                        plugin.typed_name,
                    )
                if is_filter:
                    filters.append(plugin)  # type: ignore[arg-type]
                if is_scorer:
                    scorers.append(WeightedScorer(plugin, weight))  # type: ignore[arg-type]
                if is_picker:
                    if picker is not None:
                        raise ConfigError(
                            f'{ref_path}.pluginRef: profile "{name}" already has the picker '
                            f'"{picker.typed_name.name}"; only one picker is allowed'
                        )
                    picker = plugin  # type: ignore[assignment]
                referenced.add(ref.plugin_ref)
            profiles[name] = SchedulerProfile(
                name, filters=filters, scorers=scorers, picker=picker or first_picker
            )
        for plugin_name in configured:
            plugin = self.plugins[plugin_name]
            if isinstance(plugin, Scorer) and plugin_name not in referenced:
                raise ConfigError(
                    f'{self._path_of(plugin)}: scorer "{plugin_name}" is not used by any '
                    "scheduling profile"
                )
        return profiles

    def _default_profile(self, scheduling_plugins: Sequence[Plugin]) -> SchedulerProfile:
        """Every filter, scorer (weight 1) and picker, in plugin order."""
        filters: list[Filter] = []
        scorers: list[WeightedScorer] = []
        picker: Picker | None = None
        for plugin in scheduling_plugins:
            if isinstance(plugin, Filter):
                filters.append(plugin)
            if isinstance(plugin, Scorer):
                scorers.append(WeightedScorer(plugin, 1.0))
            if isinstance(plugin, Picker):
                if picker is not None:
                    raise ConfigError(
                        f"{self._path_of(plugin)}: the default profile would get a second "
                        f'picker "{plugin.typed_name.name}" (it has "{picker.typed_name.name}"); '
                        "configure schedulingProfiles"
                    )
                picker = plugin
        assert picker is not None  # a default picker was added when there was none
        return SchedulerProfile(DEFAULT_PROFILE, filters=filters, scorers=scorers, picker=picker)

    def _profile_handler(self, profiles: dict[str, SchedulerProfile]) -> ProfileHandler:
        handlers: list[ProfileHandler] = plugins_with(self.plugins.values(), ProfileHandler)
        if len(handlers) > 1:
            first, second = handlers[0], handlers[1]
            raise ConfigError(
                f'{self._path_of(second)}: a second profile handler "{second.typed_name.name}" '
                f'(the first is "{first.typed_name.name}"); exactly one is allowed'
            )
        if handlers:
            handler = handlers[0]
        elif len(profiles) == 1:
            handler = self._required_default(
                DEFAULT_PROFILE_HANDLER, "schedulingProfiles", ProfileHandler, "profile handler"
            )
        else:
            raise ConfigError(
                f"schedulingProfiles: {len(profiles)} profiles need a profile handler; "
                "configure one in plugins"
            )
        path = self._path_of(handler)
        if handler.typed_name.type == DEFAULT_PROFILE_HANDLER and len(profiles) > 1:
            raise ConfigError(
                f'{path}: {DEFAULT_PROFILE_HANDLER} "{handler.typed_name.name}" allows exactly '
                f"one scheduling profile, the config has {len(profiles)}"
            )
        validate = getattr(handler, "validate_profiles", None)
        if callable(validate):
            try:
                validate(list(profiles))
            except ValueError as exc:
                raise ConfigError(f"{path}: {exc}") from exc
        return handler

    # -- data ------------------------------------------------------------------------------

    def _data_layer(self, gates: frozenset[str]) -> DataLayerSpec | None:
        section = self.spec.data_layer
        if section is None:
            if "enableLegacyMetrics" in gates:
                return None
            if DEFAULT_DATA_SOURCE not in self.registry or DEFAULT_EXTRACTOR not in self.registry:
                return None
            source = self._default(DEFAULT_DATA_SOURCE, "dataLayer")
            extractor = self._default(DEFAULT_EXTRACTOR, "dataLayer")
            self._validate_extractor(source, extractor, "dataLayer")
            return DataLayerSpec(sources=[SourceSpec(source=source, extractors=[extractor])])
        sources: list[SourceSpec] = []
        seen: set[str] = set()
        for index, source_spec in enumerate(section.sources):
            path = f"dataLayer.sources[{index}]"
            source = self._ref(source_spec.plugin_ref, f"{path}.pluginRef")
            if source_spec.plugin_ref in seen:
                raise ConfigError(
                    f'{path}.pluginRef: source "{source_spec.plugin_ref}" is listed twice'
                )
            seen.add(source_spec.plugin_ref)
            extractors: list[Plugin] = []
            for extractor_index, extractor_spec in enumerate(source_spec.extractors):
                extractor_path = f"{path}.extractors[{extractor_index}].pluginRef"
                extractor = self._ref(extractor_spec.plugin_ref, extractor_path)
                self._validate_extractor(source, extractor, extractor_path)
                extractors.append(extractor)
            sources.append(SourceSpec(source=source, extractors=extractors))
        return DataLayerSpec(sources=sources)

    @staticmethod
    def _validate_extractor(source: Plugin, extractor: Plugin, path: str) -> None:
        """The source's own ``validate_extractor`` hook, then the generic checks: a
        notification source feeds only notification extractors of its GVK, and an extractor
        declaring ``expected_input_type`` needs a source whose ``output_type`` is that type
        (or a subclass; ``object`` takes anything)."""
        try:
            validate = getattr(source, "validate_extractor", None)
            if callable(validate):
                validate(extractor)
            if isinstance(source, NotificationSource):
                if not isinstance(extractor, NotificationExtractor):
                    raise TypeError("it does not take notifications (no extract_notification)")
                if extractor.gvk() != source.gvk():
                    raise ValueError(
                        f'GVK mismatch: the extractor expects "{extractor.gvk()}", '
                        f'the source watches "{source.gvk()}"'
                    )
            output_type = getattr(source, "output_type", None)
            expected_type = getattr(extractor, "expected_input_type", None)
            if callable(output_type) and callable(expected_type):
                produced, expected = output_type(), expected_type()
                if expected is not object and not issubclass(produced, expected):
                    raise TypeError(
                        f"the extractor reads {expected.__name__}, "
                        f"the source produces {produced.__name__}"
                    )
        except (TypeError, ValueError) as exc:
            raise ConfigError(
                f"{path}: extractor {_describe(extractor)} cannot be fed by source "
                f"{_describe(source)}: {exc}"
            ) from exc

    def _flow_control(self, gates: frozenset[str]) -> FlowControlSpec | None:
        section = self.spec.flow_control
        if section is not None:
            path = "flowControl"
            band = section.default_priority_band
            if band is not None:
                self._policy_refs(
                    band.fairness_policy_ref,
                    band.ordering_policy_ref,
                    f"{path}.defaultPriorityBand.",
                )
            priorities: set[int] = set()
            for index, priority_band in enumerate(section.priority_bands):
                band_path = f"{path}.priorityBands[{index}]."
                if priority_band.priority in priorities:
                    raise ConfigError(
                        f"{band_path}priority: duplicate priority {priority_band.priority}"
                    )
                priorities.add(priority_band.priority)
                self._policy_refs(
                    priority_band.fairness_policy_ref, priority_band.ordering_policy_ref, band_path
                )
            if section.usage_limit_policy_plugin_ref is not None:
                self._ref(
                    section.usage_limit_policy_plugin_ref, f"{path}.usageLimitPolicyPluginRef"
                )
        if "flowControl" not in gates:
            if section is not None:
                logger.warning("flowControl: ignored, the flowControl feature gate is off")
            return None
        return section if section is not None else FlowControlSpec()

    def _policy_refs(self, fairness: str | None, ordering: str | None, prefix: str) -> None:
        if fairness is not None:
            self._ref(fairness, f"{prefix}fairnessPolicyRef")
        if ordering is not None:
            self._ref(ordering, f"{prefix}orderingPolicyRef")

    def _add_missing_producers(self) -> None:
        """Creates the registered default producer of every consumed key nothing produces
        (repeatedly, since a new producer may consume keys of its own)."""
        while True:
            produced = {key for p in self.plugins.values() for key in _declared(p, "produces")}
            missing = next(
                (
                    (plugin, key)
                    for plugin in self.plugins.values()
                    for key in _declared(plugin, "consumes")
                    if key not in produced
                ),
                None,
            )
            if missing is None:
                return
            consumer, key = missing
            path = self._path_of(consumer)
            type_name = self.registry.default_producer_for(key)
            if type_name is None:
                raise ConfigError(
                    f'{path}: plugin "{consumer.typed_name.name}" consumes "{key}", which no '
                    "plugin produces and no plugin type is registered to produce"
                )
            if type_name in self.plugins:
                taken = self.plugins[type_name]
                raise ConfigError(
                    f'{self._path_of(taken)}: plugin "{type_name}" (type '
                    f'{taken.typed_name.type}) does not produce "{key}", which '
                    f'"{consumer.typed_name.name}" consumes; the default producer '
                    f'"{type_name}" cannot be added'
                )
            parameters = self._producer_parameters(consumer, type_name)
            producer = self._create(type_name, type_name, parameters, path)
            if key not in _declared(producer, "produces"):
                raise ConfigError(
                    f'{path}: the default producer "{type_name}" of "{key}" does not produce it'
                )
            logger.info(
                "added data producer %s for %s, consumed by %s",
                producer.typed_name,
                key,
                consumer.typed_name,
            )

    def _producer_parameters(self, consumer: Plugin, type_name: str) -> Any:
        """What the consumer wants its auto-created producer built with: the result of its
        ``producer_parameters()`` method, else its own ``parameters`` attribute, when either
        is an instance of the producer type's parameters class; ``None`` (the defaults)
        otherwise."""
        method = getattr(consumer, "producer_parameters", None)
        wanted = method() if callable(method) else getattr(consumer, "parameters", None)
        return wanted if isinstance(wanted, self.registry.spec(type_name).parameters) else None

    def _sorted_producers(self) -> list[DataProducer]:
        """DataProducers in dependency order (a consumer of K after K's producers); ties
        keep plugin order."""
        producers: list[DataProducer] = plugins_with(self.plugins.values(), DataProducer)
        producers_of: dict[str, list[DataProducer]] = {}
        for producer in producers:
            for key in _keys(producer.produces()):
                producers_of.setdefault(key, []).append(producer)
        depends: dict[str, list[DataProducer]] = {}
        for producer in producers:
            depends[producer.typed_name.name] = [
                other
                for key in _keys(producer.consumes())
                for other in producers_of.get(key, ())
                if other is not producer
            ]
        ordered: list[DataProducer] = []
        done: set[str] = set()
        pending = list(producers)
        while pending:
            ready = next(
                (
                    p
                    for p in pending
                    if all(d.typed_name.name in done for d in depends[p.typed_name.name])
                ),
                None,
            )
            if ready is None:
                cycle = self._cycle(depends, {p.typed_name.name for p in pending})
                raise ConfigError(f"plugins: data producers form a cycle: {cycle}")
            pending.remove(ready)
            ordered.append(ready)
            done.add(ready.typed_name.name)
        return ordered

    @staticmethod
    def _cycle(depends: dict[str, list[DataProducer]], blocked: set[str]) -> str:
        """One cycle among the ``blocked`` producers (each waits for another blocked one),
        as ``"a" -> "b" -> "a"``."""
        walk = [min(blocked)]
        while True:
            following = next(
                d.typed_name.name for d in depends[walk[-1]] if d.typed_name.name in blocked
            )
            if following in walk:
                cycle = [*walk[walk.index(following) :], following]
                return " -> ".join(f'"{name}"' for name in cycle)
            walk.append(following)
