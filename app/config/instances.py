"""Plugin instantiation: the plugins one load builds, by name, and where each came from.

Configured plugins are validated against their type's parameters dataclass and created in
config order; defaulted ones are created (named by their type) when no plugin of the type
exists. Each is added to the plugin handle as it is built, so a factory finds the plugins
built before it. ``origin`` keeps the config path of each plugin for error messages.
"""

from __future__ import annotations

from dataclasses import is_dataclass
from typing import Any

from app.config.compatibility import unavailable_reason
from app.config.errors import ConfigError
from app.config.notices import ConfigNotices
from app.config.overrides import ConfigOverrides
from app.config.parameters import ParameterError, validate_parameters
from app.config.schema import PluginEntry
from domain.plugins.base import Plugin, PluginConfigError, PluginRegistry, parameter_names
from domain.plugins.handle import Handle
from domain.plugins.hooks import NamingParameters

__all__ = ["PluginInstances", "describe"]


def describe(plugin: Plugin) -> str:
    """``"<name>" (type <type>)``, for error messages."""
    return f'"{plugin.typed_name.name}" (type {plugin.typed_name.type})'


class PluginInstances:
    """The plugins built so far (``plugins``, in build order), their config paths, and the
    notices of this load."""

    def __init__(
        self, registry: PluginRegistry, handle: Handle, overrides: ConfigOverrides | None = None
    ) -> None:
        self.registry = registry
        self.handle = handle
        self.overrides = overrides or ConfigOverrides()
        self.plugins: dict[str, Plugin] = {}
        self.origin: dict[str, str] = {}
        self.notices = ConfigNotices()

    def configure(self, index: int, entry: PluginEntry) -> None:
        """Builds ``plugins[index]``: its parameters validated, its name defaulted."""
        path = f"plugins[{index}]"
        if entry.type not in self.registry:
            reason = unavailable_reason(entry.type)
            if reason is not None:
                raise ConfigError(f'{path}.type: plugin type "{entry.type}" is {reason}')
            raise ConfigError(f'{path}.type: unknown plugin type "{entry.type}"')
        parameters = self._validated(entry.type, entry.parameters, f"{path}.parameters")
        # A type may name its unnamed instances after their parameters (e.g. a GVK).
        if entry.name:
            name = entry.name
        elif isinstance(parameters, NamingParameters):
            name = parameters.default_name()
        else:
            name = entry.type
        if name in self.plugins:
            raise ConfigError(f'{path}.name: duplicate plugin name "{name}"')
        self.create(entry.type, name, parameters, path)

    def _validated(self, type_name: str, raw: Any, path: str) -> Any:
        """``raw`` parameters, with the flags' overrides, as the type's parameters."""
        parameters_type = self.registry.spec(type_name).parameters
        try:
            return validate_parameters(
                parameters_type, self.overrides.parameters_of(type_name, raw)
            )
        except ParameterError as exc:
            where = path
            if exc.path:
                where += exc.path if exc.path.startswith("[") else f".{exc.path}"
            raise ConfigError(f"{where}: {exc.reason}") from None

    def create(self, type_name: str, name: str, parameters: Any, path: str) -> Plugin:
        """Builds one plugin (``parameters`` ``None``: the type's defaults) and adds it."""
        if parameters is None and type_name in self.overrides.parameters:
            parameters = self._validated(type_name, None, f"{path} (from the flags)")
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

    def ref(self, name: str, path: str) -> Plugin:
        """The plugin a ``pluginRef`` at ``path`` names."""
        plugin = self.plugins.get(name)
        if plugin is None:
            raise ConfigError(f'{path}: no plugin named "{name}"')
        return plugin

    def section_ref(self, name: str, path: str, kind: type[Any], what: str) -> Any:
        """The plugin named ``name``, which must implement ``kind`` (called ``what``)."""
        plugin = self.ref(name, path)
        if not isinstance(plugin, kind):
            raise ConfigError(f"{path}: plugin {describe(plugin)} is not a {what}")
        return plugin

    def path_of(self, plugin: Plugin) -> str:
        """The config path the plugin came from (``plugins`` when it has none)."""
        return self.origin.get(plugin.typed_name.name, "plugins")

    def default(self, type_name: str, path: str) -> Plugin:
        """The first plugin of ``type_name``, created (named by its type) when none exists."""
        for plugin in self.plugins.values():
            if plugin.typed_name.type == type_name:
                return plugin
        if type_name not in self.registry:
            raise ConfigError(f'{path}: the default plugin type "{type_name}" is not registered')
        taken = self.plugins.get(type_name)
        if taken is not None:
            raise ConfigError(
                f'{self.path_of(taken)}: the name "{type_name}" is taken by a plugin of type '
                f'"{taken.typed_name.type}", so the default "{type_name}" cannot be added'
            )
        return self.create(type_name, type_name, None, path)

    def required_default(self, type_name: str, path: str, kind: type[Any], what: str) -> Any:
        """Like ``default``; the plugin must implement ``kind`` (called ``what``)."""
        plugin = self.default(type_name, path)
        if not isinstance(plugin, kind):
            raise ConfigError(f"{path}: the default plugin {describe(plugin)} is not a {what}")
        return plugin
