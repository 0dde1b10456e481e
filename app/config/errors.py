"""The one error a config load raises."""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """The configuration is invalid. The message starts with the offending entry's path."""
