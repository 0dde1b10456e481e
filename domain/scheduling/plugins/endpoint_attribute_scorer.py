"""``endpoint-attribute-scorer``: score endpoints by one numeric attribute
(``domain.scheduling.plugins.endpoint_attribute`` says where the value comes from).

``score = (value - min) / (max - min)``, inverted for ``linear_lower_is_better``. The range
is ``adaptiveRange`` (the default: min and max over the candidates that have the value;
when they all share one value they all score 1) or ``fixedRange`` (the configured
``min`` < ``max``; values outside are clamped). A candidate without the value scores 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from domain.plugins.base import PluginRegistry, TypedName, class_factory
from domain.scheduling.interfaces import DISTRIBUTION, CycleState
from domain.scheduling.plugins.endpoint_attribute import attribute_value
from domain.scheduling.types import Candidate, InferenceRequest

__all__ = [
    "TYPE",
    "AttributeNormalization",
    "AttributeScorerAlgorithm",
    "EndpointAttributeScorer",
    "EndpointAttributeScorerParameters",
    "FixedRange",
    "register",
]

TYPE = "endpoint-attribute-scorer"
LOWER = "linear_lower_is_better"
HIGHER = "linear_higher_is_better"


@dataclass(frozen=True, slots=True, kw_only=True)
class FixedRange:
    min: float
    max: float

    def __post_init__(self) -> None:
        if not self.min < self.max:
            raise ValueError(f"min: must be < max ({self.max}), got {self.min}")


@dataclass(frozen=True, slots=True, kw_only=True)
class AdaptiveRange:
    """The range over the candidates (no settings)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class AttributeNormalization:
    """At most one of ``adaptiveRange`` and ``fixedRange``."""

    adaptive_range: AdaptiveRange | None = None
    fixed_range: FixedRange | None = None

    def __post_init__(self) -> None:
        if self.adaptive_range is not None and self.fixed_range is not None:
            raise ValueError("fixedRange: give at most one of adaptiveRange and fixedRange")


@dataclass(frozen=True, slots=True, kw_only=True)
class AttributeScorerAlgorithm:
    type: str
    normalization: AttributeNormalization | None = None

    def __post_init__(self) -> None:
        if self.type not in (LOWER, HIGHER):
            raise ValueError(f"type: must be {LOWER} or {HIGHER}, got {self.type!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class EndpointAttributeScorerParameters:
    attribute_key: str
    algorithm: AttributeScorerAlgorithm

    def __post_init__(self) -> None:
        if not self.attribute_key:
            raise ValueError("attributeKey: must not be empty")


class EndpointAttributeScorer:
    """Linear score of one attribute; see the module docstring."""

    __slots__ = ("_fixed", "_key", "_lower", "typed_name")

    category = DISTRIBUTION

    def __init__(
        self, typed_name: TypedName, parameters: EndpointAttributeScorerParameters
    ) -> None:
        self.typed_name = typed_name
        self._key = parameters.attribute_key
        self._lower = parameters.algorithm.type == LOWER
        normalization = parameters.algorithm.normalization
        self._fixed = normalization.fixed_range if normalization is not None else None

    def score(
        self, cycle: CycleState, request: InferenceRequest, candidates: Sequence[Candidate]
    ) -> Sequence[float]:
        values = [attribute_value(c, self._key) for c in candidates]
        present = [v for v in values if v is not None]
        if not present:
            return [0.0] * len(values)
        if self._fixed is not None:
            low, high = self._fixed.min, self._fixed.max
        else:
            low, high = min(present), max(present)
            if low == high:
                return [0.0 if v is None else 1.0 for v in values]
        span = high - low
        scores: list[float] = []
        for v in values:
            if v is None:
                scores.append(0.0)
                continue
            score = (min(max(v, low), high) - low) / span
            scores.append(1.0 - score if self._lower else score)
        return scores


def register(registry: PluginRegistry) -> None:
    registry.register(
        TYPE,
        class_factory(TYPE, EndpointAttributeScorer),
        parameters=EndpointAttributeScorerParameters,
        description="scores endpoints linearly by a numeric attribute",
    )
