"""The plugin framework shared by every extension point."""

from domain.plugins.base import (
    Duration,
    EmptyParameters,
    Plugin,
    PluginConfigError,
    PluginFactory,
    PluginRegistry,
    PluginSpec,
    Quantity,
    TypedName,
    class_factory,
    parameter_names,
    plugins_with,
)
from domain.plugins.handle import Handle

__all__ = [
    "Duration",
    "EmptyParameters",
    "Handle",
    "Plugin",
    "PluginConfigError",
    "PluginFactory",
    "PluginRegistry",
    "PluginSpec",
    "Quantity",
    "TypedName",
    "class_factory",
    "parameter_names",
    "plugins_with",
]
