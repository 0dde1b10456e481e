"""docs/plugins.md lists every plugin type a config can name here, and no other: a type
registered without a line there, or a line left after a type is renamed, fails."""

from __future__ import annotations

import re
from pathlib import Path

from app.plugins import build_registry

PLUGINS_MD = Path(__file__).resolve().parents[2] / "docs" / "plugins.md"


def _listed(text: str) -> set[str]:
    """The types in the first column of the "Every plugin type" table."""
    section = text.split("## Every plugin type", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]
    return {name for cell in rows for name in re.findall(r"`([a-z0-9-]+)`", cell)}


def test_every_registered_plugin_type_is_listed_and_only_those() -> None:
    registered = set(build_registry(include_entry_points=False).types())
    listed = _listed(PLUGINS_MD.read_text())
    assert sorted(registered - listed) == [], "registered, not in docs/plugins.md"
    assert sorted(listed - registered) == [], "in docs/plugins.md, not registered"


def test_the_list_is_read_from_the_table() -> None:
    text = (
        "## Every plugin type\n| type | kind |\n| --- | --- |\n"
        "| `queue-scorer` | scorer |\n| `random-picker`, alias `any-picker` | picker |\n"
        "not a row: `kv-capacity-gate`\n## Next\n| `token-load-scorer` | scorer |\n"
    )
    assert _listed(text) == {"queue-scorer", "random-picker", "any-picker"}
