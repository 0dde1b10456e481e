"""The scheduling framework: profiles of filters, weighted scorers and a picker."""

from domain.scheduling.interfaces import CycleState, Filter, Picker, ProfileHandler, Scorer
from domain.scheduling.profile import NoEndpointsError, SchedulerProfile, WeightedScorer
from domain.scheduling.scheduler import Scheduler, SchedulingFailedError
from domain.scheduling.types import (
    Candidate,
    InferenceRequest,
    ProfileRunResult,
    SchedulingResult,
    ScoredCandidate,
)

__all__ = [
    "Candidate",
    "CycleState",
    "Filter",
    "InferenceRequest",
    "NoEndpointsError",
    "Picker",
    "ProfileHandler",
    "ProfileRunResult",
    "Scheduler",
    "SchedulerProfile",
    "SchedulingFailedError",
    "SchedulingResult",
    "ScoredCandidate",
    "Scorer",
    "WeightedScorer",
]
