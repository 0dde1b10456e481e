"""The metric catalogue is the only place a metric is declared, and it declares them well.

What the catalogue declares (names, types, labels, buckets) is pinned to the reference in
``test_prometheus_exporter``; here: every entry is exported, entries cannot be malformed,
and no product module writes a metric name of its own.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from ports import metric_catalogue as catalogue
from ports.metric_catalogue import CATALOGUE, CounterMetric, HistogramMetric, Metric

ROOT = Path(__file__).resolve().parents[3]
CATALOGUE_MODULE = ROOT / "ports" / "metric_catalogue.py"


def test_every_declared_entry_is_exported_once_under_a_unique_name() -> None:
    declared = [v for v in vars(catalogue).values() if isinstance(v, Metric)]
    assert len(CATALOGUE) == len(set(CATALOGUE)) == len(declared)
    assert set(CATALOGUE) == set(declared)
    assert len({m.name for m in CATALOGUE}) == len(CATALOGUE)


def test_a_malformed_entry_cannot_be_built() -> None:
    with pytest.raises(ValueError, match="strictly increasing"):
        HistogramMetric(name="h", help="h", buckets=(1.0, 0.5))
    with pytest.raises(ValueError, match="strictly increasing"):
        HistogramMetric(name="h", help="h", buckets=())
    with pytest.raises(ValueError, match="duplicate label"):
        CounterMetric(name="c_total", help="c", labels=("a", "a"))


def _string_literals(path: Path) -> list[tuple[int, str]]:
    """String constants of a module, docstrings aside."""
    tree = ast.parse(path.read_text(), filename=str(path))
    docstrings = {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
    }
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in docstrings
    ]


def test_no_product_module_writes_a_metric_name_of_its_own() -> None:
    names = {m.name for m in CATALOGUE}
    found = [
        f"{path.relative_to(ROOT)}:{line} {value!r}"
        for package in ("domain", "ports", "adapters", "app")
        for path in sorted((ROOT / package).rglob("*.py"))
        if path != CATALOGUE_MODULE
        for line, value in _string_literals(path)
        if value in names
    ]
    assert found == []
