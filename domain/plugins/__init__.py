"""The plugin framework shared by every extension point, and the optional loader hooks."""

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
from domain.plugins.hooks import (
    ConsumerPlugin,
    NamingParameters,
    ParameterizedPlugin,
    ProducerParametersProvider,
    ProducerPlugin,
    TypedExtractor,
    TypedSource,
    ValidatingDataSource,
    ValidatingProfileHandler,
)

__all__ = [
    "ConsumerPlugin",
    "Duration",
    "EmptyParameters",
    "Handle",
    "NamingParameters",
    "ParameterizedPlugin",
    "Plugin",
    "PluginConfigError",
    "PluginFactory",
    "PluginRegistry",
    "PluginSpec",
    "ProducerParametersProvider",
    "ProducerPlugin",
    "Quantity",
    "TypedExtractor",
    "TypedName",
    "TypedSource",
    "ValidatingDataSource",
    "ValidatingProfileHandler",
    "class_factory",
    "parameter_names",
    "plugins_with",
]
