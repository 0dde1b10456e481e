"""The dependency rules of the hexagon: domain/ and ports/ use only the standard library."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIRST_PARTY = {"domain", "ports"}
ALLOWED = set(sys.stdlib_module_names) | FIRST_PARTY


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def _violations(package: str, allowed: set[str]) -> list[str]:
    problems = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for line, module in _imports(path):
            if module.split(".")[0] not in allowed:
                problems.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    return problems


@pytest.mark.parametrize(
    ("package", "allowed"),
    [("ports", set(sys.stdlib_module_names) | {"ports"}), ("domain", ALLOWED)],
)
def test_package_imports_only_stdlib_and_first_party(package: str, allowed: set[str]) -> None:
    assert (ROOT / package).is_dir()
    assert _violations(package, allowed) == []


def test_the_check_catches_a_third_party_import(tmp_path: Path) -> None:
    module = tmp_path / "bad.py"
    module.write_text("import orjson\nfrom grpc import aio\nimport json\n")
    offending = [m for _, m in _imports(module) if m.split(".")[0] not in ALLOWED]
    assert offending == ["orjson", "grpc"]
