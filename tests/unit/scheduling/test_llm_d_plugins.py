"""The llm-d router's plugin types added for its guides' configs: ``active-request-scorer``,
the role filters, the P/D deciders with ``disagg-profile-handler``'s llm-d parameters, and
``prefix-cache-affinity-filter``'s token gate."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from app.config import ConfigError, load_config
from app.config.notices import NoticeLog
from app.plugins import build_registry
from domain.datalayer.attributes import (
    IN_FLIGHT_LOAD,
    PREFIX_CACHE_MATCH_INFO,
    InFlightLoad,
    PrefixCacheMatchInfo,
)
from domain.datastore.store import Datastore
from domain.plugins.base import Plugin
from domain.scheduling.interfaces import Filter, Scorer
from domain.scheduling.types import Candidate
from ports.endpoints import EndpointAddress, EndpointEvent, EndpointEventKind, EndpointInfo
from ports.requests import InboundRequest
from tests.support.director import configured_director
from tests.support.scheduling import candidate, cycle, inference_request, plugin_handle

REQUEST = inference_request({"model": "m", "prompt": "hello"})
GUIDES = Path(__file__).parents[1] / "config" / "fixtures" / "llm-d-guides"


def _plugin(type_name: str, parameters: Mapping[str, Any] | None = None) -> Plugin:
    entry: dict[str, Any] = {"type": type_name, "name": "p"}
    if parameters is not None:
        entry["parameters"] = dict(parameters)
    loaded = load_config(
        json.dumps({"plugins": [entry, {"type": "max-score-picker"}]}),
        registry=build_registry(include_entry_points=False),
        handle=plugin_handle(),
        notice_log=NoticeLog(),
    )
    return loaded.plugins["p"]


def _bad(type_name: str, parameters: Mapping[str, Any]) -> str:
    with pytest.raises(ConfigError) as caught:
        _plugin(type_name, parameters)
    return str(caught.value)


def _busy(name: str, requests: int | None, **kwargs: Any) -> Candidate:
    c = candidate(name, **kwargs)
    if requests is not None:
        c.attributes[IN_FLIGHT_LOAD] = InFlightLoad(requests, requests * 1000)
    return c


def _scores(plugin: Plugin, candidates: Sequence[Candidate]) -> list[float]:
    assert isinstance(plugin, Scorer)
    return [round(s, 6) for s in plugin.score(cycle(REQUEST), REQUEST, candidates)]


# --- active-request-scorer ------------------------------------------------------------------


def test_active_request_scores_by_requests_in_flight_relative_to_the_busiest() -> None:
    plugin = _plugin("active-request-scorer")
    pool = [_busy("a", 0), _busy("b", 2), _busy("c", 8), _busy("d", None)]
    # idle (and unknown) endpoints score 1; the busiest 0; the rest by their distance to it
    assert _scores(plugin, pool) == [1.0, 0.75, 0.0, 1.0]
    assert plugin.typed_name.type == "active-request-scorer"
    assert plugin.category == "Distribution"  # type: ignore[attr-defined]


def test_active_request_counts_requests_not_tokens() -> None:
    plugin = _plugin("active-request-scorer")
    a, b = _busy("a", 2), _busy("b", 2)
    b.attributes[IN_FLIGHT_LOAD] = InFlightLoad(2, 10**6)  # same requests, far more tokens
    assert _scores(plugin, [a, b]) == [0.0, 0.0]


def test_active_request_idle_threshold_and_the_gap_to_busy_endpoints() -> None:
    plugin = _plugin("active-request-scorer", {"idleThreshold": 2, "maxBusyScore": 0.5})
    pool = [_busy("a", 1), _busy("b", 2), _busy("c", 4), _busy("d", 8)]
    assert _scores(plugin, pool) == [1.0, 1.0, 0.25, 0.0]


def test_active_request_with_nothing_in_flight_scores_everyone_one() -> None:
    assert _scores(_plugin("active-request-scorer"), [_busy("a", 0), _busy("b", None)]) == [
        1.0,
        1.0,
    ]


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"idleThreshold": -1}, "plugins[0].parameters.idleThreshold: must be >= 0, got -1"),
        ({"maxBusyScore": 1.5}, "plugins[0].parameters.maxBusyScore: must be in [0, 1], got 1.5"),
        (
            {"requestTimeout": 30},
            "plugins[0].parameters.requestTimeout: Input should be a valid string",
        ),
        ({"idleTreshold": 1}, "plugins[0].parameters.idleTreshold: unknown field"),
    ],
)
def test_active_request_parameter_errors(parameters: Mapping[str, Any], message: str) -> None:
    assert _bad("active-request-scorer", parameters).startswith(message)


# --- role filters ---------------------------------------------------------------------------

ROLES = {
    "d": "decode",
    "p": "prefill",
    "e": "encode",
    "pd": "prefill-decode",
    "both": "both",
    "ep": "encode-prefill",
    "epd": "encode-prefill-decode",
    "other": "router",
}


def _roles() -> list[Candidate]:
    pool = [candidate(name, labels={"llm-d.ai/role": role}) for name, role in ROLES.items()]
    return [*pool, candidate("unlabelled")]


@pytest.mark.parametrize(
    ("type_name", "kept"),
    [
        ("decode-filter", ["d", "pd", "both", "epd", "unlabelled"]),
        ("prefill-filter", ["p", "pd", "both", "ep", "epd"]),
        ("encode-filter", ["e", "ep", "epd"]),
    ],
)
def test_role_filters_keep_the_endpoints_of_their_stage(type_name: str, kept: list[str]) -> None:
    plugin = _plugin(type_name)
    assert isinstance(plugin, Filter)
    assert [c.name for c in plugin.filter(cycle(REQUEST), REQUEST, _roles())] == kept


def test_role_filters_take_no_parameters() -> None:
    assert _bad("decode-filter", {"label": "x"}).startswith(
        "plugins[0].parameters.label: unknown field (this plugin type takes no parameters)"
    )


# --- the P/D deciders and disagg-profile-handler's llm-d parameters ------------------------

PODS = {"10.3.0.1": "prefill", "10.3.0.2": "prefill", "10.3.0.3": "decode", "10.3.0.4": "decode"}


def _pd_datastore() -> Datastore:
    store = Datastore()
    for ip, role in PODS.items():
        address = EndpointAddress(ip=ip, port=8000)
        store.apply(
            EndpointEvent(
                kind=EndpointEventKind.ADD_OR_UPDATE,
                endpoint=EndpointInfo(name=ip, address=address, labels={"llm-d.ai/role": role}),
            )
        )
    store.mark_synced()
    return store


async def _route_pd(config: str, prompt: str, n: int = 0) -> tuple[str, str | None]:
    """(decode endpoint IP, the prefiller header) of one request."""
    director = configured_director(_pd_datastore(), config)
    body = json.dumps({"model": "m", "prompt": prompt}).encode()
    headers = {":path": "/v1/completions", ":method": "POST", "x-request-id": f"r{n}"}
    exchange = director.open(InboundRequest(request_id=f"r{n}", headers=headers, body=body))
    try:
        decision = await exchange.route()
        assert decision.error is None, decision.error
        prefiller = dict(decision.headers).get("x-prefiller-host-port")
        return decision.endpoints[0].ip, prefiller
    finally:
        await exchange.close()


async def test_the_pd_guide_config_decodes_on_a_decode_pod_and_prefills_on_a_prefill_pod() -> None:
    config = (GUIDES / "pd-disaggregation.yaml").read_text()
    for n in range(4):
        decode, prefiller = await _route_pd(config, f"question {n} " * 50, n)
        assert PODS[decode] == "decode"
        assert prefiller is not None
        assert PODS[prefiller.rpartition(":")[0]] == "prefill"


PREFIX_BASED = """\
plugins:
- type: prefix-based-pd-decider
  parameters: {{nonCachedTokens: {tokens}}}
