"""deploy/grafana/epp-dashboard.json reads only what the EPP exports: every metric name in every
query is a name of the metric catalogue (with ``_bucket``/``_sum``/``_count`` for a
histogram), and every label a query selects or groups by is one that metric carries."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import pytest

from ports.metric_catalogue import CATALOGUE, HistogramMetric, MetricKind
from tests.support.manifests import ROOT

DASHBOARD = ROOT / "deploy" / "grafana" / "epp-dashboard.json"

_KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset",
    "and", "or", "unless", "inf", "nan",
    # aggregation operators, which may come before their by (...) clause
    "sum", "min", "max", "avg", "count", "stddev", "stdvar", "topk", "bottomk", "quantile",
    "count_values", "group",
}  # fmt: skip
_TOKEN = re.compile(
    r'"(?:[^"\\]|\\.)*"'  # a string
    r"|\[[^\]]*\]"  # a range
    r"|(?P<word>[A-Za-z_:][A-Za-z0-9_:]*)"
    r"|(?P<open>[({])|(?P<close>[)}])|\S"
)


def exported() -> dict[str, frozenset[str]]:
    """Every sample name on /metrics, with the labels its series carry."""
    names: dict[str, frozenset[str]] = {}
    for metric in CATALOGUE:
        expositions = [(metric.name, metric.labels)]
        expositions += [
            (a.name, (*a.labels, *(label for label, _ in a.constants))) for a in metric.aliases
        ]
        for name, labels in expositions:
            if metric.kind is MetricKind.COUNTER:
                name = name.removesuffix("_total") + "_total"
            if isinstance(metric, HistogramMetric):
                names[f"{name}_bucket"] = frozenset({*labels, "le"})
                names[f"{name}_sum"] = names[f"{name}_count"] = frozenset(labels)
            else:
                names[name] = frozenset(labels)
    return names


@dataclass
class Query:
    metrics: list[str]
    #: label names in selectors, per metric
    selected: list[tuple[str, str]]
    #: label names in by (...) / without (...)
    grouped: list[str]


def parse(expr: str) -> Query:
    """The metric names and label names a PromQL expression uses."""
    query = Query([], [], [])
    tokens = [(m.group(), m) for m in _TOKEN.finditer(expr)]
    index = 0
    while index < len(tokens):
        _, match = tokens[index]
        word = match.group("word")
        following = tokens[index + 1][0] if index + 1 < len(tokens) else ""
        if word and word.lower() in ("by", "without") and following == "(":
            index += 2
            while tokens[index][0] != ")":
                label = tokens[index][1].group("word")
                if label:
                    query.grouped.append(label)
                index += 1
        elif word and word.lower() not in _KEYWORDS and following != "(":
            query.metrics.append(word)
            if following == "{":
                index += 2
                while tokens[index][0] != "}":
                    label = tokens[index][1].group("word")
                    if label:
                        query.selected.append((word, label))
                    index += 1
        index += 1
    return query


def problems(expr: str, names: dict[str, frozenset[str]]) -> list[str]:
    query = parse(expr)
    found: list[str] = []
    if not query.metrics:
        found.append(f"{expr!r}: no metric")
    for metric in query.metrics:
        if metric not in names:
            found.append(f"{metric}: not exported")
    for metric, label in query.selected:
        if metric in names and label not in names[metric]:
            found.append(f"{metric}{{{label}}}: no such label")
    carried = set().union(*(names.get(m, frozenset()) for m in query.metrics))
    found += [
        f"by ({label}): no metric of {expr!r} has it"
        for label in query.grouped
        if label not in carried
    ]
    return found


def queries() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [
        (panel["title"], target["expr"])
        for panel in dashboard["panels"]
        for target in panel["targets"]
    ]


def test_every_query_reads_exported_metrics_and_labels() -> None:
    names = exported()
    found = {title: problems(expr, names) for title, expr in queries()}
    assert {title: p for title, p in found.items() if p} == {}
    assert len(found) >= 20  # the panels an SRE needs, not a token dashboard


def test_the_dashboard_reads_the_llm_d_names() -> None:
    used = {metric for _, expr in queries() for metric in parse(expr).metrics}
    assert sum(name.startswith("llm_d_epp_") for name in used) >= 15


@pytest.mark.parametrize(
    ("expr", "problem"),
    [
        ("rate(llm_d_epp_request_totl[5m])", "llm_d_epp_request_totl: not exported"),
        ("llm_d_epp_request_duration_seconds", "llm_d_epp_request_duration_seconds: not exported"),
        ('llm_d_epp_ready_endpoints{pod="a"}', "llm_d_epp_ready_endpoints{pod}: no such label"),
        (
            "sum by (pod_name) (rate(llm_d_epp_scheduler_attempts_total[5m]))",
            "by (pod_name): no metric of",
        ),
    ],
)
def test_the_check_catches_a_wrong_name_or_label(expr: str, problem: str) -> None:
    (found,) = problems(expr, exported())
    assert found.startswith(problem)
