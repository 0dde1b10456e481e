"""What ``session-affinity-filter`` and ``session-affinity-scorer`` share: the parameters,
the two strategies, and finding the session's endpoint among the candidates.

- ``encoded_endpoint_header`` (the default, stateless): the client echoes a header
  (``x-session-token``) whose value is the base64 of ``namespace/name`` of the endpoint
  that served its previous request; the plugin writes that header on every response.
- ``session_id`` (stateful): the client sends an opaque session id (``sources``: request
  headers, first non-empty wins; ``x-session-id`` by default). The plugin binds the id to
  the endpoint the request went to, in the Handle's ``SessionStore`` (in memory, or shared
  by the replicas when the app wires a shared store), for ``evictionTtlSeconds`` (300)
  after the last use. Nothing is written back to the client.

Either way the session's endpoint is looked up among this request's candidates by
``namespace/name``: a token that is not valid base64 or UTF-8, that is too long, that names
an endpoint no longer in the pool, or one of another pool (another namespace) matches no
candidate and the request is routed as if it had none; it is never an error. ``profileName``
picks the profile whose chosen endpoint is remembered (the primary profile when empty).

The store is asked under a budget (the Handle's ``shared_state_deadline``, ``--redis-deadline``,
per read or write): a store that fails
or is slow (a shared store that is down) leaves the session unbound for that request, never
fails it; the failure is logged when the store's state changes, not per request.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field

from domain.plugins.base import TypedName
from domain.plugins.handle import Handle
from domain.plugins.state import StateKey
from domain.scheduling.types import Candidate, InferenceRequest, SchedulingResult
from domain.sharedstate.degraded import DegradedGauge
from ports.endpoints import EndpointInfo
from ports.sessions import SessionStore
from ports.shared_state import SharedStateError

__all__ = [
    "ENCODED_ENDPOINT_HEADER",
    "SESSION_AFFINITY",
    "SESSION_ID",
    "EncodedEndpointHeaderConfig",
    "SessionAffinity",
    "SessionAffinityParameters",
    "SessionIdConfig",
    "SessionIdSource",
    "decode_token",
    "encode_token",
]

logger = logging.getLogger(__name__)

ENCODED_ENDPOINT_HEADER = "encoded_endpoint_header"
SESSION_ID = "session_id"
#: The data key the ``session_id`` strategy's lookup produces (the bound endpoint).
SESSION_AFFINITY = "SessionAffinity"
#: Longest token or session id looked at; longer ones are ignored (routed as absent).
MAX_VALUE_CHARS = 512

_BOUND: StateKey[str] = StateKey("session-affinity.bound")


def endpoint_key(info: EndpointInfo) -> str:
    return f"{info.namespace}/{info.name}"


def encode_token(info: EndpointInfo) -> str:
    return base64.b64encode(endpoint_key(info).encode()).decode("ascii")


def decode_token(token: str) -> str | None:
    """The ``namespace/name`` a token names, or None when it is not a valid token."""
    if not token or len(token) > MAX_VALUE_CHARS:
        return None
    try:
        return base64.b64decode(token, validate=True).decode("utf-8")
    except (binascii.Error, ValueError):
        return None


@dataclass(frozen=True, slots=True, kw_only=True)
class EncodedEndpointHeaderConfig:
    """``header`` (``x-session-token``): the request and response header of the token."""

    header: str = "x-session-token"

    def __post_init__(self) -> None:
        if not self.header.strip():
            raise ValueError("header: must not be empty")


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionIdSource:
    """One place the session id is read from: ``header`` (a request header name).
    ``attribute`` (a request attribute of an upstream plugin) is refused: nothing here
    publishes request attributes."""

    header: str = ""
    attribute: str = ""

    def __post_init__(self) -> None:
        if self.attribute:
            raise ValueError(
                "attribute: no plugin of this EPP publishes request attributes; use header"
            )
        if not self.header.strip():
            raise ValueError("header: must not be empty")


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionIdConfig:
    """``sources`` (one header, ``x-session-id``), ``evictionTtlSeconds`` (300, > 0),
    ``evictionSweepSeconds`` (10, > 0; the in-memory store drops expired bindings as it
    goes, so it only bounds how late that happens)."""

    sources: tuple[SessionIdSource, ...] = field(
        default_factory=lambda: (SessionIdSource(header="x-session-id"),)
    )
    eviction_ttl_seconds: float = 300.0
    eviction_sweep_seconds: float = 10.0

    def __post_init__(self) -> None:
        if not self.sources:
            raise ValueError("sources: at least one source is required")
        if not 0 < self.eviction_ttl_seconds < float("inf"):
            raise ValueError("evictionTtlSeconds: must be a finite number > 0")
        if not 0 < self.eviction_sweep_seconds < float("inf"):
            raise ValueError("evictionSweepSeconds: must be a finite number > 0")


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionAffinityParameters:
    """``strategy`` (``encoded_endpoint_header`` or ``session_id``), ``profileName`` (""),
    ``encodedEndpointHeaderConfig``, ``sessionIdConfig``."""

    strategy: str = ENCODED_ENDPOINT_HEADER
    profile_name: str = ""
    encoded_endpoint_header_config: EncodedEndpointHeaderConfig = field(
        default_factory=EncodedEndpointHeaderConfig
    )
    session_id_config: SessionIdConfig = field(default_factory=SessionIdConfig)

    def __post_init__(self) -> None:
        if self.strategy not in (ENCODED_ENDPOINT_HEADER, SESSION_ID):
            raise ValueError(
                f"strategy: must be {ENCODED_ENDPOINT_HEADER} or {SESSION_ID}, "
                f"got {self.strategy!r}"
            )


class SessionAffinity:
    """The session logic of one plugin instance (``owner`` namespaces its state)."""

    def __init__(
        self,
        owner: str,
        parameters: SessionAffinityParameters,
        store: SessionStore,
        budget: float,
        degraded: DegradedGauge | None = None,
    ) -> None:
        self._owner = owner
        self._degraded = degraded
        self.stateless = parameters.strategy == ENCODED_ENDPOINT_HEADER
        self.header = parameters.encoded_endpoint_header_config.header.strip().lower()
        config = parameters.session_id_config
        self._sources = tuple(s.header.strip().lower() for s in config.sources)
        self._ttl = config.eviction_ttl_seconds
        self._profile = parameters.profile_name
        self._store = store
        self._store_failing = False
        self._budget = budget

    def _session_id(self, request: InferenceRequest) -> str | None:
        for name in self._sources:
            value = request.headers.get(name, "").strip()
            if value:
                return value if len(value) <= MAX_VALUE_CHARS else None
        return None

    def _store_key(self, session: str) -> str:
        return f"{self._owner}\x00{session}"

    async def lookup(self, request: InferenceRequest) -> None:
        """``session_id``: read the session's binding into the request state."""
        if self.stateless:
            return
        session = self._session_id(request)
        if session is None:
            return
        bound = await self._guarded(self._store.get(self._store_key(session)))
        if bound is not None:
            request.state.put(self._owner, _BOUND, bound)

    def wanted(self, request: InferenceRequest) -> str | None:
        """The ``namespace/name`` this request's session points at, if any."""
        if self.stateless:
            return decode_token(request.headers.get(self.header, "").strip())
        return request.state.get(self._owner, _BOUND)

    def find(self, request: InferenceRequest, candidates: Sequence[Candidate]) -> int:
        """The index of the session's endpoint among ``candidates``; -1 when absent."""
        wanted = self.wanted(request)
        if wanted is None:
            return -1
        for i, c in enumerate(candidates):
            if endpoint_key(c.info) == wanted:
                return i
        return -1

    def target(self, result: SchedulingResult | None) -> Candidate | None:
        if result is None:
            return None
        run = result.profile_results.get(self._profile or result.primary_profile_name)
        if run is None or not run.target_endpoints:
            return None
        return run.target_endpoints[0]

    async def bind(self, request: InferenceRequest, result: SchedulingResult) -> None:
        """``session_id``: bind the session to the endpoint the request goes to."""
        if self.stateless:
            return
        session = self._session_id(request)
        target = self.target(result)
        if session is None or target is None:
            return
        await self._guarded(
            self._store.put(self._store_key(session), endpoint_key(target.info), self._ttl)
        )

    async def _guarded(self, call: Awaitable[str | None]) -> str | None:
        """``call`` under the budget; a failure or timeout gives None."""
        try:
            async with asyncio.timeout(self._budget):
                result = await call
        except (SharedStateError, TimeoutError) as exc:
            if not self._store_failing:
                self._store_failing = True
                self._report()
                logger.warning(
                    "%s: the session store failed (%s); sessions route as unbound until it answers",
                    self._owner,
                    str(exc) or type(exc).__name__,
                )
            return None
        if self._store_failing:
            self._store_failing = False
            logger.info("%s: the session store answers again", self._owner)
            self._report()
        return result

    def _report(self) -> None:
        if self._degraded is not None:
            self._degraded.set(f"sessions:{self._owner}", self._store_failing)

    def respond(self, request: InferenceRequest) -> None:
        """``encoded_endpoint_header``: put the token of the chosen endpoint on the
        response."""
        if not self.stateless:
            return
        target = self.target(request.scheduling_result)
        if target is not None:
            request.add_response_header(self.header, encode_token(target.info))


class SessionAffinityHooks:
    """What the filter and the scorer share: the ``session_id`` lookup (DataProducer), the
    binding (PreRequest) and the token (ResponseHeaderProcessor), around one
    ``SessionAffinity``."""

    def __init__(
        self, typed_name: TypedName, parameters: SessionAffinityParameters, handle: Handle
    ) -> None:
        self._typed_name = typed_name
        self._session = SessionAffinity(
            typed_name.name,
            parameters,
            handle.sessions,
            handle.shared_state_deadline,
            handle.shared_degraded,
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

    async def pre_request(self, request: InferenceRequest, result: SchedulingResult) -> None:
        await self._session.bind(request, result)

    async def response_header(
        self, request: InferenceRequest, response: object, target: EndpointInfo | None
    ) -> None:
        self._session.respond(request)
