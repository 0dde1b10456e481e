"""session-affinity-filter and -scorer: both strategies, the token returned, bad tokens
ignored, config checks; and the in-memory session store."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from app.config import ConfigError, load_config
from app.plugins import build_registry
from domain.datastore.endpoint import Endpoint
from domain.plugins.base import Plugin
from domain.plugins.handle import Handle
from domain.requestcontrol.interfaces import (
    DataProducer,
    PreRequest,
    ResponseHeaderProcessor,
    ResponseInfo,
)
from domain.scheduling.interfaces import Filter, Scorer
from domain.scheduling.types import Candidate, InferenceRequest, ProfileRunResult, SchedulingResult
from domain.sharedstate.sessions import InMemorySessionStore
from ports.endpoints import EndpointAddress, EndpointInfo
from ports.shared_state import SharedStateError
from tests.support.scheduling import cycle, inference_request, plugin_handle
from tests.unit.requestcontrol import FakeClock


def _candidate(name: str, namespace: str = "ns") -> Candidate:
    info = EndpointInfo(
        name=name, namespace=namespace, address=EndpointAddress(ip="10.0.0.1", port=8000)
    )
    return Candidate(Endpoint(info=info))


POOL = [_candidate("a"), _candidate("b"), _candidate("c")]


def _token(name: str, namespace: str = "ns") -> str:
    return base64.b64encode(f"{namespace}/{name}".encode()).decode()


def _plugin(
    type_name: str, parameters: Mapping[str, Any] | None = None, handle: Handle | None = None
) -> Plugin:
    entry: dict[str, Any] = {"type": type_name, "name": "s"}
    if parameters is not None:
        entry["parameters"] = dict(parameters)
    loaded = load_config(
        json.dumps({"plugins": [entry, {"type": "max-score-picker"}]}),
        registry=build_registry(),
        handle=handle or plugin_handle(),
    )
    plugin = loaded.plugins["s"]
    assert isinstance(plugin, DataProducer | PreRequest | ResponseHeaderProcessor)
    return plugin


def _request(headers: Mapping[str, str] | None = None, request_id: str = "r") -> InferenceRequest:
    return inference_request({"model": "m", "prompt": "x"}, headers=headers, request_id=request_id)


async def _route(
    plugin: Plugin,
    request: InferenceRequest,
    candidates: Sequence[Candidate],
    chosen: str | None = None,
) -> list[str]:
    """Run the plugin's hooks as the Director would; returns the kept names (filter) or the
    names scored 1 (scorer). The request goes to ``chosen`` (else the first kept)."""
    assert isinstance(plugin, DataProducer)
    await plugin.prepare_request_data(request, candidates)
    if isinstance(plugin, Filter):
        kept = list(plugin.filter(cycle(request), request, candidates))
    else:
        assert isinstance(plugin, Scorer)
        scores = plugin.score(cycle(request), request, candidates)
        kept = [c for c, s in zip(candidates, scores, strict=True) if s == 1.0]
    target = next(c for c in candidates if c.name == chosen) if chosen else (kept or candidates)[0]
    result = SchedulingResult(
        profile_results={"default": ProfileRunResult((target,))}, primary_profile_name="default"
    )
    request.scheduling_result = result
    assert isinstance(plugin, PreRequest)
    await plugin.pre_request(request, result)
    assert isinstance(plugin, ResponseHeaderProcessor)
    await plugin.response_header(request, ResponseInfo(request_id=request.request_id), target.info)
    return [c.name for c in kept]


# --- encoded_endpoint_header ----------------------------------------------------------------


@pytest.mark.parametrize("type_name", ["session-affinity-filter", "session-affinity-scorer"])
async def test_token_is_returned_and_honoured(type_name: str) -> None:
    plugin = _plugin(type_name)
    first = _request()
    kept = await _route(plugin, first, POOL, chosen="b")
    assert kept == (["a", "b", "c"] if type_name.endswith("filter") else [])
    assert first.response_headers == [("x-session-token", _token("b"))]
    second = _request({"x-session-token": _token("b")})
    assert await _route(plugin, second, POOL) == ["b"]
    assert second.response_headers == [("x-session-token", _token("b"))]


@pytest.mark.parametrize(
    "token",
    [
        "%%%not-base64%%%",
        base64.b64encode(b"\xff\xfe").decode(),  # not UTF-8
        _token("gone"),  # an endpoint that left the pool
        _token("b", namespace="other-pool"),
        "A" * 4000,  # too long to look at
        "",
    ],
)
async def test_bad_tokens_are_ignored(token: str) -> None:
    plugin = _plugin("session-affinity-filter")
    request = _request({"x-session-token": token})
    assert await _route(plugin, request, POOL, chosen="c") == ["a", "b", "c"]
    assert request.response_headers == [("x-session-token", _token("c"))]  # a fresh token


async def test_a_removed_endpoint_is_never_chosen() -> None:
    plugin = _plugin("session-affinity-filter")
    request = _request({"x-session-token": _token("b")})
    remaining = [POOL[0], POOL[2]]
    assert await _route(plugin, request, remaining, chosen="a") == ["a", "c"]


async def test_header_name_and_profile_are_configurable() -> None:
    plugin = _plugin(
        "session-affinity-filter",
        {
            "profileName": "prefill",
            "encodedEndpointHeaderConfig": {"header": "X-Session-Token-Prefill"},
        },
    )
    request = _request()
    result = SchedulingResult(
        profile_results={
            "decode": ProfileRunResult((POOL[0],)),
            "prefill": ProfileRunResult((POOL[2],)),
        },
        primary_profile_name="decode",
    )
    request.scheduling_result = result
    assert isinstance(plugin, ResponseHeaderProcessor)
    await plugin.response_header(request, ResponseInfo(request_id="r"), POOL[0].info)
    assert request.response_headers == [("x-session-token-prefill", _token("c"))]


# --- session_id ----------------------------------------------------------------------------


SESSION_ID = {"strategy": "session_id"}


@pytest.mark.parametrize("type_name", ["session-affinity-filter", "session-affinity-scorer"])
async def test_session_id_binds_server_side(type_name: str) -> None:
    plugin = _plugin(type_name, SESSION_ID)
    first = _request({"x-session-id": "chat-1"}, request_id="1")
    await _route(plugin, first, POOL, chosen="c")
    assert first.response_headers is None  # nothing is written back
    again = _request({"x-session-id": "chat-1"}, request_id="2")
    assert await _route(plugin, again, POOL) == ["c"]
    other = _request({"x-session-id": "chat-2"}, request_id="3")
    expected = ["a", "b", "c"] if type_name.endswith("filter") else []
    assert await _route(plugin, other, POOL, chosen="a") == expected


async def test_session_id_rebinds_when_its_endpoint_leaves() -> None:
    plugin = _plugin("session-affinity-filter", SESSION_ID)
    await _route(plugin, _request({"x-session-id": "s"}, "1"), POOL, chosen="b")
    without_b = [POOL[0], POOL[2]]
    assert await _route(plugin, _request({"x-session-id": "s"}, "2"), without_b, chosen="c") == [
        "a",
        "c",
    ]
    assert await _route(plugin, _request({"x-session-id": "s"}, "3"), POOL) == ["c"]


async def test_session_id_sources_in_order_and_ttl() -> None:
    clock = FakeClock()
    handle = plugin_handle()
    handle.sessions = InMemorySessionStore(clock=clock)
    plugin = _plugin(
        "session-affinity-filter",
        {
            "strategy": "session_id",
            "sessionIdConfig": {
                "sources": [{"header": "x-session-id"}, {"header": "x-agent-session"}],
                "evictionTtlSeconds": 60,
            },
        },
        handle,
    )
    await _route(plugin, _request({"x-agent-session": "s"}, "1"), POOL, chosen="b")
    clock.now += 59
    assert await _route(plugin, _request({"x-agent-session": "s"}, "2"), POOL) == ["b"]
    clock.now += 59  # 59 s after the last use: still bound
    assert await _route(plugin, _request({"x-agent-session": "s"}, "3"), POOL) == ["b"]
    clock.now += 61
    assert await _route(plugin, _request({"x-agent-session": "s"}, "4"), POOL, "a") == [
        "a",
        "b",
        "c",
    ]


async def test_filter_and_scorer_keep_separate_bindings() -> None:
    handle = plugin_handle()
    loaded = load_config(
        json.dumps(
            {
                "plugins": [
                    {"type": "session-affinity-filter", "parameters": SESSION_ID},
                    {"type": "session-affinity-scorer", "parameters": SESSION_ID},
                ]
            }
        ),
        registry=build_registry(),
        handle=handle,
    )
    f, s = loaded.plugins["session-affinity-filter"], loaded.plugins["session-affinity-scorer"]
    await _route(f, _request({"x-session-id": "x"}, "1"), POOL, chosen="a")
    assert await _route(s, _request({"x-session-id": "x"}, "2"), POOL, chosen="c") == []


# --- config ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"strategy": "cookie"}, "plugins[0].parameters.strategy: must be encoded_endpoint_header"),
        (
            {"sessionIdConfig": {"evictionTtlSeconds": 0}},
            "plugins[0].parameters.sessionIdConfig.evictionTtlSeconds: must be a finite number > 0",
        ),
        (
            {"sessionIdConfig": {"evictionSweepSeconds": -1}},
            "plugins[0].parameters.sessionIdConfig.evictionSweepSeconds",
        ),
        ({"sessionIdConfig": {"sources": []}}, "plugins[0].parameters.sessionIdConfig.sources"),
        (
            {"sessionIdConfig": {"sources": [{"attribute": "agent-identity"}]}},
            "plugins[0].parameters.sessionIdConfig.sources[0].attribute",
        ),
        (
            {"encodedEndpointHeaderConfig": {"header": " "}},
            "plugins[0].parameters.encodedEndpointHeaderConfig.header: must not be empty",
        ),
        ({"headerName": "x"}, "plugins[0].parameters.headerName: unknown field"),
    ],
)
def test_bad_config_names_the_entry(parameters: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        _plugin("session-affinity-filter", parameters)
    assert message in str(caught.value)


# --- the in-memory store ----------------------------------------------------------------------


async def test_store_expires_and_stays_bounded() -> None:
    clock = FakeClock()
    store = InMemorySessionStore(clock=clock, max_sessions=3)
    await store.put("a", "e1", ttl=10)
    assert await store.get("a") == "e1"
    clock.now += 10
    assert await store.get("a") is None
    for key in "bcdef":
        await store.put(key, "e", ttl=100)
    assert len(store) == 3
    assert await store.get("b") is None
    assert await store.get("f") == "e"


# --- a store that fails or stalls ---------------------------------------------------------------


class _BrokenStore:
    """A shared store that is down (raises) or hangs (never answers)."""

    def __init__(self, *, hang: bool) -> None:
        self.hang = hang

    async def _fail(self) -> None:
        if self.hang:
            await asyncio.Event().wait()
        raise SharedStateError("redis session get failed: ConnectionError: refused")

    async def get(self, key: str) -> str | None:
        await self._fail()
        return None

    async def put(self, key: str, endpoint: str, ttl: float) -> None:
        await self._fail()


@pytest.mark.parametrize("hang", [False, True])
async def test_a_failing_store_routes_as_unbound(
    hang: bool, caplog: pytest.LogCaptureFixture
) -> None:
    handle = plugin_handle()
    handle.sessions = _BrokenStore(hang=hang)
    plugin = _plugin("session-affinity-filter", SESSION_ID, handle)
    for i in range(3):
        request = _request({"x-session-id": "s"}, request_id=f"r{i}")
        assert await _route(plugin, request, POOL, chosen="b") == ["a", "b", "c"]
    assert caplog.text.count("the session store failed") == 1
