"""The data layer: which sources are polled or watched and which extractors each feeds.

Without a ``dataLayer`` section the default source and extractor are used (configured
plugins of their types are reused), unless the ``enableLegacyMetrics`` gate is on or their
types are not registered. Every source/extractor pair is checked: the source's own
``validate_extractor`` (``ValidatingDataSource``), a notification source's GVK against its
extractors', and the source's output type against what the extractor reads.
"""

from __future__ import annotations

from dataclasses import dataclass

from app.config.errors import ConfigError
from app.config.instances import PluginInstances, describe
from app.config.schema import DataLayerSection
from domain.datalayer.interfaces import NotificationExtractor
from domain.plugins.base import Plugin
from domain.plugins.hooks import TypedExtractor, TypedSource, ValidatingDataSource
from ports.datalayer import NotificationSource

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
    """One data source and the extractors it feeds, in order."""

    source: Plugin
    extractors: list[Plugin]


@dataclass(frozen=True, slots=True, kw_only=True)
class DataLayerSpec:
    """The data-layer wiring. No sources: metric collection is off."""

    sources: list[SourceSpec]


def build_data_layer(
    instances: PluginInstances, section: DataLayerSection | None, gates: frozenset[str]
) -> DataLayerSpec | None:
    """The wiring ``section`` describes, or the default; ``None``: no data layer."""
    if section is None:
        if "enableLegacyMetrics" in gates:
            return None
        registry = instances.registry
        if DEFAULT_DATA_SOURCE not in registry or DEFAULT_EXTRACTOR not in registry:
            return None
        source = instances.default(DEFAULT_DATA_SOURCE, "dataLayer")
        extractor = instances.default(DEFAULT_EXTRACTOR, "dataLayer")
        _validate_extractor(source, extractor, "dataLayer")
        return DataLayerSpec(sources=[SourceSpec(source=source, extractors=[extractor])])
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
        sources.append(SourceSpec(source=source, extractors=extractors))
    return DataLayerSpec(sources=sources)


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
