"""The identity of a plugin, shared by domain plugins and adapter-backed ones."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TypedName"]


@dataclass(frozen=True, slots=True)
class TypedName:
    """A plugin's registered type (kebab-case) and its instance name (default: the type)."""

    type: str
    name: str

    def __str__(self) -> str:
        return f"{self.name}/{self.type}"
