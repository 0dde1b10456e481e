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
    SESSION_AFFINITY,
    SessionAffinity,
    SessionAffinityParameters,
)
from domain.scheduling.types import Candidate, InferenceRequest, SchedulingResult
from ports.endpoints import EndpointInfo

__all__ = ["TYPE", "SessionAffinityScorer", "register"]

TYPE = "session-affinity-scorer"


class SessionAffinityScorer:
    """Scorer + DataProducer + PreRequest + ResponseHeaderProcessor."""

    category = AFFINITY

    def __init__(
        self, typed_name: TypedName, parameters: SessionAffinityParameters, handle: Handle
    ) -> None:
        self._typed_name = typed_name
        self._session = SessionAffinity(
            typed_name.name, parameters, handle.sessions, handle.shared_state_deadline
        )

    @property
    def typed_name(self) -> TypedName:
        return self._typed_name

    def produces(self) -> Sequence[str]:
        return (f"{SESSION_AFFINITY}/{self._typed_name.name}",)

    def consumes(self) -> Sequence[str]:
        return ()

    async def prepare_request_data(
        self, request: InferenceRequest, candidates: Sequence[Candidate]
    ) -> None:
        await self._session.lookup(request)

    def score(
        self, cycle: CycleState, request: InferenceRequest, candidates: Sequence[Candidate]
    ) -> Sequence[float]:
        scores = [0.0] * len(candidates)
        index = self._session.find(request, candidates)
        if index >= 0:
            scores[index] = 1.0
        return scores

    async def pre_request(self, request: InferenceRequest, result: SchedulingResult) -> None:
        await self._session.bind(request, result)

    async def response_header(
        self, request: InferenceRequest, response: object, target: EndpointInfo | None
    ) -> None:
        self._session.respond(request)


def _factory(name: str, parameters: SessionAffinityParameters, handle: Handle) -> Plugin:
    return SessionAffinityScorer(TypedName(TYPE, name), parameters, handle)


def register(registry: PluginRegistry) -> None:
    registry.register(
        TYPE,
        _factory,
        parameters=SessionAffinityParameters,
        description="prefers the endpoint that served the session before",
    )
