"""``header-based-testing-filter``: endpoints chosen by a request header."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from domain.plugins.base import PluginRegistry
from domain.scheduling.interfaces import Filter
from domain.scheduling.plugins import header_filter
from domain.scheduling.types import Candidate
from tests.support.scheduling import candidate, cycle, inference_request, plugin_handle

CANDIDATES = (
    candidate("a", ip="10.0.0.1", port=8000),
    candidate("a2", ip="10.0.0.1", port=8001),
    candidate("b", ip="10.0.0.2", port=8000),
    candidate("v6", ip="fd00::3", port=8000),
)


def _filter() -> Filter:
    registry = PluginRegistry()
    header_filter.register(registry)
    plugin = registry.create(header_filter.TYPE, "f", None, plugin_handle())
    assert isinstance(plugin, Filter)
    return plugin


def _run(header: str | None, candidates: Sequence[Candidate] = CANDIDATES) -> list[str]:
    headers = {} if header is None else {"test-epp-endpoint-selection": header}
    request = inference_request({"model": "m", "prompt": "p"}, headers=headers)
    return [c.name for c in _filter().filter(cycle(request), request, candidates)]


def test_type_name() -> None:
    assert header_filter.TYPE == "header-based-testing-filter"


@pytest.mark.parametrize("header", [None, "", "  "])
def test_without_a_selection_keeps_everyone(header: str | None) -> None:
    assert _run(header) == ["a", "a2", "b", "v6"]


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        ("10.0.0.2", ["b"]),
        ("10.0.0.1", ["a", "a2"]),  # a bare IP matches every port
        ("10.0.0.1:8001", ["a2"]),  # ip:port matches that port only
        ("10.0.0.2:8000,10.0.0.1:8000", ["b", "a"]),  # header order
        (" 10.0.0.2 , 10.0.0.1:8000 ", ["b", "a"]),  # spaces trimmed
        ("10.0.0.1:8000,10.0.0.1", ["a", "a2"]),  # each endpoint once
        ("[fd00::3]:8000", ["v6"]),
        ("[fd00::3]", ["v6"]),
        ("fd00::3", ["v6"]),
        ("[fd00::3]:9999", []),
        ("10.9.9.9", []),  # listed but not a candidate
        ("10.0.0.2:1234", []),
        (",", []),  # a value with only separators lists nothing
    ],
)
def test_selection(header: str, expected: list[str]) -> None:
    assert _run(header) == expected


def test_does_not_mutate_candidates() -> None:
    candidates = list(CANDIDATES)
    _run("10.0.0.2", candidates)
    assert candidates == list(CANDIDATES)
