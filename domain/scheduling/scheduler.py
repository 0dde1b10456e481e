"""The scheduler: the profile handler's loop over profiles."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence

from domain.errors import EppError, InternalError, ResourceExhaustedError
from domain.scheduling.interfaces import ProfileHandler
from domain.scheduling.observer import PROFILE_SPAN, SCHEDULING_SPAN, SchedulingObserver
from domain.scheduling.profile import SchedulerProfile
from domain.scheduling.types import (
    Candidate,
    InferenceRequest,
    ProfileRunResult,
    SchedulingResult,
)
from ports.observer import Span

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

    Every plugin call's duration and every attempt go to the observer (which the profiles
    share unless they were built with their own); with a ``span``, the attempt is a
    ``gateway.scheduling`` child span of it with one ``gateway.scheduling.profile`` child
    per profile run.
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
        for profile in self.profiles.values():
            profile.adopt_observer(self._observer)

    def schedule(
        self,
        request: InferenceRequest,
        candidates: Sequence[Candidate],
        *,
        span: Span | None = None,
        record: bool = True,
    ) -> SchedulingResult:
        """Run the profiles. A failure is recorded as an attempt at once; a success too
        unless ``record`` is false: then the caller calls ``record_attempt`` with the
        result the request is routed on (a placement claim may move its first target)."""
        observer = self._observer
        started = time.perf_counter()
        scheduling_span = None
        if span is not None and span.recording:  # spans only for a trace that is kept
            scheduling_span = observer.start_span(SCHEDULING_SPAN, span)
        try:
            result = self._schedule(request, candidates, scheduling_span)
        except EppError as exc:
            observer.attempt(time.perf_counter() - started, request.target_model, None)
            if scheduling_span is not None:
                scheduling_span.record_error(exc.message)
                scheduling_span.end()
            raise
        if record:
            observer.attempt(time.perf_counter() - started, request.target_model, result)
        if scheduling_span is not None:
            scheduling_span.end()
        return result

    def record_attempt(
        self, request: InferenceRequest, seconds: float, result: SchedulingResult
    ) -> None:
        """A successful attempt that took ``seconds``, routed on ``result``."""
        self._observer.attempt(seconds, request.target_model, result)

    def _schedule(
        self,
        request: InferenceRequest,
        candidates: Sequence[Candidate],
        span: Span | None,
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
                profile_span = None
                if span is not None and span.recording:
                    profile_span = self._observer.start_span(PROFILE_SPAN, span)
                    profile_span.set_attribute("profile", name)
                try:
                    results[name] = run = profile.run(request, candidates, profile_span)
                except EppError as exc:
                    results[name] = None
                    errors[name] = exc.message
                    logger.debug("profile %s failed for %s: %s", name, request.request_id, exc)
                    if profile_span is not None:
                        profile_span.record_error(exc.message)
                else:
                    if profile_span is not None:
                        profile_span.set_attribute(
                            "picked", ",".join(c.info.name for c in run.target_endpoints)
                        )
                finally:
                    if profile_span is not None:
                        profile_span.end()
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
