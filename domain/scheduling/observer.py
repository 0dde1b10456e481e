"""Where the scheduler reports timings, outcomes and spans: an ``Observer``, with the
catalogue's ``PLUGIN_DURATION``, ``SCHEDULER_E2E_DURATION`` and ``SCHEDULER_ATTEMPTS``."""

from __future__ import annotations

from collections.abc import Mapping

from domain.plugins.base import TypedName
from domain.scheduling.types import SchedulingResult
from ports.metric_catalogue import PLUGIN_DURATION, SCHEDULER_ATTEMPTS, SCHEDULER_E2E_DURATION
from ports.observer import NoopSpan, Observer, Span

__all__ = [
    "PLUGIN_SPAN",
    "PROFILE_SPAN",
    "SCHEDULING_SPAN",
    "SchedulingObserver",
    "SchedulingReporter",
]

SCHEDULING_SPAN = "gateway.scheduling"
PROFILE_SPAN = "gateway.scheduling.profile"
#: One plugin call (attributes ``extension_point``, ``plugin.type``, ``plugin.name``).
PLUGIN_SPAN = "gateway.scheduling.plugin"

_NO_LABELS: dict[str, str] = {}
_NOOP_SPAN = NoopSpan()


class SchedulingObserver:
    """Receives per-plugin durations, scheduling attempts and span requests; this one
    drops them (``SchedulingReporter`` reports them to an ``Observer``)."""

    def plugin_duration(self, extension_point: str, plugin: TypedName, seconds: float) -> None:
        return None

    def attempt(self, seconds: float, target_model: str, result: SchedulingResult | None) -> None:
        """One scheduling attempt; ``result`` is ``None`` when it failed."""
        return None

    def start_span(
        self,
        name: str,
        parent: Span | None,
        attributes: Mapping[str, str | int | float | bool] | None = None,
    ) -> Span:
        return _NOOP_SPAN


class SchedulingReporter(SchedulingObserver):
    """Reports to ``observer`` with the reference's metric names.

    Label mappings are built once per plugin and extension point, and per chosen endpoint,
    so a report costs a dictionary lookup and the observer's call.
    """

    def __init__(self, observer: Observer) -> None:
        self._observer = observer
        self._plugin_labels: dict[tuple[str, str, str], dict[str, str]] = {}
        self._attempt_labels: dict[tuple[str, str, str, str, str], dict[str, str]] = {}

    @property
    def observer(self) -> Observer:
        return self._observer

    def plugin_duration(self, extension_point: str, plugin: TypedName, seconds: float) -> None:
        key = (extension_point, plugin.name, plugin.type)  # str hashes are cached
        labels = self._plugin_labels.get(key)
        if labels is None:
            labels = self._plugin_labels[key] = {
                "extension_point": extension_point,
                "plugin_type": plugin.type,
                "plugin_name": plugin.name,
            }
        self._observer.histogram(PLUGIN_DURATION, labels, seconds)

    def attempt(self, seconds: float, target_model: str, result: SchedulingResult | None) -> None:
        """Counts the attempt; on success with the primary profile's first endpoint."""
        self._observer.histogram(SCHEDULER_E2E_DURATION, _NO_LABELS, seconds)
        primary = result.primary if result is not None else None
        if primary is None or not primary.target_endpoints:
            key = ("failure", target_model, "", "", "")
        else:
            info = primary.target_endpoints[0].info
            key = (
                "success",
                target_model,
                info.pod_name or info.name,
                info.namespace,
                str(info.address.port),
            )
        labels = self._attempt_labels.get(key)
        if labels is None:
            if len(self._attempt_labels) > 10_000:  # endpoints come and go: stay bounded
                self._attempt_labels.clear()
            labels = self._attempt_labels[key] = {
                "status": key[0],
                "target_model_name": key[1],
                "pod_name": key[2],
                "namespace": key[3],
                "port": key[4],
            }
        self._observer.counter(SCHEDULER_ATTEMPTS, labels)

    def start_span(
        self,
        name: str,
        parent: Span | None,
        attributes: Mapping[str, str | int | float | bool] | None = None,
    ) -> Span:
        return self._observer.start_span(name, parent=parent, attributes=attributes)
