"""Building the plugin registry: the in-tree types plus those of installed distributions.

An installed distribution adds plugin types by declaring an entry point in the
``epp.plugins`` group that names a callable ``register(registry)``::

    [project.entry-points."epp.plugins"]
    my-plugins = "my_package.epp:register"

The callable registers its types exactly like the in-tree modules do. A type registered
twice (by two distributions, or clashing with an in-tree type) stops start-up.
"""

from __future__ import annotations

import logging
from importlib.metadata import EntryPoint, entry_points

from adapters.prometheus.scrape import MetricsDataSource, MetricsSourceParameters
from domain.plugins.base import PluginRegistry, class_factory
from domain.plugins.intree import register_in_tree

__all__ = [
    "ENTRY_POINT_GROUP",
    "PluginLoadError",
    "build_registry",
    "load_entry_point_plugins",
    "register_adapter_plugins",
]

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "epp.plugins"


class PluginLoadError(RuntimeError):
    """An out-of-tree plugin entry point could not be loaded or registered."""


def _describe(entry_point: EntryPoint) -> str:
    dist = entry_point.dist
    origin = f" from {dist.name} {dist.version}" if dist is not None else ""
    return f'entry point "{entry_point.name} = {entry_point.value}"{origin}'


def load_entry_point_plugins(registry: PluginRegistry) -> list[str]:
    """Calls ``register(registry)`` of every ``epp.plugins`` entry point (ordered by
    name). Returns the plugin types they added. Raises ``PluginLoadError``."""
    added: list[str] = []
    found = sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: (ep.name, ep.value))
    for entry_point in found:
        before = set(registry.types())
        try:
            register = entry_point.load()
        except Exception as exc:
            raise PluginLoadError(f"{_describe(entry_point)}: cannot be loaded: {exc}") from exc
        if not callable(register):
            raise PluginLoadError(f"{_describe(entry_point)}: is not a callable register(registry)")
        try:
            register(registry)
        except ValueError as exc:
            raise PluginLoadError(f"{_describe(entry_point)}: {exc}") from exc
        new = sorted(set(registry.types()) - before)
        logger.info("%s registered plugin types: %s", _describe(entry_point), ", ".join(new))
        added.extend(new)
    return added


def register_adapter_plugins(registry: PluginRegistry) -> None:
    """The in-tree plugin types backed by adapters (they talk to the outside world)."""
    registry.register(
        "metrics-data-source",
        class_factory("metrics-data-source", MetricsDataSource),
        parameters=MetricsSourceParameters,
        description="polls each endpoint's Prometheus /metrics over HTTP",
    )


def build_registry(*, include_entry_points: bool = True) -> PluginRegistry:
    """A registry with every in-tree plugin type and, unless told otherwise, the types of
    installed distributions' ``epp.plugins`` entry points."""
    registry = PluginRegistry()
    register_in_tree(registry)
    register_adapter_plugins(registry)
    if include_entry_points:
        load_entry_point_plugins(registry)
    return registry
