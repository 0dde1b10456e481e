"""The README names only what exists: every flag it shows is one ``epp`` accepts, every plugin
type one the loader knows, every ``make`` target one the Makefile has, every local link a
file; and it stays a front door (short)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from app.flags import build_parser
from app.plugins import build_registry

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"

_FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")
_MAKE = re.compile(r"\bmake ([a-z][a-z0-9-]*)")
#: backticked kebab-case words ending like plugin types do
_PLUGIN = re.compile(
    r"`([a-z0-9]+(?:-[a-z0-9]+)*-(?:scorer|filter|picker|producer|handler|parser|gate|"
    r"source|extractor|detector|verifier|decider|admitter))`"
)
_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _flags() -> set[str]:
    return {
        option
        for action in build_parser()._actions
        for option in action.option_strings
        if option.startswith("--")
    }


def _targets() -> set[str]:
    return set(re.findall(r"^([a-z][a-z0-9-]*):", (ROOT / "Makefile").read_text(), re.M))


def unknown_names(text: str) -> list[str]:
    """What ``text`` names that does not exist here."""
    flags, targets = _flags(), _targets()
    registry = build_registry()
    problems = [f"flag {f}" for f in _FLAG.findall(text) if f not in flags]
    problems += [f"make target {t}" for t in _MAKE.findall(text) if t not in targets]
    problems += [f"plugin type {p}" for p in _PLUGIN.findall(text) if p not in registry]
    problems += [
        f"link {link}"
        for link in _LINK.findall(text)
        if "://" not in link and not (README.parent / link).exists()
    ]
    return problems


def test_the_readme_names_only_what_exists() -> None:
    assert unknown_names(README.read_text()) == []


def test_the_readme_shows_the_two_commands_and_stays_short() -> None:
    text = README.read_text()
    assert "make demo" in text
    assert "make test" in text
    assert len(text.splitlines()) <= 200


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("run `epp --pool-nmae x`", "flag --pool-nmae"),
        ("then `make tset`", "make target tset"),
        ("with `prefix-cache-scorrer`", None),  # not a plugin-type suffix: not checked
        ("with `prefix-cahce-scorer`", "plugin type prefix-cahce-scorer"),
        ("see [the docs](docs/nothing-here.md)", "link docs/nothing-here.md"),
    ],
)
def test_the_check_catches_a_typo(text: str, problem: str | None) -> None:
    assert unknown_names(text) == ([problem] if problem else [])
