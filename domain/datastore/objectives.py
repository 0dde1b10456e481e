"""InferenceObjectives (priority by name) and model rewrites, as the EPP knows them."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

from ports.objectives import ModelRewriteRule, ModelRewriteTarget

__all__ = ["ModelRewriteRule", "ModelRewriteTarget", "ObjectiveStore"]


class ObjectiveStore:
    """Priorities by objective name and model-rewrite rules; replaced whole on updates."""

    def __init__(self) -> None:
        self._priorities: dict[str, int | None] = {}
        self._rules: tuple[ModelRewriteRule, ...] = ()

    def set_objectives(self, priorities: Mapping[str, int | None]) -> None:
        self._priorities = dict(priorities)

    def priority_of(self, objective: str) -> int:
        """The objective's priority; 0 when unknown or unset."""
        if not objective:
            return 0
        priority = self._priorities.get(objective)
        return 0 if priority is None else priority

    def set_rules(self, rules: Sequence[ModelRewriteRule]) -> None:
        self._rules = tuple(rules)

    def rewrite(self, model: str, rng: random.Random) -> tuple[str, str] | None:
        """``(rule name, target model)`` for ``model``, or ``None`` when no rule applies.

        An exact match beats a rule without a match; then the oldest rule, then list order.
        The target is a weighted random choice; all-zero weights mean uniform.
        """
        best: ModelRewriteRule | None = None
        for rule in self._rules:
            if rule.match not in ("", model) or not rule.targets:
                continue
            if best is None or _precedes(rule, best):
                best = rule
        if best is None:
            return None
        weights = [max(t.weight, 0) for t in best.targets]
        if sum(weights) == 0:
            target = rng.choice(best.targets)
        else:
            target = rng.choices(best.targets, weights=weights)[0]
        return best.name, target.model


def _precedes(rule: ModelRewriteRule, other: ModelRewriteRule) -> bool:
    exact, other_exact = rule.match != "", other.match != ""
    if exact != other_exact:
        return exact
    return (rule.created, rule.order) < (other.created, other.order)
