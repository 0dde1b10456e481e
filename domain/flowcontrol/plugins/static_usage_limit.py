"""``static-usage-limit-policy``: the same saturation ceiling for every band (the default).

``threshold`` (default 1.0, > 0): a band dispatches while the pool's saturation is below
it. Above 1.0 lets requests through onto a pool that is already saturated (except
sheddable ones, which the controller never dispatches onto a saturated pool).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from domain.plugins.base import PluginRegistry, TypedName, class_factory

__all__ = ["TYPE", "StaticUsageLimitParameters", "StaticUsageLimitPolicy", "register"]

TYPE = "static-usage-limit-policy"


@dataclass(frozen=True, slots=True, kw_only=True)
class StaticUsageLimitParameters:
    """``threshold``: the saturation ceiling of every band (> 0)."""

    threshold: float = 1.0

    def __post_init__(self) -> None:
        if not (self.threshold > 0 and math.isfinite(self.threshold)):
            raise ValueError(f"threshold: must be a finite number > 0, got {self.threshold}")


class StaticUsageLimitPolicy:
    """Returns ``threshold`` for every priority."""

    __slots__ = ("threshold", "typed_name")

    def __init__(self, typed_name: TypedName, parameters: StaticUsageLimitParameters) -> None:
        self.typed_name = typed_name
        self.threshold = float(parameters.threshold)

    def compute_limit(self, saturation: float, priorities: Sequence[int]) -> Sequence[float]:
        return [self.threshold] * len(priorities)


def register(registry: PluginRegistry) -> None:
    registry.register(
        TYPE,
        class_factory(TYPE, StaticUsageLimitPolicy),
        parameters=StaticUsageLimitParameters,
        description="flow control: one saturation ceiling (threshold) for every band",
    )