- type: disagg-profile-handler
  parameters: {{prefillDeciderPluginName: prefix-based-pd-decider}}
- type: prefill-filter
- type: decode-filter
schedulingProfiles:
- name: prefill
  plugins: [{{pluginRef: prefill-filter}}]
- name: decode
  plugins: [{{pluginRef: decode-filter}}]
"""


@pytest.mark.parametrize(
    ("tokens", "prompt_chars", "split"),
    [
        (100, 800, True),  # 200 uncached tokens >= 100
        (100, 396, False),  # 99 tokens: below the threshold
        (0, 8000, False),  # 0: the decider never splits
    ],
)
async def test_the_prefix_based_decider_splits_long_uncached_prompts(
    tokens: int, prompt_chars: int, split: bool
) -> None:
    decode, prefiller = await _route_pd(PREFIX_BASED.format(tokens=tokens), "x" * prompt_chars)
    assert PODS[decode] == "decode"
    assert (prefiller is not None) is split


def test_the_prefix_based_decider_also_needs_a_long_enough_prompt() -> None:
    decider = _plugin("prefix-based-pd-decider", {"nonCachedTokens": 10, "promptTokens": 500})
    assert not decider.disaggregate(prompt_tokens=499, uncached_tokens=499)  # type: ignore[attr-defined]
    assert decider.disaggregate(prompt_tokens=500, uncached_tokens=10)  # type: ignore[attr-defined]
    assert not decider.disaggregate(prompt_tokens=500, uncached_tokens=9)  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        (
            {"deciders": {"prefill": "nobody"}},
            "plugins[0].parameters.deciders: no plugin named 'nobody' before this handler "
            "(list the decider first)",
        ),
        (
            {"deciders": {"encode": "x"}},
            "plugins[0].parameters.deciders: encode disaggregation (E/PD) is not available here",
        ),
        (
            {"stageOrder": "prefill-first"},
            "plugins[0].parameters.stageOrder: prefill-first is not available here",
        ),
        (
            {"stageOrder": "sideways"},
            "plugins[0].parameters.stageOrder: must be decode-first or prefill-first",
        ),
        (
            {"profiles": {"decode": "d"}, "prefillProfile": "p"},
            "plugins[0].parameters.profiles: give either the nested profiles/deciders or the flat",
        ),
        (
            {"profiles": {"decode": "x", "prefill": "x"}},
            "plugins[0].parameters.prefillProfile: must differ from decodeProfile",
        ),
    ],
)
def test_disagg_handler_llm_d_parameter_errors(parameters: Mapping[str, Any], message: str) -> None:
    assert _bad("disagg-profile-handler", parameters).startswith(message)


def test_a_decider_must_be_a_decider_and_not_beside_a_threshold() -> None:
    with pytest.raises(ConfigError, match="is not a prefill/decode decider"):
        load_config(
            "plugins:\n- type: queue-scorer\n- type: disagg-profile-handler\n"
            "  parameters: {deciders: {prefill: queue-scorer}}\n",
            registry=build_registry(include_entry_points=False),
            handle=plugin_handle(),
            notice_log=NoticeLog(),
        )
    assert _bad("disagg-profile-handler", {"deciderPluginName": "d", "threshold": 5}).startswith(
        "plugins[0].parameters.threshold: give either threshold or a prefill decider"
    )


def test_nested_profile_names_are_used() -> None:
    loaded = load_config(
        """\
