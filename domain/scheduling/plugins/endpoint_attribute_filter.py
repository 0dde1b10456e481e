"""``endpoint-attribute-filter``: keep endpoints by one numeric attribute
(``domain.scheduling.plugins.endpoint_attribute`` says where the value comes from).

``algorithm.type`` is one of:

- ``threshold``: keep when ``value <operator> threshold.value`` (``LessThan``,
  ``LessThanOrEqual``, ``GreaterThan``, ``GreaterThanOrEqual``, ``Equal``, ``NotEqual``);
- ``range``: keep when ``range.min <= value <= range.max``;
- ``topK``: keep the ``topK.k`` highest values (``higherIsBetter``, default true) or lowest;
- ``percentile``: the nearest-rank cutoff ``sorted[ceil(P/100 * N) - 1]`` of the values
  (``percentile.percentile`` in [0, 100]); keep values >= it (``higherIsBetter``) or <= it.

``onMissing`` (``Pass``) keeps an endpoint without the attribute, ``Fail`` drops it (for
``topK`` and ``percentile`` such endpoints are not ranked, then kept or dropped).
``fallbackOnEmpty`` (false) returns the candidates unchanged when none is kept. Order is
kept. ``producer`` is accepted: attributes here are looked up by name alone.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from domain.plugins.base import PluginRegistry, TypedName, class_factory
from domain.scheduling.interfaces import CycleState
from domain.scheduling.plugins.endpoint_attribute import attribute_value
from domain.scheduling.types import Candidate, InferenceRequest

__all__ = [
    "TYPE",
    "AttributeFilterAlgorithm",
    "EndpointAttributeFilter",
    "EndpointAttributeFilterParameters",
    "PercentileSpec",
    "RangeSpec",
    "ThresholdSpec",
    "TopKSpec",
    "register",
]

TYPE = "endpoint-attribute-filter"

OPERATORS: dict[str, Callable[[float, float], bool]] = {
    "LessThan": operator.lt,
    "LessThanOrEqual": operator.le,
    "GreaterThan": operator.gt,
    "GreaterThanOrEqual": operator.ge,
    "Equal": operator.eq,
    "NotEqual": operator.ne,
}
ON_MISSING = ("Pass", "Fail")


@dataclass(frozen=True, slots=True, kw_only=True)
class ThresholdSpec:
    operator: str
    value: float

    def __post_init__(self) -> None:
        if self.operator not in OPERATORS:
            raise ValueError(f"operator: must be one of {', '.join(OPERATORS)}")


@dataclass(frozen=True, slots=True, kw_only=True)
class RangeSpec:
    min: float
    max: float

    def __post_init__(self) -> None:
        if not self.min <= self.max:
            raise ValueError(f"min: must be <= max ({self.max}), got {self.min}")


@dataclass(frozen=True, slots=True, kw_only=True)
class TopKSpec:
    k: int
    higher_is_better: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.k, bool) or self.k <= 0:
            raise ValueError(f"k: must be a positive integer, got {self.k}")


@dataclass(frozen=True, slots=True, kw_only=True)
class PercentileSpec:
    percentile: float
    higher_is_better: bool = True

    def __post_init__(self) -> None:
        if not 0 <= self.percentile <= 100:
            raise ValueError(f"percentile: must be within [0, 100], got {self.percentile}")


@dataclass(frozen=True, slots=True, kw_only=True)
class AttributeFilterAlgorithm:
    """``type`` and the block of that name."""

    type: str
    threshold: ThresholdSpec | None = None
    range: RangeSpec | None = None
    top_k: TopKSpec | None = None
    percentile: PercentileSpec | None = None

    def __post_init__(self) -> None:
        blocks = {
            "threshold": self.threshold,
            "range": self.range,
            "topK": self.top_k,
            "percentile": self.percentile,
        }
        if self.type not in blocks:
            raise ValueError(f"type: must be one of {', '.join(blocks)}, got {self.type!r}")
        if blocks[self.type] is None:
            raise ValueError(f"{self.type}: required when type is {self.type}")


@dataclass(frozen=True, slots=True, kw_only=True)
class EndpointAttributeFilterParameters:
    attribute: str
    algorithm: AttributeFilterAlgorithm
    producer: str = ""
    on_missing: str = "Pass"
    fallback_on_empty: bool = False

    def __post_init__(self) -> None:
        if not self.attribute:
            raise ValueError("attribute: must not be empty")
        if self.on_missing not in ON_MISSING:
            raise ValueError(f"onMissing: must be Pass or Fail, got {self.on_missing!r}")


class EndpointAttributeFilter:
    """Keeps the candidates whose attribute passes the algorithm; see the module docstring."""

    __slots__ = ("_algorithm", "_attribute", "_fallback", "_pass_missing", "typed_name")

    def __init__(
        self, typed_name: TypedName, parameters: EndpointAttributeFilterParameters
    ) -> None:
        self.typed_name = typed_name
        self._attribute = parameters.attribute
        self._algorithm = parameters.algorithm
        self._pass_missing = parameters.on_missing == "Pass"
        self._fallback = parameters.fallback_on_empty

    def filter(
        self, cycle: CycleState, request: InferenceRequest, candidates: Sequence[Candidate]
    ) -> Sequence[Candidate]:
        values = [attribute_value(c, self._attribute) for c in candidates]
        keep = self._keep(values)
        kept = [c for c, ok in zip(candidates, keep, strict=True) if ok]
        if not kept and self._fallback:
            return candidates
        return kept

    def _keep(self, values: list[float | None]) -> list[bool]:
        algorithm = self._algorithm
        missing = self._pass_missing
        present = sorted(v for v in values if v is not None)
        if algorithm.threshold is not None and algorithm.type == "threshold":
            compare, limit = OPERATORS[algorithm.threshold.operator], algorithm.threshold.value
            return [missing if v is None else compare(v, limit) for v in values]
        if algorithm.range is not None and algorithm.type == "range":
            low, high = algorithm.range.min, algorithm.range.max
            return [missing if v is None else low <= v <= high for v in values]
        if algorithm.top_k is not None and algorithm.type == "topK":
            spec = algorithm.top_k
            if spec.k >= len(present):
                return [missing if v is None else True for v in values]
            if spec.higher_is_better:
                cutoff = present[-spec.k]
                return self._rank(values, lambda v: v > cutoff, cutoff, spec.k, len(present))
            cutoff = present[spec.k - 1]
            return self._rank(values, lambda v: v < cutoff, cutoff, spec.k, len(present))
        spec_p = algorithm.percentile
        assert spec_p is not None
        if not present:
            return [missing for _ in values]
        index = max(1, math.ceil(spec_p.percentile / 100 * len(present))) - 1
        cutoff = present[index]
        if spec_p.higher_is_better:
            return [missing if v is None else v >= cutoff for v in values]
        return [missing if v is None else v <= cutoff for v in values]

    def _rank(
        self,
        values: list[float | None],
        better: Callable[[float], bool],
        cutoff: float,
        k: int,
        ranked: int,
    ) -> list[bool]:
        """Exactly ``k`` of the ranked values: all better than the cutoff, then ties at
        the cutoff in candidate order."""
        room = k - sum(1 for v in values if v is not None and better(v))
        keep: list[bool] = []
        for v in values:
            if v is None:
                keep.append(self._pass_missing)
            elif better(v):
                keep.append(True)
            elif v == cutoff and room > 0:
                room -= 1
                keep.append(True)
            else:
                keep.append(False)
        return keep


def register(registry: PluginRegistry) -> None:
    registry.register(
        TYPE,
        class_factory(TYPE, EndpointAttributeFilter),
        parameters=EndpointAttributeFilterParameters,
        description="keeps endpoints by a numeric attribute (threshold, range, topK, percentile)",
    )
