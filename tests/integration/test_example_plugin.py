"""The example out-of-tree plugin (``examples/sticky-sessions``), installed as a user would.

``make install`` installs it into the environment; these tests find it through its
``epp.plugins`` entry point, load it from an EndpointPickerConfig and route with it. Its
effect through Envoy is in ``tests/e2e/test_example_plugin_e2e.py``.
"""

from __future__ import annotations

import ast
import sys
from importlib.metadata import distribution, entry_points
from pathlib import Path

import pytest

from app.config import ConfigError, load_config
from app.plugins import ENTRY_POINT_GROUP, build_registry
from domain.datastore.store import Datastore
from domain.requestcontrol.director import Director
from ports.endpoints import EndpointAddress, EndpointEvent, EndpointEventKind, EndpointInfo
from ports.requests import InboundRequest
from tests.support.director import configured_director
from tests.support.scheduling import plugin_handle

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIR = ROOT / "examples" / "sticky-sessions" / "src" / "epp_sticky_sessions"
DISTRIBUTION = "epp-sticky-sessions"
TYPE = "sticky-session-scorer"

#: What the example may import of the EPP: its public plugin surface (see its README).
PUBLIC_PLUGIN_SURFACE = {"domain.plugins", "domain.scheduling", "domain.scheduling.interfaces"}

CONFIG = f"""\
plugins:
- type: {TYPE}
  parameters: {{header: X-Chat-Session, maxSessions: 2}}
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins: [{{pluginRef: {TYPE}, weight: 2}}, {{pluginRef: max-score-picker}}]
"""

IPS = [f"10.1.0.{i}" for i in range(1, 9)]


def test_the_example_is_found_through_its_entry_point() -> None:
    [found] = [
        ep
        for ep in entry_points(group=ENTRY_POINT_GROUP)
        if ep.dist is not None and ep.dist.name == DISTRIBUTION
    ]
    assert found.value == "epp_sticky_sessions:register"
    register = found.load()
    assert register.__module__ == "epp_sticky_sessions.scorer"
    assert distribution(DISTRIBUTION).version == "0.1.0"

    registry = build_registry()
    assert TYPE in registry
    assert "session" in registry.spec(TYPE).description


def test_a_config_naming_its_type_loads_it_as_a_scorer_and_a_pre_request_hook() -> None:
    loaded = load_config(CONFIG, registry=build_registry(), handle=plugin_handle())
    [weighted] = loaded.profiles["default"].scorers
    assert weighted.scorer.typed_name.type == TYPE
    assert weighted.weight == 2
    assert [hook.typed_name for hook in loaded.pre_request] == [weighted.scorer.typed_name]


def test_its_parameters_are_validated_like_an_in_tree_plugins() -> None:
    bad = CONFIG.replace("maxSessions: 2", "maxSessions: 0")
    with pytest.raises(ConfigError, match=r"plugins\[0\].*maxSessions: must be > 0"):
        load_config(bad, registry=build_registry(), handle=plugin_handle())


def _datastore() -> Datastore:
    store = Datastore()
    for ip in IPS:
        address = EndpointAddress(ip=ip, port=8000)
        store.apply(
            EndpointEvent(
                kind=EndpointEventKind.ADD_OR_UPDATE,
                endpoint=EndpointInfo(name=address.host_port(), address=address),
            )
        )
    store.mark_synced()
    return store


async def _route(director: Director, session: str | None, n: int) -> str:
    headers = {":path": "/v1/completions", "x-request-id": f"r-{n}"}
    if session is not None:
        headers["x-chat-session"] = session
    exchange = director.open(
        InboundRequest(request_id=f"r-{n}", headers=headers, body=b'{"model": "m", "prompt": "hi"}')
    )
    try:
        decision = await exchange.route()
        assert decision.error is None, decision.error
        return decision.endpoints[0].ip
    finally:
        await exchange.close()


async def test_the_requests_of_a_session_go_back_to_the_same_endpoint() -> None:
    director = configured_director(_datastore(), CONFIG, include_entry_points=True)
    first = {s: await _route(director, s, i) for i, s in enumerate(["a", "b"])}
    for n in range(10):
        for session, home in first.items():
            assert await _route(director, session, n) == home
    # Without a session the other plugins decide (here: a random pick among 8 ties).
    assert len({await _route(director, None, n) for n in range(40)}) > 1


async def test_the_least_recently_routed_session_is_forgotten_beyond_max_sessions() -> None:
    director = configured_director(_datastore(), CONFIG, include_entry_points=True)
    home = await _route(director, "old", 0)
    await _route(director, "b", 1)
    await _route(director, "c", 2)  # maxSessions: 2, "old" is forgotten
    # A forgotten session is scheduled afresh (a random tie among 8): not always at home.
    elsewhere = 0
    for n in range(40):
        if await _route(director, "old", n) != home:
            elsewhere += 1
        for other in ("x", "y"):  # two newer sessions push "old" out again
            await _route(director, f"{other}-{n}", n)
    assert elsewhere > 0


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
    return found


def test_the_example_imports_only_the_public_plugin_surface() -> None:
    modules = sorted(PACKAGE_DIR.rglob("*.py"))
    assert modules
    outside = {
        f"{path.relative_to(ROOT)} imports {module}"
        for path in modules
        for module in _imports(path)
        if module.split(".")[0] not in sys.stdlib_module_names
        and module.split(".")[0] != "epp_sticky_sessions"
        and module not in PUBLIC_PLUGIN_SURFACE
    }
    assert outside == set()
