"""``disagg-profile-handler`` (alias ``pd-profile-handler``): prefill/decode disaggregation.

The decode profile always runs first and its result is primary. Then, when the handler's
decider says so, the prefill profile runs next, and its endpoint does the prefill (the
Director passes it on in the ``x-prefiller-host-port`` header; see ``prefill_endpoint``).
The decider is the plugin ``deciders.prefill`` names (the llm-d router's
``always-disagg-pd-decider`` or ``prefix-based-pd-decider``); without one, the prefill runs
apart when the prompt part the chosen decode endpoint does not already hold in its prefix
cache is longer than ``threshold`` tokens.

The llm-d router's parameters are accepted in both its forms: nested (``profiles``,
``deciders``, ``stageOrder``) or its deprecated flat one (``decodeProfile``,
``prefillProfile``, ``deciderPluginName``, ``prefillDeciderPluginName``, ...), not mixed.
Only the decode-first stage order is available, and no encode stage.
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
from domain.scheduling.plugins.pd_decider import PDDecider
from domain.scheduling.scheduler import SchedulingFailedError
from domain.scheduling.types import Candidate, InferenceRequest, ProfileRunResult, SchedulingResult
from ports.codec import JsonCodec

__all__ = [
    "ALIAS",
    "CHARS_PER_TOKEN",
    "TYPE",
    "DisaggDeciders",
    "DisaggProfileHandler",
    "DisaggProfileHandlerParameters",
    "DisaggProfiles",
    "prefill_endpoint",
    "register",
]

logger = logging.getLogger(__name__)

TYPE = "disagg-profile-handler"
ALIAS = "pd-profile-handler"
#: Prompt characters assumed per token (the same estimate as the prefix-cache producer).
CHARS_PER_TOKEN = 4

_NO_PROFILES: Mapping[str, Any] = {}
_DECODE_FIRST = frozenset({"", "decodefirst", "decode"})
_PREFILL_FIRST = frozenset({"prefillfirst", "prefill"})


@dataclass(frozen=True, slots=True, kw_only=True)
class DisaggProfiles:
    """``profiles``: the profile names per stage (empty: ``decode``, ``prefill``,
    ``encode``)."""

    decode: str = ""
    prefill: str = ""
    encode: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class DisaggDeciders:
    """``deciders``: the decider plugin of each stage (``encode`` is not available)."""

    prefill: str = ""
    encode: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class DisaggProfileHandlerParameters:
    """``decodeProfile`` / ``prefillProfile``: the profile names (``decode``, ``prefill``);
    ``profiles.decode`` / ``profiles.prefill`` say the same (the llm-d router's nested form).

    ``deciders.prefill`` (or the flat ``prefillDeciderPluginName``, or the older
    ``deciderPluginName``): the decider plugin, which must be listed before the handler.
    ``threshold``: without a decider, prefill runs on its own endpoint only when the
    request's uncached prompt tokens exceed it (default 0: whenever anything is uncached).
    Must be >= 0.

    ``stageOrder``: ``decode-first`` (the default) only. ``encodeProfile`` /
    ``profiles.encode``: accepted, unused (no encode stage here); an encode decider is
    refused.
    """

    decode_profile: str = ""
    prefill_profile: str = ""
    threshold: int = 0
    profiles: DisaggProfiles | None = None
    deciders: DisaggDeciders | None = None
    stage_order: str = ""
    encode_profile: str = ""
    prefill_decider_plugin_name: str = ""
    decider_plugin_name: str = ""
    encode_decider_plugin_name: str = ""

    def __post_init__(self) -> None:
        flat = (
            self.decode_profile,
            self.prefill_profile,
            self.encode_profile,
            self.prefill_decider_plugin_name,
            self.decider_plugin_name,
            self.encode_decider_plugin_name,
        )
        nested = self.profiles is not None or self.deciders is not None
        if nested and any(flat):
            raise ValueError(
                "profiles: give either the nested profiles/deciders or the flat "
                "decodeProfile/prefillProfile/...DeciderPluginName fields, not both"
            )
        deciders = self.deciders or DisaggDeciders()
        if self.decode == self.prefill:
            raise ValueError("prefillProfile: must differ from decodeProfile")
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, int):
            raise ValueError(f"threshold: must be an integer, got {self.threshold!r}")
        if self.threshold < 0:
            raise ValueError(f"threshold: must be >= 0, got {self.threshold}")
        if self.prefill_decider and self.threshold:
            raise ValueError("threshold: give either threshold or a prefill decider, not both")
        if deciders.encode or self.encode_decider_plugin_name:
            key = "deciders" if deciders.encode else "encodeDeciderPluginName"
            raise ValueError(f"{key}: encode disaggregation (E/PD) is not available here")
        order = self.stage_order.lower().replace("-", "").replace("_", "")
        if order in _PREFILL_FIRST:
            raise ValueError("stageOrder: prefill-first is not available here (decode-first is)")
        if order not in _DECODE_FIRST:
            raise ValueError(
                f"stageOrder: must be decode-first or prefill-first, got {self.stage_order!r}"
            )

    @property
    def decode(self) -> str:
        """The decode profile's name."""
        nested = self.profiles.decode if self.profiles is not None else ""
        return nested or self.decode_profile or "decode"

    @property
    def prefill(self) -> str:
        """The prefill profile's name."""
        nested = self.profiles.prefill if self.profiles is not None else ""
        return nested or self.prefill_profile or "prefill"

    @property
    def prefill_decider(self) -> str:
        """The name of the prefill decider plugin ("": ``threshold`` decides)."""
        nested = self.deciders.prefill if self.deciders is not None else ""
        return nested or self.prefill_decider_plugin_name or self.decider_plugin_name


class DisaggProfileHandler(ValidatingProfileHandler):
    """Round 1 runs the decode profile. If it succeeded and the decider says so (without
    one: the uncached prompt tokens on its first endpoint exceed ``threshold``), round 2
    runs the prefill profile.

    Uncached tokens = ``len(prefix_input) // 4`` minus the tokens the decode endpoint's
    ``PrefixCacheMatchInfo`` attribute says it holds (``match_blocks * block_size_tokens``;
    none when the attribute is missing); a request without a body has none.

    ``process_results`` fails as ``single-profile-handler`` does when decode failed;
    otherwise decode is primary and a successful prefill result is included (a failed
    prefill is dropped: decode then serves the whole request).
    """

    __slots__ = ("_codec", "_decider", "_decode", "_prefill", "_threshold", "typed_name")

    def __init__(
        self,
        typed_name: TypedName,
        parameters: DisaggProfileHandlerParameters,
        *,
        codec: JsonCodec,
        decider: PDDecider | None = None,
    ) -> None:
        self.typed_name = typed_name
        self._decode = parameters.decode
        self._prefill = parameters.prefill
        self._threshold = parameters.threshold
        self._decider = decider
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
        if not self._disaggregate(request, decoded.target_endpoints[0]):
            return _NO_PROFILES
        return {self._prefill: prefill}

    def _disaggregate(self, request: InferenceRequest, endpoint: Candidate) -> bool:
        if request.body is None:
            return False
        prompt = self.prompt_tokens(request)
        uncached = self.uncached_tokens(request, endpoint)
        if self._decider is not None:
            return self._decider.disaggregate(prompt, uncached)
        return uncached > self._threshold

    def prompt_tokens(self, request: InferenceRequest) -> int:
        """Estimated prompt tokens of ``request`` (0 without a body)."""
        body = request.body
        return 0 if body is None else len(body.prefix_input(self._codec)) // CHARS_PER_TOKEN

    def uncached_tokens(self, request: InferenceRequest, endpoint: Candidate) -> int:
        """Estimated prompt tokens of ``request`` that ``endpoint`` does not have cached."""
        if request.body is None:
            return 0
        match = endpoint.attributes.get(PREFIX_CACHE_MATCH_INFO)
        cached = (
            match.match_blocks * match.block_size_tokens
            if isinstance(match, PrefixCacheMatchInfo)
            else 0
        )
        return max(self.prompt_tokens(request) - cached, 0)

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
    decider: PDDecider | None = None
    if parameters.prefill_decider:
        found = handle.plugins.get(parameters.prefill_decider)
        if found is None:
            raise PluginConfigError(
                f"deciders: no plugin named {parameters.prefill_decider!r} before this "
                "handler (list the decider first)"
            )
        if not isinstance(found, PDDecider):
            raise PluginConfigError(
                f"deciders: plugin {parameters.prefill_decider!r} (type "
                f"{found.typed_name.type}) is not a prefill/decode decider"
            )
        decider = found
    return DisaggProfileHandler(
        TypedName(TYPE, name), parameters, codec=handle.codec, decider=decider
    )


def register(registry: PluginRegistry) -> None:
    registry.register(
        TYPE,
        _factory,
        parameters=DisaggProfileHandlerParameters,
        description="prefill/decode disaggregation: decode first, prefill when uncached",
    )
    registry.alias(ALIAS, TYPE)
