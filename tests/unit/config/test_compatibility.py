"""The compatibility tables (``app.config.compatibility``) against the schema, the registry,
the llm-d guides' shipped configs and ``docs/drop-in.md``."""

from __future__ import annotations

import types
import typing
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from app.config import ConfigError, load_config
from app.config.compatibility import (
    CONFIG_KEYS,
    LLMD_TYPES,
    NOOP_TYPES,
    REFERENCE_TYPES,
    UNAVAILABLE_TYPES,
    render_markdown,
)
from app.config.notices import NoticeLog
from app.config.schema import EndpointPickerConfigSpec
from app.plugins import build_registry
from tests.support.scheduling import plugin_handle

ROOT = Path(__file__).resolve().parents[3]
GUIDES = Path(__file__).parent / "fixtures" / "llm-d-guides"


def _model(annotation: Any) -> tuple[type[BaseModel] | None, bool]:
    """The model inside ``annotation`` (through ``| None`` and ``list``), and whether a list
    was crossed."""
    listed = False
    while True:
        origin = typing.get_origin(annotation)
        if origin is list:
            listed = True
            (annotation,) = typing.get_args(annotation)
        elif origin in (typing.Union, types.UnionType):
            annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
        elif origin is typing.Annotated:
            annotation = typing.get_args(annotation)[0]
        else:
            break
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, listed
    return None, listed


def _paths(model: type[BaseModel], prefix: str = "") -> set[str]:
    paths: set[str] = set()
    for name, field in model.model_fields.items():
        key = prefix + (field.alias or name)
        inner, listed = _model(field.annotation)
        if listed:
            key += "[]"
        if inner is None:
            paths.add(key)
        else:
            paths |= _paths(inner, key + ".")
    return paths


def test_every_key_of_the_schema_has_a_row_and_every_row_a_key() -> None:
    rows = {row.path for row in CONFIG_KEYS}
    assert _paths(EndpointPickerConfigSpec) == rows


def test_every_type_of_the_reference_and_llm_d_is_registered_or_has_a_reason() -> None:
    registered = set(build_registry(include_entry_points=False).types())
    upstream = LLMD_TYPES | REFERENCE_TYPES
    assert sorted(upstream - registered - UNAVAILABLE_TYPES.keys()) == []
    assert sorted(UNAVAILABLE_TYPES.keys() & registered) == []  # a stale reason
    assert sorted(UNAVAILABLE_TYPES.keys() - upstream) == []
    assert NOOP_TYPES.keys() <= registered
    assert LLMD_TYPES | {"request-attribute-reporter"} >= REFERENCE_TYPES


def test_the_drop_in_page_shows_the_tables_of_this_registry() -> None:
    """Regenerate with ``.venv/bin/python -m app.config`` (the section's tables)."""
    page = (ROOT / "docs" / "drop-in.md").read_text()
    start = page.index("## Config keys and plugin types\n")
    end = page.index("\n## ", start + 1)
    section = page[start:end]
    tables = render_markdown(build_registry(include_entry_points=False).types())
    assert tables in section


# -- the llm-d guides' configs ---------------------------------------------------------------

#: Each shipped config: None if it loads, else the start of the refusal.
GUIDE_OUTCOMES: dict[str, str | None] = {
    "optimized-baseline.yaml": None,
    "pd-disaggregation.yaml": None,
    "wide-ep.yaml": None,
    "coord-disaggregation.yaml": None,
    "flow-control.yaml": None,
    "flow-control-evictable.yaml": None,
    "spec-decoding.yaml": None,
    "agentic-serving.yaml": 'plugins[0].type: plugin type "agent-identity" is not available',
    "turn-priority-fairness.yaml": (
        'plugins[0].type: plugin type "program-aware-fairness" is not available'
    ),
    "context-length-aware-pd.yaml": 'plugins[5].type: plugin type "token-producer" is not',
    "precise-prefix-cache-routing.yaml": 'plugins[0].type: plugin type "tokenizer" is not',
    "predicted-latency.yaml": None,
    "tiered-prefix-cache.yaml": (
        'plugins[2]: plugin "cpu-prefix-cache-producer" produces "PrefixCacheMatchInfo"'
    ),
}


def test_every_guide_fixture_has_an_expected_outcome() -> None:
    assert sorted(p.name for p in GUIDES.glob("*.yaml")) == sorted(GUIDE_OUTCOMES)


@pytest.mark.parametrize("name", sorted(GUIDE_OUTCOMES))
def test_a_guides_config_loads_or_is_refused_saying_why(name: str) -> None:
    text = (GUIDES / name).read_text()
    expected = GUIDE_OUTCOMES[name]
    registry = build_registry(include_entry_points=False)
    if expected is None:
        loaded = load_config(
            text, registry=registry, handle=plugin_handle(), notice_log=NoticeLog()
        )
        assert loaded.profiles
        return
    with pytest.raises(ConfigError) as caught:
        load_config(text, registry=registry, handle=plugin_handle(), notice_log=NoticeLog())
    assert str(caught.value).startswith(expected)
