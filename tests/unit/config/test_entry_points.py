"""Out-of-tree plugins: installed distributions exposing ``epp.plugins`` entry points."""

from __future__ import annotations

import textwrap
import uuid
from importlib.metadata import EntryPoint, distributions
from pathlib import Path

import pytest

import app.plugins
from app.config import load_config
from app.plugins import ENTRY_POINT_GROUP, PluginLoadError, load_entry_point_plugins
from tests.unit.config import make_handle, make_registry

PLUGIN_MODULE = """\
from domain.plugins.base import class_factory


class OutOfTreeFilter:
    def __init__(self, typed_name, parameters):
        self.typed_name = typed_name
        self.parameters = parameters

    def filter(self, cycle, request, candidates):
        return candidates


def register(registry):
    registry.register(
        {type!r}, class_factory({type!r}, OutOfTreeFilter), description="installed filter"
    )
"""


def install(
    site: Path, distribution: str, plugin_type: str, *, module_source: str | None = None
) -> str:
    """Writes a module and a ``*.dist-info`` declaring it as an ``epp.plugins`` entry point
    into ``site`` (a directory on ``sys.path``). Returns the module name."""
    module = f"epp_test_plugin_{uuid.uuid4().hex}"
    (site / f"{module}.py").write_text(module_source or PLUGIN_MODULE.format(type=plugin_type))
    info = site / f"{distribution}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\n{distribution} = {module}:register\n"
    )
    return module


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A directory on ``sys.path`` whose distributions are the only ones installed (the
    environment's own, such as the example plugin, are not seen)."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def entry_points(*, group: str) -> list[EntryPoint]:
        return [
            ep
            for dist in distributions(path=[str(tmp_path)])
            for ep in dist.entry_points
            if ep.group == group
        ]

    monkeypatch.setattr(app.plugins, "entry_points", entry_points)
    return tmp_path


def test_an_installed_plugin_type_becomes_available(site: Path) -> None:
    install(site, "acme-epp-plugins", "acme-filter")
    registry = make_registry()
    assert "acme-filter" not in registry

    assert load_entry_point_plugins(registry) == ["acme-filter"]
    assert registry.spec("acme-filter").description == "installed filter"

    loaded = load_config(
        textwrap.dedent(
            """\
            plugins:
            - type: acme-filter
            schedulingProfiles:
            - name: p
              plugins:
              - pluginRef: acme-filter
            """
        ),
        registry=registry,
        handle=make_handle(),
    )
    [only] = loaded.profiles["p"].filters
    assert only.typed_name.type == "acme-filter"


def test_a_type_clashing_with_an_in_tree_type_is_an_error(site: Path) -> None:
    install(site, "clash-plugins", "queue-scorer")
    with pytest.raises(PluginLoadError, match="already registered") as caught:
        load_entry_point_plugins(make_registry())
    assert "from clash-plugins 1.0" in str(caught.value)
    assert "'queue-scorer'" in str(caught.value)


def test_two_distributions_with_the_same_type_is_an_error(site: Path) -> None:
    install(site, "first-plugins", "shared-filter")
    install(site, "second-plugins", "shared-filter")
    with pytest.raises(PluginLoadError, match="'shared-filter' is already registered"):
        load_entry_point_plugins(make_registry())


def test_an_entry_point_that_cannot_be_imported_is_an_error(site: Path) -> None:
    install(site, "broken-plugins", "x", module_source="raise ImportError('no such thing')\n")
    with pytest.raises(PluginLoadError, match=r"broken-plugins 1\.0: cannot be loaded"):
        load_entry_point_plugins(make_registry())


@pytest.mark.usefixtures("site")
def test_without_installed_plugins_nothing_is_added() -> None:
    registry = make_registry()
    before = registry.types()
    assert load_entry_point_plugins(registry) == []
    assert registry.types() == before
