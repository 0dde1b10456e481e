"""The scheduler: the profile handler's loop over profiles."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence

from domain.errors import EppError, InternalError, ResourceExhaustedError
from domain.scheduling.interfaces import ProfileHandler
from domain.scheduling.observer import SchedulingObserver
from domain.scheduling.profile import SchedulerProfile
from domain.scheduling.types import (
    Candidate,
    InferenceRequest,
    ProfileRunResult,
    SchedulingResult,
)

__all__ = ["Scheduler", "SchedulingFailedError"]

logger = logging.getLogger(__name__)


class SchedulingFailedError(ResourceExhaustedError):
    """No profile produced a usable result (HTTP 429, as the reference)."""


class Scheduler:
    """Asks the handler for profiles until it returns none, runs each, combines results.

    A profile that raises is recorded as failed (``None``) and the loop goes on; the
    handler decides what a failure means. The whole decision fails with
    ``ResourceExhausted`` (429, as the reference) when no profile ran or the handler
    cannot produce a result.
    """

    def __init__(
        self,
        handler: ProfileHandler,
        profiles: Mapping[str, SchedulerProfile],
        observer: SchedulingObserver | None = None,
        max_rounds: int = 16,
    ) -> None:
        if not profiles:
            raise ValueError("a scheduler needs at least one profile")
        self.handler = handler
        self.profiles = dict(profiles)
        self._observer = observer or SchedulingObserver()
        self._max_rounds = max_rounds

    def schedule(
        self, request: InferenceRequest, candidates: Sequence[Candidate]
    ) -> SchedulingResult:
        started = time.perf_counter()
        try:
            result = self._schedule(request, candidates)
        except EppError:
            self._observer.scheduled(time.perf_counter() - started, False)
            raise
        self._observer.scheduled(time.perf_counter() - started, True)
        return result

    def _schedule(
        self, request: InferenceRequest, candidates: Sequence[Candidate]
    ) -> SchedulingResult:
        results: dict[str, ProfileRunResult | None] = {}
        errors: dict[str, str] = {}
        observe = self._observer.plugin_duration
        for _ in range(self._max_rounds):
            t0 = time.perf_counter()
            chosen = self.handler.pick_profiles(request, self.profiles, results)
            observe("ProfilePicker", self.handler.typed_name, time.perf_counter() - t0)
            if not chosen:
                break
            for name, profile in chosen.items():
                try:
                    results[name] = profile.run(request, candidates)
                except EppError as exc:
                    results[name] = None
                    errors[name] = exc.message
                    logger.debug("profile %s failed for %s: %s", name, request.request_id, exc)
        else:
            raise InternalError("the profile handler kept picking profiles")
        if not results:
            raise SchedulingFailedError("failed to run any scheduler profile")
        t0 = time.perf_counter()
        try:
            outcome = self.handler.process_results(request, results)
        except EppError as exc:
            detail = "; ".join(f"{k}: {v}" for k, v in errors.items()) or exc.message
            raise SchedulingFailedError(f"failed to find target endpoint: {detail}") from exc
        finally:
            observe("ProcessProfilesResults", self.handler.typed_name, time.perf_counter() - t0)
        return outcome
