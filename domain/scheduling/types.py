"""The values a scheduling cycle works on: the request, candidates, results."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from domain.datastore.endpoint import Endpoint, EndpointMetrics
from ports.endpoints import EndpointInfo
from ports.observer import Span

if TYPE_CHECKING:
    from domain.plugins.state import RequestState
    from domain.requesthandling.openai import ParsedRequest

__all__ = [
    "Candidate",
    "InferenceRequest",
    "ProfileExplanation",
    "ProfileRunResult",
    "SchedulingResult",
    "ScoredCandidate",
]


class Candidate:
    """One endpoint as a request sees it: a snapshot taken when scheduling starts.

    ``info`` and ``metrics`` are the immutable objects current at snapshot time; later
    metric updates do not show. ``attributes`` is this request's own copy of the endpoint's
    attributes: data producers write per-request data here (prefix match, in-flight load)
    without touching the live endpoint.
    """

    __slots__ = ("attributes", "endpoint", "info", "metrics")

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self.info: EndpointInfo = endpoint.info
        self.metrics: EndpointMetrics | None = endpoint.metrics
        self.attributes: dict[str, object] = (
            dict(endpoint.attributes) if endpoint.attributes else {}
        )

    @property
    def name(self) -> str:
        return self.info.name

    def __repr__(self) -> str:
        return f"Candidate({self.info.name})"


@dataclass(frozen=True, slots=True)
class ScoredCandidate:
    candidate: Candidate
    score: float


@dataclass(frozen=True, slots=True)
class ProfileRunResult:
    """The endpoints a profile chose, best first. ``alternates``: the other candidates that
    passed the profile's filters, in no particular order (set by the profile run; a
    ``PlacementClaimer`` may move the request to one of them)."""

    target_endpoints: tuple[Candidate, ...]
    alternates: tuple[Candidate, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulingResult:
    """Every profile's result (``None`` for a profile that failed) and the primary one."""

    profile_results: Mapping[str, ProfileRunResult | None]
    primary_profile_name: str

    @property
    def primary(self) -> ProfileRunResult | None:
        return self.profile_results.get(self.primary_profile_name)


@dataclass(frozen=True, slots=True)
class ProfileExplanation:
    """One profile run's scores, kept when decisions are explained: every candidate that
    passed the filters, its weighted total, and each scorer's ``name=score``."""

    candidates: Sequence[Candidate]
    totals: list[float]
    scores: list[list[str]]


@dataclass(slots=True, kw_only=True)
class InferenceRequest:
    """What plugins see of a request.

    ``body`` is the parsed body (``None`` for a request without one); ``target_model`` is
    the model the request is sent with after any rewrite; ``priority`` comes from the
    InferenceObjective named by ``x-gateway-inference-objective`` (0 when none).
    ``state`` is the request-scoped store shared by the plugins' extension points.

    ``explanations`` is a dict only when decisions are explained (``--explain-decisions``):
    each profile run adds its ``ProfileExplanation`` under its name. ``response_headers``
    are the headers plugins asked to add to the response (``add_response_header``),
    ``upstream_headers`` those to set on the request sent to the endpoint
    (``add_upstream_header``).
    """

    request_id: str
    target_model: str
    incoming_model: str
    body: ParsedRequest | None
    headers: Mapping[str, str]
    priority: int
    request_size_bytes: int
    state: RequestState
    objective: str = ""
    fairness_id: str = "default-flow"
    #: Monotonic time (seconds) the request's body was complete at the EPP.
    received_at: float = 0.0
    #: The gateway's span of the whole exchange (a plugin's spans are its children);
    #: ``None`` without tracing.
    span: Span | None = None
    scheduling_result: SchedulingResult | None = None
    explanations: dict[str, ProfileExplanation] | None = None
    #: Profile name -> (the scored candidates, their weighted totals), kept only when the
    #: scores are emitted (``--emit-endpoint-scores``).
    profile_scores: dict[str, tuple[Sequence[Candidate], list[float]]] | None = None
    response_headers: list[tuple[str, str]] | None = None
    upstream_headers: list[tuple[str, str]] | None = None

    def add_response_header(self, name: str, value: str) -> None:
        """Ask for ``name: value`` on the response sent back to the client (response-header
        hooks call this; the Director adds the headers once those hooks have run)."""
        if self.response_headers is None:
            self.response_headers = []
        self.response_headers.append((name, value))

    def add_upstream_header(self, name: str, value: str) -> None:
        """Ask for ``name: value`` on the request sent to the chosen endpoint (PreRequest
        hooks call this; the decision carries it, after the client's headers)."""
        if self.upstream_headers is None:
            self.upstream_headers = []
        self.upstream_headers.append((name, value))
