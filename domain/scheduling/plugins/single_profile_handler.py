"""``single-profile-handler``: run the one configured profile; its result is primary."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from domain.plugins.base import (
    EmptyParameters,
    PluginConfigError,
    PluginRegistry,
    TypedName,
    class_factory,
)
from domain.plugins.hooks import ValidatingProfileHandler
from domain.scheduling.interfaces import ProfileT
from domain.scheduling.scheduler import SchedulingFailedError
from domain.scheduling.types import InferenceRequest, ProfileRunResult, SchedulingResult

__all__ = ["TYPE", "SingleProfileHandler", "register"]

TYPE = "single-profile-handler"

_NO_PROFILES: Mapping[str, Any] = {}


class SingleProfileHandler(ValidatingProfileHandler):
    """Runs every profile once, in the first round, and nothing afterwards.

    ``process_results`` requires exactly one result, which must not be a failure; that
    profile becomes the primary one. Anything else raises ``SchedulingFailedError``.
    It is meant for a configuration with exactly one profile (``validate_profiles``).
    """

    __slots__ = ("typed_name",)

    def __init__(self, typed_name: TypedName, parameters: EmptyParameters) -> None:
        self.typed_name = typed_name

    def validate_profiles(self, names: Collection[str]) -> None:
        """Refuse a configuration that does not have exactly one profile."""
        if len(names) != 1:
            raise PluginConfigError(
                f"{self.typed_name.type} {self.typed_name.name!r} requires exactly one "
                f"scheduling profile, got {len(names)}"
            )

    def pick_profiles(
        self,
        request: InferenceRequest,
        profiles: Mapping[str, ProfileT],
        results: Mapping[str, ProfileRunResult | None],
    ) -> Mapping[str, ProfileT]:
        return profiles if not results else _NO_PROFILES

    def process_results(
        self, request: InferenceRequest, results: Mapping[str, ProfileRunResult | None]
    ) -> SchedulingResult:
        if len(results) != 1:
            raise SchedulingFailedError(
                "single profile handler is intended to be used with a single profile, "
                f"but {len(results)} results were received"
            )
        ((name, result),) = results.items()
        if result is None:
            raise SchedulingFailedError(f"failed to run scheduler profile '{name}'")
        return SchedulingResult(profile_results={name: result}, primary_profile_name=name)


def register(registry: PluginRegistry) -> None:
    registry.register(
        TYPE,
        class_factory(TYPE, SingleProfileHandler),
        description="runs the single scheduling profile; its result is primary",
    )
