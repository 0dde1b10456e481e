"""``disagg-profile-handler`` (alias ``pd-profile-handler``): prefill/decode disaggregation.

The decode profile always runs first and its result is primary. When the prompt part the
chosen decode endpoint does not already hold in its prefix cache is longer than
``threshold`` tokens, the prefill profile runs next, and its endpoint does the prefill
(the Director passes it on in the ``x-prefiller-host-port`` header; see
``prefill_endpoint``).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from domain.datalayer.attributes import PREFIX_CACHE_MATCH_INFO, PrefixCacheMatchInfo
from domain.plugins.base import Plugin, PluginConfigError, PluginRegistry, TypedName
from domain.plugins.handle import Handle
from domain.plugins.hooks import ValidatingProfileHandler
from domain.scheduling.interfaces import ProfileT
from domain.scheduling.scheduler import SchedulingFailedError
from domain.scheduling.types import Candidate, InferenceRequest, ProfileRunResult, SchedulingResult
from ports.codec import JsonCodec

__all__ = [
    "ALIAS",
    "CHARS_PER_TOKEN",
    "TYPE",
    "DisaggProfileHandler",
    "DisaggProfileHandlerParameters",
    "prefill_endpoint",
    "register",
]

logger = logging.getLogger(__name__)

TYPE = "disagg-profile-handler"
ALIAS = "pd-profile-handler"
#: Prompt characters assumed per token (the same estimate as the prefix-cache producer).
CHARS_PER_TOKEN = 4

_NO_PROFILES: Mapping[str, Any] = {}


@dataclass(frozen=True, slots=True, kw_only=True)
class DisaggProfileHandlerParameters:
    """``decodeProfile`` / ``prefillProfile``: the profile names (``decode``, ``prefill``).

    ``threshold``: prefill runs on its own endpoint only when the request's uncached prompt
    tokens exceed it (default 0: whenever anything is uncached). Must be >= 0.
    """

    decode_profile: str = "decode"
    prefill_profile: str = "prefill"
    threshold: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.decode_profile, str) or not self.decode_profile:
            raise ValueError("decodeProfile: must be a non-empty string")
        if not isinstance(self.prefill_profile, str) or not self.prefill_profile:
            raise ValueError("prefillProfile: must be a non-empty string")
        if self.decode_profile == self.prefill_profile:
            raise ValueError("prefillProfile: must differ from decodeProfile")
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, int):
            raise ValueError(f"threshold: must be an integer, got {self.threshold!r}")
        if self.threshold < 0:
            raise ValueError(f"threshold: must be >= 0, got {self.threshold}")


class DisaggProfileHandler(ValidatingProfileHandler):
    """Round 1 runs the decode profile. If it succeeded and the uncached prompt tokens on
    its first endpoint exceed ``threshold``, round 2 runs the prefill profile.

    Uncached tokens = ``len(prefix_input) // 4`` minus the tokens the decode endpoint's
    ``PrefixCacheMatchInfo`` attribute says it holds (``match_blocks * block_size_tokens``;
    none when the attribute is missing); a request without a body has none.

    ``process_results`` fails as ``single-profile-handler`` does when decode failed;
    otherwise decode is primary and a successful prefill result is included (a failed
    prefill is dropped: decode then serves the whole request).
    """

    __slots__ = ("_codec", "_decode", "_prefill", "_threshold", "typed_name")

    def __init__(
        self,
        typed_name: TypedName,
        parameters: DisaggProfileHandlerParameters,
        *,
        codec: JsonCodec,
    ) -> None:
        self.typed_name = typed_name
        self._decode = parameters.decode_profile
        self._prefill = parameters.prefill_profile
        self._threshold = parameters.threshold
        self._codec = codec

    @property
    def decode_profile(self) -> str:
        return self._decode

    @property
    def prefill_profile(self) -> str:
        return self._prefill

    def validate_profiles(self, names: Collection[str]) -> None:
        """Refuse a configuration without the decode or the prefill profile."""
        for key, profile in (("decodeProfile", self._decode), ("prefillProfile", self._prefill)):
            if profile not in names:
                raise PluginConfigError(
                    f"{self.typed_name.type} {self.typed_name.name!r}: scheduling profile "
                    f"{profile!r} ({key}) is not defined"
                )
        unused = sorted(set(names) - {self._decode, self._prefill})
        if unused:
            logger.warning(
                "%s never runs scheduling profiles %s", self.typed_name, ", ".join(unused)
            )

    def pick_profiles(
        self,
        request: InferenceRequest,
        profiles: Mapping[str, ProfileT],
        results: Mapping[str, ProfileRunResult | None],
    ) -> Mapping[str, ProfileT]:
        if not results:
            decode = profiles.get(self._decode)
            return {self._decode: decode} if decode is not None else _NO_PROFILES
        if self._prefill in results or self._decode not in results:
            return _NO_PROFILES
        decoded = results[self._decode]
        if decoded is None or not decoded.target_endpoints:
            return _NO_PROFILES
        prefill = profiles.get(self._prefill)
        if prefill is None:
            return _NO_PROFILES
        if self.uncached_tokens(request, decoded.target_endpoints[0]) <= self._threshold:
            return _NO_PROFILES
        return {self._prefill: prefill}

    def uncached_tokens(self, request: InferenceRequest, endpoint: Candidate) -> int:
        """Estimated prompt tokens of ``request`` that ``endpoint`` does not have cached."""
        body = request.body
        if body is None:
            return 0
        prompt_tokens = len(body.prefix_input(self._codec)) // CHARS_PER_TOKEN
        match = endpoint.attributes.get(PREFIX_CACHE_MATCH_INFO)
        cached = (
            match.match_blocks * match.block_size_tokens
            if isinstance(match, PrefixCacheMatchInfo)
            else 0
        )
        return max(prompt_tokens - cached, 0)

    def process_results(
        self, request: InferenceRequest, results: Mapping[str, ProfileRunResult | None]
    ) -> SchedulingResult:
        decoded = results.get(self._decode)
        if decoded is None:
            raise SchedulingFailedError(f"failed to run scheduler profile '{self._decode}'")
        chosen: dict[str, ProfileRunResult | None] = {self._decode: decoded}
        prefilled = results.get(self._prefill)
        if prefilled is not None and prefilled.target_endpoints:
            chosen[self._prefill] = prefilled
        elif self._prefill in results:
            logger.debug(
                "prefill profile failed for %s; decode serves it whole", request.request_id
            )
        return SchedulingResult(profile_results=chosen, primary_profile_name=self._decode)


def prefill_endpoint(result: SchedulingResult) -> Candidate | None:
    """The endpoint that should run the prefill, or ``None`` (no disaggregation).

    It is the first endpoint of the one non-primary profile result: the disagg handler
    records at most one besides decode, its prefill run. Results of other handlers have
    no non-primary result, so ``None``.
    """
    for name, profile_result in result.profile_results.items():
        if (
            name != result.primary_profile_name
            and profile_result is not None
            and profile_result.target_endpoints
        ):
            return profile_result.target_endpoints[0]
    return None


def _factory(name: str, parameters: DisaggProfileHandlerParameters, handle: Handle) -> Plugin:
    return DisaggProfileHandler(TypedName(TYPE, name), parameters, codec=handle.codec)


def register(registry: PluginRegistry) -> None:
    registry.register(
        TYPE,
        _factory,
        parameters=DisaggProfileHandlerParameters,
        description="prefill/decode disaggregation: decode first, prefill when uncached",
    )
    registry.alias(ALIAS, TYPE)
