"""The profile handlers: single-profile and prefill/decode disaggregation."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from domain.datalayer.attributes import PREFIX_CACHE_MATCH_INFO, PrefixCacheMatchInfo
from domain.plugins.base import PluginConfigError, PluginRegistry, TypedName
from domain.plugins.hooks import ValidatingProfileHandler
from domain.scheduling.interfaces import CycleState, ProfileHandler
from domain.scheduling.plugins import disagg_profile_handler, single_profile_handler
from domain.scheduling.plugins.disagg_profile_handler import (
    DisaggProfileHandler,
    DisaggProfileHandlerParameters,
    prefill_endpoint,
)
from domain.scheduling.plugins.max_score_picker import MaxScorePicker
from domain.scheduling.plugins.picker_parameters import PickerParameters
from domain.scheduling.profile import SchedulerProfile
from domain.scheduling.scheduler import Scheduler, SchedulingFailedError
from domain.scheduling.types import (
    Candidate,
    InferenceRequest,
    ProfileRunResult,
    SchedulingResult,
)
from tests.support.scheduling import candidate, inference_request, plugin_handle


def _registry() -> PluginRegistry:
    registry = PluginRegistry()
    single_profile_handler.register(registry)
    disagg_profile_handler.register(registry)
    return registry


def _handler(type_name: str, parameters: Any = None) -> ProfileHandler:
    plugin = _registry().create(type_name, type_name, parameters, plugin_handle())
    assert isinstance(plugin, ProfileHandler)
    return plugin


class _Only:
    """A test filter keeping the candidates with the given names."""

    def __init__(self, *names: str) -> None:
        self.typed_name = TypedName("only", "only-" + "-".join(names))
        self._names = names

    def filter(
        self, cycle: CycleState, request: InferenceRequest, candidates: Sequence[Candidate]
    ) -> Sequence[Candidate]:
        return [c for c in candidates if c.name in self._names]


def _profile(name: str, *keep: str) -> SchedulerProfile:
    picker = MaxScorePicker(
        TypedName("max-score-picker", "p"), PickerParameters(), rng=random.Random(0)
    )
    return SchedulerProfile(name, filters=[_Only(*keep)], picker=picker)


def _result(*candidates: Candidate) -> ProfileRunResult:
    return ProfileRunResult(target_endpoints=tuple(candidates))


# --- single-profile-handler -----------------------------------------------------------


def test_single_runs_every_profile_once() -> None:
    handler = _handler("single-profile-handler")
    request = inference_request()
    profiles = {"default": _profile("default", "a")}
    assert handler.pick_profiles(request, profiles, {}) == profiles
    assert not handler.pick_profiles(request, profiles, {"default": _result(candidate("a"))})
    assert not handler.pick_profiles(request, profiles, {"default": None})


def test_single_result_becomes_primary() -> None:
    handler = _handler("single-profile-handler")
    result = _result(candidate("a"))
    outcome = handler.process_results(inference_request(), {"only": result})
    assert outcome.primary_profile_name == "only"
    assert outcome.primary is result
    assert dict(outcome.profile_results) == {"only": result}


def test_single_failed_profile_is_an_error() -> None:
    handler = _handler("single-profile-handler")
    with pytest.raises(SchedulingFailedError, match="failed to run scheduler profile 'default'"):
        handler.process_results(inference_request(), {"default": None})


@pytest.mark.parametrize("count", [0, 2])
def test_single_needs_exactly_one_result(count: int) -> None:
    handler = _handler("single-profile-handler")
    results = {f"p{i}": _result(candidate("a")) for i in range(count)}
    with pytest.raises(SchedulingFailedError, match="single profile"):
        handler.process_results(inference_request(), results)


def test_single_validates_one_profile() -> None:
    handler = _handler("single-profile-handler")
    assert isinstance(handler, ValidatingProfileHandler)
    handler.validate_profiles(["default"])
    with pytest.raises(PluginConfigError, match="exactly one"):
        handler.validate_profiles(["a", "b"])


def test_single_end_to_end_with_scheduler() -> None:
    handler = _handler("single-profile-handler")
    scheduler = Scheduler(handler, {"default": _profile("default", "b")})
    outcome = scheduler.schedule(inference_request(), [candidate("a"), candidate("b")])
    assert outcome.primary is not None
    assert [c.name for c in outcome.primary.target_endpoints] == ["b"]
    with pytest.raises(SchedulingFailedError, match="no endpoints available for the given request"):
        scheduler.schedule(inference_request(), [candidate("a")])


# --- disagg-profile-handler: parameters and wiring ------------------------------------


def test_disagg_defaults() -> None:
    params = DisaggProfileHandlerParameters()
    assert (params.decode, params.prefill, params.threshold) == (
        "decode",
        "prefill",
        0,
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"threshold": -1}, "^threshold: must be >= 0"),
        ({"threshold": 1.5}, "^threshold: must be an integer"),
        ({"threshold": True}, "^threshold: must be an integer"),
        ({"decode_profile": "prefill"}, "^prefillProfile: must differ"),
        ({"decode_profile": "x", "prefill_profile": "x"}, "^prefillProfile: must differ"),
    ],
)
def test_disagg_parameter_errors(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DisaggProfileHandlerParameters(**kwargs)


def test_disagg_alias_builds_the_same_handler() -> None:
    registry = _registry()
    assert registry.spec("pd-profile-handler").parameters is DisaggProfileHandlerParameters
    plugin = registry.create("pd-profile-handler", "pd", None, plugin_handle())
    assert isinstance(plugin, DisaggProfileHandler)
    assert plugin.typed_name.name == "pd"


@pytest.mark.parametrize(
    ("names", "missing"),
    [(["decode"], "prefill"), (["prefill"], "decode"), (["default"], "decode")],
)
def test_disagg_validate_profiles_names_the_missing_one(names: list[str], missing: str) -> None:
    handler = _handler("disagg-profile-handler")
    assert isinstance(handler, ValidatingProfileHandler)
    with pytest.raises(PluginConfigError, match=f"'{missing}'"):
        handler.validate_profiles(names)


def test_disagg_validate_profiles_uses_configured_names() -> None:
    params = DisaggProfileHandlerParameters(decode_profile="d", prefill_profile="p")
    handler = _handler("disagg-profile-handler", params)
    assert isinstance(handler, ValidatingProfileHandler)
    handler.validate_profiles(["d", "p"])
    with pytest.raises(PluginConfigError, match="prefillProfile"):
        handler.validate_profiles(["d", "prefill"])


# --- disagg-profile-handler: decisions ------------------------------------------------

PROMPT = "x" * 400  # 100 tokens at 4 characters per token


def _decode_endpoint(match_blocks: int | None) -> Candidate:
    c = candidate("d1")
    if match_blocks is not None:
        c.attributes[PREFIX_CACHE_MATCH_INFO] = PrefixCacheMatchInfo(
            match_blocks=match_blocks, total_blocks=7, block_size_tokens=16
        )
    return c


def _disagg_schedule(
    threshold: int,
    match_blocks: int | None,
    body: Mapping[str, Any] | None = None,
    path: str = "/v1/completions",
) -> SchedulingResult:
    handler = _handler(
        "disagg-profile-handler", DisaggProfileHandlerParameters(threshold=threshold)
    )
    profiles = {"decode": _profile("decode", "d1"), "prefill": _profile("prefill", "p1")}
    request = inference_request(
        {"model": "m", "prompt": PROMPT} if body is None else body, path=path
    )
    return Scheduler(handler, profiles).schedule(
        request, [_decode_endpoint(match_blocks), candidate("p1")]
    )


@pytest.mark.parametrize(
    ("threshold", "match_blocks", "prefill"),
    [
        (0, None, True),  # nothing cached: 100 uncached > 0
        (99, None, True),
        (100, None, False),  # 100 uncached is not above 100
        (19, 5, True),  # 5 blocks x 16 = 80 cached: 20 uncached > 19
        (20, 5, False),
        (0, 7, False),  # 112 cached covers the whole prompt
    ],
)
def test_disagg_prefill_runs_when_uncached_tokens_exceed_threshold(
    threshold: int, match_blocks: int | None, prefill: bool
) -> None:
    outcome = _disagg_schedule(threshold, match_blocks)
    assert outcome.primary_profile_name == "decode"
    assert outcome.primary is not None
    assert [c.name for c in outcome.primary.target_endpoints] == ["d1"]
    if prefill:
        assert set(outcome.profile_results) == {"decode", "prefill"}
        endpoint = prefill_endpoint(outcome)
        assert endpoint is not None
        assert endpoint.name == "p1"
    else:
        assert set(outcome.profile_results) == {"decode"}
        assert prefill_endpoint(outcome) is None


def test_disagg_chat_prompt_is_measured_on_its_messages() -> None:
    messages = [{"role": "user", "content": "y" * 200}]
    # the JSON of the messages is a little over 200 characters: just over 50 tokens
    body = {"model": "m", "messages": messages}
    chat = "/v1/chat/completions"
    assert set(_disagg_schedule(45, None, body, chat).profile_results) == {"decode", "prefill"}
    assert set(_disagg_schedule(60, None, body, chat).profile_results) == {"decode"}


def test_disagg_request_without_body_has_nothing_to_prefill() -> None:
    handler = _handler("disagg-profile-handler")
    profiles = {"decode": _profile("decode", "d1"), "prefill": _profile("prefill", "p1")}
    decoded = {"decode": _result(_decode_endpoint(None))}
    assert not handler.pick_profiles(inference_request(None), profiles, decoded)


def test_disagg_runs_decode_alone_first_and_stops_after_prefill() -> None:
    handler = _handler("disagg-profile-handler")
    request = inference_request({"model": "m", "prompt": PROMPT})
    profiles = {"decode": _profile("decode", "d1"), "prefill": _profile("prefill", "p1")}
    assert list(handler.pick_profiles(request, profiles, {})) == ["decode"]
    decoded: dict[str, ProfileRunResult | None] = {"decode": _result(_decode_endpoint(None))}
    assert list(handler.pick_profiles(request, profiles, decoded)) == ["prefill"]
    decoded["prefill"] = _result(candidate("p1"))
    assert not handler.pick_profiles(request, profiles, decoded)


def test_disagg_decode_failure_stops_and_fails() -> None:
    handler = _handler("disagg-profile-handler")
    request = inference_request({"model": "m", "prompt": PROMPT})
    profiles = {"decode": _profile("decode", "d1"), "prefill": _profile("prefill", "p1")}
    assert not handler.pick_profiles(request, profiles, {"decode": None})
    with pytest.raises(SchedulingFailedError, match="failed to run scheduler profile 'decode'"):
        handler.process_results(request, {"decode": None})
    # through the scheduler: no decode candidate at all
    with pytest.raises(SchedulingFailedError, match="no endpoints available"):
        Scheduler(handler, profiles).schedule(request, [candidate("p1")])


def test_disagg_failed_prefill_is_dropped() -> None:
    handler = _handler("disagg-profile-handler")
    profiles = {"decode": _profile("decode", "d1"), "prefill": _profile("prefill", "p1")}
    request = inference_request({"model": "m", "prompt": PROMPT})
    # no prefill candidate: the prefill profile fails, decode still goes
    outcome = Scheduler(handler, profiles).schedule(request, [_decode_endpoint(None)])
    assert set(outcome.profile_results) == {"decode"}
    assert outcome.primary is not None
    assert [c.name for c in outcome.primary.target_endpoints] == ["d1"]
    assert prefill_endpoint(outcome) is None


def test_disagg_without_decode_profile_runs_nothing() -> None:
    handler = _handler("disagg-profile-handler")
    profiles = {"prefill": _profile("prefill", "p1")}
    assert not handler.pick_profiles(inference_request(), profiles, {})


def test_disagg_custom_profile_names() -> None:
    params = DisaggProfileHandlerParameters(decode_profile="dec", prefill_profile="pre")
    handler = _handler("disagg-profile-handler", params)
    profiles = {"dec": _profile("dec", "d1"), "pre": _profile("pre", "p1")}
    request = inference_request({"model": "m", "prompt": PROMPT})
    outcome = Scheduler(handler, profiles).schedule(
        request, [_decode_endpoint(None), candidate("p1")]
    )
    assert outcome.primary_profile_name == "dec"
    endpoint = prefill_endpoint(outcome)
    assert endpoint is not None
    assert endpoint.name == "p1"


def test_prefill_endpoint_of_a_single_profile_result_is_none() -> None:
    outcome = SchedulingResult(
        profile_results={"default": _result(candidate("a"))}, primary_profile_name="default"
    )
    assert prefill_endpoint(outcome) is None
