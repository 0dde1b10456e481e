"""The plugin framework: typed names, parameters, factories and the registry.

A plugin is any object with a ``typed_name``. What it does is found from the extension-point
Protocols it implements (a filter has ``filter``, a scorer ``score``, ...), so one plugin can
fill several extension points. Each plugin type registers a factory and, when it takes
parameters, a frozen dataclass describing them; the config loader validates YAML against
that dataclass (camelCase keys map to snake_case fields) and hands the factory an instance.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NewType, Protocol

from domain.plugins.handle import Handle
from domain.plugins.plugin import Plugin, PluginConfigError
from ports.plugins import Duration, TypedName

__all__ = [
    "Duration",
    "EmptyParameters",
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

#: A parameter given as a Kubernetes quantity (``10Gi``, ``500M``); the value is a number.
Quantity = NewType("Quantity", int)


@dataclass(frozen=True, slots=True, kw_only=True)
class EmptyParameters:
    """The parameters of a plugin that takes none."""


class PluginFactory(Protocol):
    """Builds one plugin instance. May raise ``PluginConfigError``."""

    def __call__(self, name: str, parameters: Any, handle: Handle) -> Plugin: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class PluginSpec:
    """What the registry knows of a plugin type.

    ``parameters`` is the frozen dataclass the factory receives (its ``__post_init__`` may
    raise ``ValueError`` naming the camelCase field). ``default_for`` lists the data keys
    this type is created for automatically when a configured plugin consumes them and
    nothing produces them.
    """

    type: str
    factory: PluginFactory
    parameters: builtins.type[Any] = EmptyParameters
    default_for: tuple[str, ...] = ()
    description: str = ""


@dataclass(slots=True)
class PluginRegistry:
    """Maps plugin types to their specs. Not a module global: the app builds one.

    Registering a type twice raises ``ValueError``; out-of-tree plugins register the same
    way (through the ``epp.plugins`` entry-point group, loaded by the app).
    """

    _specs: dict[str, PluginSpec] = field(default_factory=dict)

    def register(
        self,
        type_name: str,
        factory: PluginFactory,
        *,
        parameters: type[Any] = EmptyParameters,
        default_for: Iterable[str] = (),
        description: str = "",
    ) -> None:
        if not type_name or type_name != type_name.strip():
            raise ValueError(f"invalid plugin type {type_name!r}")
        if type_name in self._specs:
            raise ValueError(f"plugin type {type_name!r} is already registered")
        self._specs[type_name] = PluginSpec(
            type=type_name,
            factory=factory,
            parameters=parameters,
            default_for=tuple(default_for),
            description=description,
        )

    def alias(self, alias: str, type_name: str) -> None:
        """Register ``alias`` as another name for an already registered type."""
        spec = self.spec(type_name)
        self.register(
            alias,
            spec.factory,
            parameters=spec.parameters,
            description=f"alias of {type_name}",
        )

    def spec(self, type_name: str) -> PluginSpec:
        try:
            return self._specs[type_name]
        except KeyError:
            raise PluginConfigError(f"unknown plugin type {type_name!r}") from None

    def __contains__(self, type_name: object) -> bool:
        return type_name in self._specs

    def types(self) -> list[str]:
        return sorted(self._specs)

    def default_producer_for(self, data_key: str) -> str | None:
        """The type registered as the default producer of ``data_key``, if any."""
        for spec in self._specs.values():
            if data_key in spec.default_for:
                return spec.type
        return None

    def create(self, type_name: str, name: str, parameters: Any, handle: Handle) -> Plugin:
        spec = self.spec(type_name)
        if parameters is None:
            parameters = spec.parameters()
        return spec.factory(name, parameters, handle)


def class_factory(type_name: str, cls: Callable[[TypedName, Any], Plugin]) -> PluginFactory:
    """A factory for plugin classes built as ``cls(typed_name, parameters)``."""

    def factory(name: str, parameters: Any, handle: Handle) -> Plugin:
        return cls(TypedName(type_name, name), parameters)

    return factory


def plugins_with(plugins: Iterable[object], protocol: type[Any]) -> list[Any]:
    """The plugins that implement a runtime-checkable extension-point Protocol."""
    return [p for p in plugins if isinstance(p, protocol)]


def parameter_names(parameters: type[Any]) -> Mapping[str, str]:
    """camelCase config key → dataclass field name, for a parameters dataclass."""
    import dataclasses

    return {_camel(f.name): f.name for f in dataclasses.fields(parameters)}


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)
