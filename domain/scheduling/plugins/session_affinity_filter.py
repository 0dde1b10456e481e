"""``session-affinity-filter``: pin a session's requests to the endpoint it used last, as a
hard constraint (``domain.scheduling.plugins.session_affinity`` has the strategies).

When the session's endpoint is a candidate it is the only one kept; otherwise (no session,
an invalid or foreign token, an endpoint that left) every candidate passes. Never empty.
"""

from __future__ import annotations

from collections.abc import Sequence

from domain.plugins.base import Plugin, PluginRegistry, TypedName
from domain.plugins.handle import Handle
from domain.scheduling.interfaces import CycleState
from domain.scheduling.plugins.session_affinity import (
    SessionAffinityHooks,
    SessionAffinityParameters,
)
from domain.scheduling.types import Candidate, InferenceRequest

__all__ = ["TYPE", "SessionAffinityFilter", "register"]

TYPE = "session-affinity-filter"


class SessionAffinityFilter(SessionAffinityHooks):
    """Filter + DataProducer (the ``session_id`` lookup) + PreRequest (the binding) +
    ResponseHeaderProcessor (the token)."""

    def filter(
        self, cycle: CycleState, request: InferenceRequest, candidates: Sequence[Candidate]
    ) -> Sequence[Candidate]:
        index = self._session.find(request, candidates)
        return candidates if index < 0 else [candidates[index]]


def _factory(name: str, parameters: SessionAffinityParameters, handle: Handle) -> Plugin:
    return SessionAffinityFilter(TypedName(TYPE, name), parameters, handle)


def register(registry: PluginRegistry) -> None:
    registry.register(
        TYPE,
        _factory,
        parameters=SessionAffinityParameters,
        description="pins a session to the endpoint that served it (token header or session id)",
    )
