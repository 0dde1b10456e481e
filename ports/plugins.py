"""The identity of a plugin, shared by domain plugins and adapter-backed ones, and the
parameter types their parameters dataclasses may use."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NewType

__all__ = ["Duration", "TypedName"]

#: A parameter given as a Go duration string (``200ms``) or a number of seconds; the value
#: is seconds. Re-exported by ``domain.plugins.base``.
Duration = NewType("Duration", float)


@dataclass(frozen=True, slots=True)
class TypedName:
    """A plugin's registered type (kebab-case) and its instance name (default: the type)."""

    type: str
    name: str

    def __str__(self) -> str:
        return f"{self.name}/{self.type}"
