"""``always-disagg-pd-decider``, ``prefix-based-pd-decider``: whether a request's prefill
runs on its own endpoint.

``disagg-profile-handler`` names a decider in ``deciders.prefill`` (the llm-d router's
configuration) and asks it once decode has chosen an endpoint, giving the request's prompt
tokens and the part of them that endpoint does not hold cached (both estimated from the
prompt text, as everywhere here).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from domain.plugins.base import EmptyParameters, PluginRegistry, TypedName, class_factory

__all__ = [
    "ALWAYS",
    "PREFIX_BASED",
    "AlwaysDisaggDecider",
    "PDDecider",
    "PrefixBasedDecider",
    "PrefixBasedDeciderParameters",
    "register",
]

ALWAYS = "always-disagg-pd-decider"
PREFIX_BASED = "prefix-based-pd-decider"


@runtime_checkable
class PDDecider(Protocol):
    """Decides whether the prefill runs on a separate endpoint."""

    __slots__ = ()

    def disaggregate(self, prompt_tokens: int, uncached_tokens: int) -> bool: ...


class AlwaysDisaggDecider(PDDecider):
    """Every request with a prompt is prefilled on its own endpoint."""

    __slots__ = ("typed_name",)

    def __init__(self, typed_name: TypedName, parameters: EmptyParameters) -> None:
        self.typed_name = typed_name

    def disaggregate(self, prompt_tokens: int, uncached_tokens: int) -> bool:
        return True


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefixBasedDeciderParameters:
    """``nonCachedTokens`` (0, >= 0): the uncached prompt tokens from which the prefill
    runs on its own endpoint (0: never); ``promptTokens`` (0, >= 0): shorter prompts never
    do (0: no such floor)."""

    non_cached_tokens: int = 0
    prompt_tokens: int = 0

    def __post_init__(self) -> None:
        for key, value in (
            ("nonCachedTokens", self.non_cached_tokens),
            ("promptTokens", self.prompt_tokens),
        ):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{key}: must be an integer, got {value!r}")
            if value < 0:
                raise ValueError(f"{key}: must be >= 0, got {value}")


class PrefixBasedDecider(PDDecider):
    """Disaggregates when the prompt is at least ``promptTokens`` long and the decode
    endpoint lacks at least ``nonCachedTokens`` of it; never when ``nonCachedTokens`` is 0."""

    __slots__ = ("_non_cached", "_prompt", "typed_name")

    def __init__(self, typed_name: TypedName, parameters: PrefixBasedDeciderParameters) -> None:
        self.typed_name = typed_name
        self._non_cached = parameters.non_cached_tokens
        self._prompt = parameters.prompt_tokens

    def disaggregate(self, prompt_tokens: int, uncached_tokens: int) -> bool:
        if self._non_cached == 0 or prompt_tokens < self._prompt:
            return False
        return uncached_tokens >= self._non_cached


def register(registry: PluginRegistry) -> None:
    registry.register(
        ALWAYS,
        class_factory(ALWAYS, AlwaysDisaggDecider),
        description="disagg-profile-handler decider: always prefill on a separate endpoint",
    )
    registry.register(
        PREFIX_BASED,
        class_factory(PREFIX_BASED, PrefixBasedDecider),
        parameters=PrefixBasedDeciderParameters,
        description="disagg-profile-handler decider: prefill apart when enough is uncached",
    )
