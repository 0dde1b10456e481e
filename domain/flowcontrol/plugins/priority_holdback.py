"""``priority-holdback-policy``: a lower saturation ceiling for each lower band (the llm-d
router's usage-limit policy of that name, its parameters and defaults).

The ceilings run from ``maxCeiling`` (default 1.0) for the highest band to ``minCeiling``
(required) for the lowest, linearly (``shape``), by rank (``domain: rank``, the default:
equal steps whatever the priority values) or by value (``domain: value``: in proportion to
each priority's place between the lowest and the highest). A lower band stops dispatching
once the pool's saturation reaches its ceiling, so the capacity above it stays free for the
bands above. One band gets ``maxCeiling``. The bands are the controller's: those configured
and those created on demand, until collected.

``minCeiling`` 0 holds the lowest band back whatever the saturation (its requests wait for
their TTL). Sheddable bands (priority < 0) never go onto a saturated pool either way.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from domain.plugins.base import PluginRegistry, TypedName, class_factory

__all__ = ["TYPE", "PriorityHoldbackParameters", "PriorityHoldbackPolicy", "register"]

TYPE = "priority-holdback-policy"

SHAPES = ("linear",)
DOMAINS = ("rank", "value")


@dataclass(frozen=True, slots=True, kw_only=True)
class PriorityHoldbackParameters:
    """``minCeiling`` (required, in [0, 1)): the lowest band's ceiling; ``maxCeiling``
    (1.0, in (0, 1], at least ``minCeiling``): the highest band's; ``shape``
    (``linear``) and ``domain`` (``rank`` or ``value``): how the bands between are spaced."""

    min_ceiling: float
    max_ceiling: float = 1.0
    shape: Literal["linear"] = "linear"
    domain: Literal["rank", "value"] = "rank"

    def __post_init__(self) -> None:
        if not (math.isfinite(self.min_ceiling) and 0.0 <= self.min_ceiling < 1.0):
            raise ValueError(f"minCeiling: must be in [0, 1), got {self.min_ceiling}")
        if not (math.isfinite(self.max_ceiling) and 0.0 < self.max_ceiling <= 1.0):
            raise ValueError(f"maxCeiling: must be in (0, 1], got {self.max_ceiling}")
        if self.min_ceiling > self.max_ceiling:
            raise ValueError(
                f"minCeiling: must not exceed maxCeiling ({self.max_ceiling}),"
                f" got {self.min_ceiling}"
            )
        if self.shape not in SHAPES:
            raise ValueError(f"shape: must be one of {', '.join(SHAPES)}, got {self.shape!r}")
        if self.domain not in DOMAINS:
            raise ValueError(f"domain: must be one of {', '.join(DOMAINS)}, got {self.domain!r}")


class PriorityHoldbackPolicy:
    """Ceilings from ``max_ceiling`` (highest priority) down to ``min_ceiling`` (lowest)."""

    __slots__ = ("by_value", "max_ceiling", "min_ceiling", "typed_name")

    def __init__(self, typed_name: TypedName, parameters: PriorityHoldbackParameters) -> None:
        self.typed_name = typed_name
        self.min_ceiling = float(parameters.min_ceiling)
        self.max_ceiling = float(parameters.max_ceiling)
        self.by_value = parameters.domain == "value"

    def compute_limit(self, saturation: float, priorities: Sequence[int]) -> Sequence[float]:
        count = len(priorities)
        if count < 2:
            return [self.max_ceiling] * count
        if self.by_value:
            high, low = max(priorities), min(priorities)
            if high == low:
                return [self.max_ceiling] * count
            return [self._at((p - low) / (high - low)) for p in priorities]
        last = count - 1
        return [self._at((last - i) / last) for i in range(count)]

    def _at(self, position: float) -> float:
        """The ceiling at ``position`` in [0, 1] (0: the lowest band, 1: the highest); the
        ends exactly ``min_ceiling`` and ``max_ceiling``."""
        if position >= 1.0:
            return self.max_ceiling
        if position <= 0.0:
            return self.min_ceiling
        return self.min_ceiling + position * (self.max_ceiling - self.min_ceiling)


def register(registry: PluginRegistry) -> None:
    registry.register(
        TYPE,
        class_factory(TYPE, PriorityHoldbackPolicy),
        parameters=PriorityHoldbackParameters,
        description="flow control: a lower saturation ceiling for each lower band, from"
        " maxCeiling down to minCeiling, keeping room for the bands above",
    )
