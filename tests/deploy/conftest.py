"""Rendered overlays, shared by the deploy tests (``kubectl kustomize`` runs once per dir)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from tests.support.manifests import KUBERNETES, OVERLAYS, render

Obj = Mapping[str, Any]


@pytest.fixture(scope="session")
def overlays() -> dict[str, list[Obj]]:
    """Each overlay's rendered objects, by overlay name."""
    return {name: render(KUBERNETES / "overlays" / name) for name in OVERLAYS}


@pytest.fixture(scope="session")
def crds() -> list[Obj]:
    return render(KUBERNETES / "crds")


@pytest.fixture(scope="session")
def examples() -> list[Obj]:
    return render(KUBERNETES / "examples")
