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
    SESSION_AFFINITY,
    SessionAffinity,
    SessionAffinityParameters,
)
from domain.scheduling.types import Candidate, InferenceRequest, SchedulingResult
from ports.endpoints import EndpointInfo

__all__ = ["TYPE", "SessionAffinityFilter", "register"]

TYPE = "session-affinity-filter"


class SessionAffinityFilter:
    """Filter + DataProducer (the ``session_id`` lookup) + PreRequest (the binding) +
    ResponseHeaderProcessor (the token)."""

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

    def filter(
        self, cycle: CycleState, request: InferenceRequest, candidates: Sequence[Candidate]
    ) -> Sequence[Candidate]:
        index = self._session.find(request, candidates)
        return candidates if index < 0 else [candidates[index]]

    async def pre_request(self, request: InferenceRequest, result: SchedulingResult) -> None:
        await self._session.bind(request, result)

    async def response_header(
        self, request: InferenceRequest, response: object, target: EndpointInfo | None
    ) -> None:
        self._session.respond(request)


def _factory(name: str, parameters: SessionAffinityParameters, handle: Handle) -> Plugin:
    return SessionAffinityFilter(TypedName(TYPE, name), parameters, handle)


def register(registry: PluginRegistry) -> None:
    registry.register(
        TYPE,
        _factory,
        parameters=SessionAffinityParameters,
        description="pins a session to the endpoint that served it (token header or session id)",
    )
