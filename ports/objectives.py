"""InferenceObjectives and InferenceModelRewrites, as discovery reports them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

__all__ = ["ModelRewriteRule", "ModelRewriteTarget", "ObjectiveSink"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelRewriteTarget:
    model: str
    weight: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelRewriteRule:
    """Rewrites requests for ``match`` (empty: any model) to a weighted choice of targets.

    ``name`` is the InferenceModelRewrite's name; ``created`` (seconds since the epoch) orders
    rules of the same kind, oldest first; ``order`` (position in the resource's rule list)
    breaks ties.
    """

    name: str
    match: str
    targets: tuple[ModelRewriteTarget, ...]
    created: float = 0.0
    order: int = 0


class ObjectiveSink(Protocol):
    """Receives the complete current objectives and rewrite rules (replacing earlier ones).

    Called on the event loop thread; must not block.
    """

    def set_objectives(self, priorities: Mapping[str, int | None]) -> None: ...

    def set_rules(self, rules: Sequence[ModelRewriteRule]) -> None: ...