plugins:
- type: disagg-profile-handler
  parameters: {profiles: {decode: dec, prefill: pre}}
- type: decode-filter
schedulingProfiles:
- {name: dec, plugins: [{pluginRef: decode-filter}]}
- {name: pre, plugins: [{pluginRef: decode-filter}]}
""",
        registry=build_registry(include_entry_points=False),
        handle=plugin_handle(),
        notice_log=NoticeLog(),
    )
    handler = loaded.profile_handler
    assert (handler.decode_profile, handler.prefill_profile) == ("dec", "pre")  # type: ignore[attr-defined]


# --- prefix-cache-affinity-filter: the in-flight token gate --------------------------------


def _warm(name: str, tokens: int, matched: int) -> Candidate:
    c = candidate(name)
    c.attributes[PREFIX_CACHE_MATCH_INFO] = PrefixCacheMatchInfo(
        match_blocks=matched, total_blocks=10, block_size_tokens=16
    )
    c.attributes[IN_FLIGHT_LOAD] = InFlightLoad(1, tokens)
    return c


def _kept(parameters: Mapping[str, Any], candidates: Sequence[Candidate]) -> list[str]:
    plugin = _plugin("prefix-cache-affinity-filter", parameters)
    assert isinstance(plugin, Filter)
    request = inference_request({"model": "m", "prompt": "x" * 640})  # 160 tokens, 10 blocks
    return [c.name for c in plugin.filter(cycle(request), request, candidates)]


@pytest.mark.parametrize(
    ("penalty", "kept"),
    [
        (0, ["sticky"]),  # both gates off: always stick
        (10_000, ["sticky"]),  # 5,000 + 0 against 0 + 160 ahead: within the penalty
        (4_000, ["sticky", "cold"]),  # beyond it: everyone passes
    ],
)
def test_the_token_gate_breaks_stickiness_beyond_its_penalty(penalty: int, kept: list[str]) -> None:
    pool = [_warm("sticky", 5_000, 10), _warm("cold", 0, 0)]
    parameters = {"maxTTFTPenaltyMs": 0, "maxTokensInFlightPenalty": penalty}
    assert _kept(parameters, pool) == kept


def test_the_token_gate_is_refused_below_zero() -> None:
    assert _bad("prefix-cache-affinity-filter", {"maxTokensInFlightPenalty": -1}).startswith(
        "plugins[0].parameters.maxTokensInFlightPenalty: must be an integer >= 0, got -1"
    )
