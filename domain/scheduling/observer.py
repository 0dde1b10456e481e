"""Where the scheduler reports timings. The observability work plugs a real one in."""

from __future__ import annotations

from domain.plugins.base import TypedName

__all__ = ["SchedulingObserver"]


class SchedulingObserver:
    """Receives per-plugin durations and scheduling outcomes; this one drops them."""

    def plugin_duration(self, extension_point: str, plugin: TypedName, seconds: float) -> None:
        return None

    def scheduled(self, seconds: float, success: bool) -> None:
        return None
