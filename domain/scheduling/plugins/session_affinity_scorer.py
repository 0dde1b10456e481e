"""``session-affinity-scorer``: prefer the endpoint a session used last, as a soft
preference (``domain.scheduling.plugins.session_affinity`` has the strategies).

Scores 1 for the session's endpoint and 0 for the others; 0 everywhere when the request
has no usable session (no header, an invalid or foreign token, an endpoint that left).
"""

from __future__ import annotations

from collections.abc import Sequence

from domain.plugins.base import Plugin, PluginRegistry, TypedName
from domain.plugins.handle import Handle
from domain.scheduling.interfaces import AFFINITY, CycleState
from domain.scheduling.plugins.session_affinity import (
    SessionAffinityHooks,
    SessionAffinityParameters,
)
from domain.scheduling.types import Candidate, InferenceRequest

__all__ = ["TYPE", "SessionAffinityScorer", "register"]

TYPE = "session-affinity-scorer"


class SessionAffinityScorer(SessionAffinityHooks):
    """Scorer + DataProducer + PreRequest + ResponseHeaderProcessor."""

    category = AFFINITY

    def score(
        self, cycle: CycleState, request: InferenceRequest, candidates: Sequence[Candidate]
    ) -> Sequence[float]:
        scores = [0.0] * len(candidates)
        index = self._session.find(request, candidates)
        if index >= 0:
            scores[index] = 1.0
        return scores


def _factory(name: str, parameters: SessionAffinityParameters, handle: Handle) -> Plugin:
    return SessionAffinityScorer(TypedName(TYPE, name), parameters, handle)


def register(registry: PluginRegistry) -> None:
    registry.register(
        TYPE,
        _factory,
        parameters=SessionAffinityParameters,
        description="prefers the endpoint that served the session before",
    )
