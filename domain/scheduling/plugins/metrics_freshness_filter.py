"""``metrics-freshness-filter``: prefer the endpoints whose scraped metrics are fresh.

An endpoint's metrics are fresh when its last successful scrape is at most
``metricsStalenessThreshold`` (2 s, the default of ``--metrics-staleness-threshold``) old;
an endpoint never scraped (no metrics yet) is not fresh. The filter keeps the fresh
candidates, in order. When none of the candidates it is given is fresh it keeps them all
(fail-open), so it never makes a request unschedulable: a pool whose metrics are not
scraped at all, or all fail, routes as if the filter were absent.

In the default profile it runs after ``prefix-cache-affinity-filter``: a new prefix (no
sticky endpoint, every candidate passed on) avoids a server whose ``/metrics`` fails or
hangs, while a prefix that is already sticky to such a server alone stays there (its
cache is warm; the affinity filter's TTFT gate still moves it when requests back up).
Placed first, it also moves sticky traffic off such a server.

This EPP's own type: the reference reads freshness only in its saturation detector
(``utilization-detector``, 200 ms, with queue and KV-cache caps in the same filter).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from domain.plugins.base import Duration, Plugin, PluginRegistry, TypedName
from domain.plugins.handle import Handle
from domain.scheduling.interfaces import CycleState
from domain.scheduling.types import Candidate, InferenceRequest

__all__ = [
    "TYPE",
    "MetricsFreshnessFilter",
    "MetricsFreshnessFilterParameters",
    "register",
]

TYPE = "metrics-freshness-filter"

_DEFAULT_STALENESS = Duration(2.0)  # "2s", as --metrics-staleness-threshold


@dataclass(frozen=True, slots=True, kw_only=True)
class MetricsFreshnessFilterParameters:
    """``metricsStalenessThreshold`` (a duration > 0; 2s): metrics older than this are
    stale."""

    metrics_staleness_threshold: Duration = _DEFAULT_STALENESS

    def __post_init__(self) -> None:
        if not self.metrics_staleness_threshold > 0:
            raise ValueError(
                f"metricsStalenessThreshold: must be > 0, got {self.metrics_staleness_threshold}s"
            )


class MetricsFreshnessFilter:
    """Keeps the candidates with fresh metrics, in order; all of them when none is."""

    __slots__ = ("_clock", "_staleness", "typed_name")

    def __init__(
        self,
        typed_name: TypedName,
        parameters: MetricsFreshnessFilterParameters,
        clock: Callable[[], float],
    ) -> None:
        self.typed_name = typed_name
        self._clock = clock
        self._staleness = float(parameters.metrics_staleness_threshold)

    def filter(
        self, cycle: CycleState, request: InferenceRequest, candidates: Sequence[Candidate]
    ) -> Sequence[Candidate]:
        oldest = self._clock() - self._staleness
        kept = [c for c in candidates if (m := c.metrics) is not None and m.update_time >= oldest]
        if not kept or len(kept) == len(candidates):
            return candidates
        return kept


def _factory(name: str, parameters: Any, handle: Handle) -> Plugin:
    return MetricsFreshnessFilter(TypedName(TYPE, name), parameters, handle.clock)


def register(registry: PluginRegistry) -> None:
    registry.register(
        TYPE,
        _factory,
        parameters=MetricsFreshnessFilterParameters,
        description="keeps endpoints with fresh scraped metrics; all when none is fresh",
    )
