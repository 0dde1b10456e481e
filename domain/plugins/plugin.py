"""What every plugin is, and the error a plugin's configuration raises."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from ports.plugins import TypedName

__all__ = ["Plugin", "PluginConfigError"]


class PluginConfigError(ValueError):
    """A plugin cannot be built from its configuration. The message names the problem."""


@runtime_checkable
class Plugin(Protocol):
    """Anything the framework manages. ``typed_name`` never changes."""

    @property
    def typed_name(self) -> TypedName: ...
