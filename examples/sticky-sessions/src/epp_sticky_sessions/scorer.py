"""``sticky-session-scorer``: the requests of one session go back to the same endpoint.

A client that names its session in a request header (``x-session-id`` by default) has its
later requests scored towards the endpoint that served the session's previous request,
where the conversation's KV cache most likely still is. Requests without the header, and
the first request of a session, are left to the other scorers (every candidate scores 0).
If the remembered endpoint is not a candidate any more (deleted, filtered out as
saturated), the request goes wherever the other scorers send it and the session follows.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from domain.plugins import Handle, Plugin, PluginRegistry, TypedName
from domain.scheduling import Candidate, CycleState, InferenceRequest, SchedulingResult
from domain.scheduling.interfaces import AFFINITY

__all__ = ["TYPE", "SessionAffinityParameters", "SessionAffinityScorer", "register"]

TYPE = "sticky-session-scorer"


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionAffinityParameters:
    """``header``: the request header naming the session (case-insensitive).
    ``maxSessions``: how many sessions are remembered; the least recently routed one is
    forgotten first."""

    header: str = "x-session-id"
    max_sessions: int = 10_000

    def __post_init__(self) -> None:
        if not self.header.strip():
            raise ValueError("header: must not be empty")
        if self.max_sessions <= 0:
            raise ValueError("maxSessions: must be > 0")


class SessionAffinityScorer:
    """A scorer (1 for the session's endpoint, 0 for the others) and a PreRequest hook
    (remembers which endpoint the request was sent to).

    The bindings live in this process: EPP replicas and worker processes each learn their
    own. Both methods run on the event loop, so no lock is needed.
    """

    __slots__ = ("_bindings", "_header", "_max_sessions", "typed_name")

    category = AFFINITY

    def __init__(self, typed_name: TypedName, parameters: SessionAffinityParameters) -> None:
        self.typed_name = typed_name
        self._header = parameters.header.strip().lower()
        self._max_sessions = parameters.max_sessions
        #: session id -> name of the endpoint its last request went to, oldest first.
        self._bindings: OrderedDict[str, str] = OrderedDict()

    def _session(self, request: InferenceRequest) -> str:
        return request.headers.get(self._header, "").strip()

    def score(
        self, cycle: CycleState, request: InferenceRequest, candidates: Sequence[Candidate]
    ) -> Sequence[float]:
        session = self._session(request)
        bound = self._bindings.get(session) if session else None
        if bound is None:
            return [0.0] * len(candidates)
        return [1.0 if c.name == bound else 0.0 for c in candidates]

    async def pre_request(self, request: InferenceRequest, result: SchedulingResult) -> None:
        session = self._session(request)
        primary = result.primary
        if not session or primary is None or not primary.target_endpoints:
            return
        self._bindings[session] = primary.target_endpoints[0].name
        self._bindings.move_to_end(session)
        if len(self._bindings) > self._max_sessions:
            self._bindings.popitem(last=False)


def _factory(name: str, parameters: SessionAffinityParameters, handle: Handle) -> Plugin:
    return SessionAffinityScorer(TypedName(TYPE, name), parameters)


def register(registry: PluginRegistry) -> None:
    """The ``epp.plugins`` entry point: adds ``sticky-session-scorer``."""
    registry.register(
        TYPE,
        _factory,
        parameters=SessionAffinityParameters,
        description="sends the requests of one session (a request header) to the same endpoint",
    )
