"""The data layer: which sources are polled or watched and which extractors each feeds.

Without a ``dataLayer`` section the default source and extractor are used (configured
plugins of their types are reused), unless the ``enableLegacyMetrics`` gate is on or their
types are not registered. With one, its sources are used, and the default source is added
beside them when ``injectDefaults`` is true and none of them is a ``metrics-data-source``;
``injectDefaults`` unset means true for a document of the llm-d router (``apiVersion``
``llm-d.ai/*``, which adds it) and false otherwise (the reference does not). Every
source/extractor pair is checked: the source's own ``validate_extractor``
(``ValidatingDataSource``), a notification source's GVK against its extractors', and the
source's output type against what the extractor reads. A polling source is polled every
``dataLayer.sources[].interval``, or its own ``interval`` parameter
(``PollIntervalSource``), or the collectors' interval.

The llm-d router's ``discovery``, ``peerDiscovery`` and ``crossReplicaSyncerPluginRef``
name plugin kinds this EPP does not have: they are refused, saying why;
``crossReplicaSyncInterval`` is accepted and said to have no effect.
"""

from __future__ import annotations

from dataclasses import dataclass

from app.config.compatibility import ignored_reason, refused_reason
from app.config.errors import ConfigError
from app.config.instances import PluginInstances, describe
from app.config.schema import DataLayerSection, DataSourceSpec
from domain.datalayer.interfaces import NotificationExtractor
from domain.plugins.base import Plugin
from domain.plugins.hooks import (
    PollIntervalSource,
    TypedExtractor,
    TypedSource,
    ValidatingDataSource,
)
from ports.datalayer import NotificationSource, PollingDataSource

__all__ = [
    "DEFAULT_DATA_SOURCE",
    "DEFAULT_EXTRACTOR",
    "DataLayerSpec",
    "SourceSpec",
    "build_data_layer",
]

DEFAULT_DATA_SOURCE = "metrics-data-source"
DEFAULT_EXTRACTOR = "core-metrics-extractor"


@dataclass(frozen=True, slots=True, kw_only=True)
class SourceSpec:
    """One data source and the extractors it feeds, in order; ``interval``: seconds between
    polls of a polling source (``None``: the collectors' interval)."""

    source: Plugin
    extractors: list[Plugin]
    interval: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class DataLayerSpec:
    """The data-layer wiring. No sources: metric collection is off."""

    sources: list[SourceSpec]


def build_data_layer(
    instances: PluginInstances,
    section: DataLayerSection | None,
    gates: frozenset[str],
    *,
    llm_d: bool = False,
) -> DataLayerSpec | None:
    """The wiring ``section`` describes, or the default; ``None``: no data layer.
    ``llm_d``: the document is the llm-d router's (see the module docstring)."""
    if section is None:
        default = _default_source(instances, "dataLayer", gates)
        return None if default is None else DataLayerSpec(sources=[default])
    _refuse_unavailable(section)
    if section.cross_replica_sync_interval is not None:
        instances.notices.ignored(
            "dataLayer.crossReplicaSyncInterval",
            ignored_reason("dataLayer.crossReplicaSyncInterval"),
        )
    sources: list[SourceSpec] = []
    seen: set[str] = set()
    for index, source_spec in enumerate(section.sources):
        path = f"dataLayer.sources[{index}]"
        source = instances.ref(source_spec.plugin_ref, f"{path}.pluginRef")
        if source_spec.plugin_ref in seen:
            raise ConfigError(
                f'{path}.pluginRef: source "{source_spec.plugin_ref}" is listed twice'
            )
        seen.add(source_spec.plugin_ref)
        extractors: list[Plugin] = []
        for extractor_index, extractor_spec in enumerate(source_spec.extractors):
            extractor_path = f"{path}.extractors[{extractor_index}].pluginRef"
            extractor = instances.ref(extractor_spec.plugin_ref, extractor_path)
            _validate_extractor(source, extractor, extractor_path)
            extractors.append(extractor)
        sources.append(
            SourceSpec(
                source=source,
                extractors=extractors,
                interval=_interval(source, source_spec, path),
            )
        )
    inject = section.inject_defaults if section.inject_defaults is not None else llm_d
    if inject and not any(s.source.typed_name.type == DEFAULT_DATA_SOURCE for s in sources):
        default = _default_source(instances, "dataLayer.injectDefaults", gates)
        if default is not None:
            sources.append(default)
    return DataLayerSpec(sources=sources)


def _default_source(
    instances: PluginInstances, path: str, gates: frozenset[str]
) -> SourceSpec | None:
    """The default metrics source and extractor (configured ones reused), unless the
    ``enableLegacyMetrics`` gate is on or their types are not registered."""
    if "enableLegacyMetrics" in gates:
        return None
    registry = instances.registry
    if DEFAULT_DATA_SOURCE not in registry or DEFAULT_EXTRACTOR not in registry:
        return None
    source = instances.default(DEFAULT_DATA_SOURCE, path)
    extractor = instances.default(DEFAULT_EXTRACTOR, path)
    _validate_extractor(source, extractor, path)
    return SourceSpec(source=source, extractors=[extractor], interval=_own_interval(source))


def _refuse_unavailable(section: DataLayerSection) -> None:
    for key, given in (
        ("discovery", section.discovery),
        ("peerDiscovery", section.peer_discovery),
        ("crossReplicaSyncerPluginRef", section.cross_replica_syncer_plugin_ref),
    ):
        if given is not None:
            raise ConfigError(
                f"dataLayer.{key}: not available in this EPP: {refused_reason(f'dataLayer.{key}')}"
            )


def _own_interval(source: Plugin) -> float | None:
    if isinstance(source, PollIntervalSource):
        return source.poll_interval() or None
    return None


def _interval(source: Plugin, spec: DataSourceSpec, path: str) -> float | None:
    """The source's polling interval: ``interval`` in its entry or its own parameter."""
    own = _own_interval(source)
    given = spec.interval or None
    if given is None:
        return own
    if not isinstance(source, PollingDataSource):
        raise ConfigError(
            f"{path}.interval: source {describe(source)} is not polled (it is notified of "
            "changes), so it takes no interval"
        )
    if own is not None and own != given:
        raise ConfigError(
            f"{path}.interval: {given:g}s, but the source's own interval parameter is "
            f"{own:g}s; give one of them"
        )
    return given


def _validate_extractor(source: Plugin, extractor: Plugin, path: str) -> None:
    """The source's own ``validate_extractor`` hook, then the generic checks: a
    notification source feeds only notification extractors of its GVK, and an extractor
    declaring ``expected_input_type`` needs a source whose ``output_type`` is that type
    (or a subclass; ``object`` takes anything)."""
    try:
        if isinstance(source, ValidatingDataSource):
            source.validate_extractor(extractor)
        if isinstance(source, NotificationSource):
            if not isinstance(extractor, NotificationExtractor):
                raise TypeError("it does not take notifications (no extract_notification)")
            if extractor.gvk() != source.gvk():
                raise ValueError(
                    f'GVK mismatch: the extractor expects "{extractor.gvk()}", '
                    f'the source watches "{source.gvk()}"'
                )
        if isinstance(source, TypedSource) and isinstance(extractor, TypedExtractor):
            produced, expected = source.output_type(), extractor.expected_input_type()
            if expected is not object and not issubclass(produced, expected):
                raise TypeError(
                    f"the extractor reads {expected.__name__}, "
                    f"the source produces {produced.__name__}"
                )
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"{path}: extractor {describe(extractor)} cannot be fed by source "
            f"{describe(source)}: {exc}"
        ) from exc
