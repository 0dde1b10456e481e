"""``header-profile-handler``: run the one scheduling profile a request header names.

- One profile configured: it always runs, whatever the header says.
- Several: the profile named by the header ``headerName`` (``EPP-Profile``, matched
  without regard to case, as every header name) runs alone; a missing or blank header runs
  ``defaultProfile`` (``decode``); a value naming no configured profile runs nothing, so
  the request fails as unschedulable (429, as in the reference) and the reason is logged.

The profile that ran is the primary one.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from domain.plugins.base import PluginRegistry, TypedName, class_factory
from domain.scheduling.interfaces import ProfileT
from domain.scheduling.scheduler import SchedulingFailedError
from domain.scheduling.types import InferenceRequest, ProfileRunResult, SchedulingResult

__all__ = ["TYPE", "HeaderProfileHandler", "HeaderProfileHandlerParameters", "register"]

logger = logging.getLogger(__name__)

TYPE = "header-profile-handler"

_NO_PROFILES: Mapping[str, Any] = {}


@dataclass(frozen=True, slots=True, kw_only=True)
class HeaderProfileHandlerParameters:
    """``headerName`` (``EPP-Profile``, not empty) and ``defaultProfile`` (``decode``)."""

    header_name: str = "EPP-Profile"
    default_profile: str = "decode"

    def __post_init__(self) -> None:
        if not self.header_name.strip():
            raise ValueError("headerName: must not be empty")


class HeaderProfileHandler:
    """Picks one profile per request from a header; see the module docstring."""

    __slots__ = ("_default", "_header", "typed_name")

    def __init__(self, typed_name: TypedName, parameters: HeaderProfileHandlerParameters) -> None:
        self.typed_name = typed_name
        self._header = parameters.header_name.strip().lower()
        self._default = parameters.default_profile

    def pick_profiles(
        self,
        request: InferenceRequest,
        profiles: Mapping[str, ProfileT],
        results: Mapping[str, ProfileRunResult | None],
    ) -> Mapping[str, ProfileT]:
        if results:
            return _NO_PROFILES
        if len(profiles) == 1:
            return profiles
        value = request.headers.get(self._header, "").strip()
        name = value or self._default
        profile = profiles.get(name)
        if profile is None:
            logger.info(
                "no scheduling profile %r (%s); configured: %s",
                name,
                f"from header {self._header}" if value else "the default profile",
                ", ".join(profiles),
            )
            return _NO_PROFILES
        return {name: profile}

    def process_results(
        self, request: InferenceRequest, results: Mapping[str, ProfileRunResult | None]
    ) -> SchedulingResult:
        if len(results) != 1:
            raise SchedulingFailedError("no scheduling profile was selected for the request")
        ((name, result),) = results.items()
        if result is None:
            raise SchedulingFailedError(f"failed to run scheduler profile '{name}'")
        return SchedulingResult(profile_results={name: result}, primary_profile_name=name)


def register(registry: PluginRegistry) -> None:
    registry.register(
        TYPE,
        class_factory(TYPE, HeaderProfileHandler),
        parameters=HeaderProfileHandlerParameters,
        description="runs the scheduling profile a request header names",
    )
