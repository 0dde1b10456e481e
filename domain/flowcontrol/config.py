"""The flow controller's configuration: capacities, TTL, priority bands and policies.

``FlowControlConfig`` mirrors the ``flowControl`` section of the EndpointPickerConfig
(``app.config.schema.FlowControlSpec``) field by field, with concrete defaults instead of
"unset"; the app maps one onto the other. Policy fields name plugins (the ``...Ref``
values of the YAML), which ``FlowController`` resolves from the plugins it is given.
The remaining fields (displacement, dispatch pacing, garbage collection) are not in the
YAML; their defaults are the reference's timings plus our displacement switch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = [
    "DEFAULT_BAND_MAX_BYTES",
    "DEFAULT_FAIRNESS_POLICY",
    "DEFAULT_ORDERING_POLICY",
    "DEFAULT_USAGE_LIMIT_POLICY",
    "BandConfig",
    "FlowControlConfig",
    "PriorityBandConfig",
]

#: A band's byte capacity when the config leaves it unset (1 GB, as the reference).
DEFAULT_BAND_MAX_BYTES = 1_000_000_000
DEFAULT_FAIRNESS_POLICY = "global-strict-fairness-policy"
DEFAULT_ORDERING_POLICY = "fcfs-ordering-policy"
DEFAULT_USAGE_LIMIT_POLICY = "static-usage-limit-policy"


@dataclass(frozen=True, slots=True, kw_only=True)
class BandConfig:
    """A priority band's capacity and policies (the template for bands made on demand).

    ``max_bytes``/``max_requests`` 0 mean unlimited. (The reference turns an unset *or 0*
    band ``maxBytes`` into 1 GB; the app should map both to ``DEFAULT_BAND_MAX_BYTES``.)
    ``fairness_policy_ref``/``ordering_policy_ref`` name plugins. ``request_ttl``: seconds
    a request of the band may wait when it brings no TTL of its own (``None``: the
    controller's ``default_request_ttl``; 0: until dispatched or cancelled).
    """

    max_bytes: int = DEFAULT_BAND_MAX_BYTES
    max_requests: int = 0
    fairness_policy_ref: str = DEFAULT_FAIRNESS_POLICY
    ordering_policy_ref: str = DEFAULT_ORDERING_POLICY
    request_ttl: float | None = None

    def __post_init__(self) -> None:
        if self.request_ttl is not None and not (
            self.request_ttl >= 0 and math.isfinite(self.request_ttl)
        ):
            raise ValueError(
                f"defaultRequestTTL: must be a finite duration >= 0, got {self.request_ttl}"
            )
        if self.max_bytes < 0:
            raise ValueError(f"maxBytes: must be >= 0, got {self.max_bytes}")
        if self.max_requests < 0:
            raise ValueError(f"maxRequests: must be >= 0, got {self.max_requests}")
        if not self.fairness_policy_ref:
            raise ValueError("fairnessPolicyRef: must not be empty")
        if not self.ordering_policy_ref:
            raise ValueError("orderingPolicyRef: must not be empty")


@dataclass(frozen=True, slots=True, kw_only=True)
class PriorityBandConfig(BandConfig):
    """An explicitly configured band. Higher ``priority`` is served first; configured bands
    are never garbage-collected."""

    priority: int


@dataclass(frozen=True, slots=True, kw_only=True)
class FlowControlConfig:
    """Everything the flow controller is configured with.

    From the YAML (``flowControl``):

    - ``max_bytes``, ``max_requests``: global capacity over all queued requests; 0 means
      unlimited;
    - ``default_request_ttl``: seconds a request may wait when it brings no TTL of its
      own; 0 means it waits until dispatched or cancelled;
    - ``default_priority_band``: the template for bands created for unseen priorities;
    - ``default_negative_priority_band``: the template for those below 0 (``None``:
      ``default_priority_band``);
    - ``priority_bands``: explicitly configured bands (distinct priorities);
    - ``usage_limit_policy_plugin_ref``: the usage-limit policy plugin.

    Ours (not in the YAML):

    - ``displacement``: a request that does not fit may evict queued requests of strictly
      lower priority (default on);
    - ``dispatch_interval``: the fallback dispatch tick (seconds), armed only while
      requests wait; also the bound on how late a TTL expiry may be reported;
    - ``max_dispatch_interval``: while ticks find the pool blocked, each next tick waits
      twice as long, up to this (seconds); any dispatch resets it to
      ``dispatch_interval``. Bounds how long a saturation drop can go unnoticed when no
      ``notify()`` reports it;
    - ``max_dispatch_per_cycle``: how many requests one ``notify()`` may dispatch (each
      after re-reading saturation); enqueue- and tick-driven cycles dispatch at most one.
      Default 1: a saturation computed from scraped metrics does not move until the next
      scrape, so a burst on one reading overshoots the pool (measured with the overload
      benchmark); each endpoint's metrics refresh and each completion notifies;
    - ``flow_gc_timeout``/``band_gc_timeout``: how long an empty flow, or an empty band
      created on demand, is kept before being collected (5 and 10 minutes).
    """

    max_bytes: int = 0
    max_requests: int = 0
    default_request_ttl: float = 0.0
    default_priority_band: BandConfig = field(default_factory=BandConfig)
    default_negative_priority_band: BandConfig | None = None
    priority_bands: tuple[PriorityBandConfig, ...] = ()
    usage_limit_policy_plugin_ref: str = DEFAULT_USAGE_LIMIT_POLICY
    displacement: bool = True
    dispatch_interval: float = 0.001
    max_dispatch_interval: float = 0.05
    max_dispatch_per_cycle: int = 1
    flow_gc_timeout: float = 300.0
    band_gc_timeout: float = 600.0

    def __post_init__(self) -> None:
        if self.max_bytes < 0:
            raise ValueError(f"maxBytes: must be >= 0, got {self.max_bytes}")
        if self.max_requests < 0:
            raise ValueError(f"maxRequests: must be >= 0, got {self.max_requests}")
        if not (self.default_request_ttl >= 0 and math.isfinite(self.default_request_ttl)):
            raise ValueError(
                f"defaultRequestTTL: must be a finite duration >= 0, got {self.default_request_ttl}"
            )
        seen: set[int] = set()
        for index, band in enumerate(self.priority_bands):
            if band.priority in seen:
                raise ValueError(f"priorityBands[{index}].priority: duplicate {band.priority}")
            seen.add(band.priority)
        if not self.usage_limit_policy_plugin_ref:
            raise ValueError("usageLimitPolicyPluginRef: must not be empty")
        if not (self.dispatch_interval > 0 and math.isfinite(self.dispatch_interval)):
            raise ValueError(f"dispatchInterval: must be > 0, got {self.dispatch_interval}")
        if not (
            self.max_dispatch_interval >= self.dispatch_interval
            and math.isfinite(self.max_dispatch_interval)
        ):
            raise ValueError(
                f"maxDispatchInterval: must be >= dispatchInterval, got "
                f"{self.max_dispatch_interval}"
            )
        if self.max_dispatch_per_cycle < 1:
            raise ValueError(
                f"maxDispatchPerCycle: must be >= 1, got {self.max_dispatch_per_cycle}"
            )
        if not self.flow_gc_timeout > 0:
            raise ValueError(f"flowGCTimeout: must be > 0, got {self.flow_gc_timeout}")
        if not self.band_gc_timeout > 0:
            raise ValueError(f"bandGCTimeout: must be > 0, got {self.band_gc_timeout}")
