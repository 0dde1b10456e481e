"""Metric specifications: which series of a scraped body a metric is read from.

A spec string uses PromQL instant-vector syntax, ``name{label=value,...}``: the family
name, then optionally equality matchers whose values may be double-quoted (with the
escapes ``\\\\``, ``\\"`` and ``\\n``), single-quoted, or bare (up to the next ``,`` or ``}``).
Only ``=`` matchers exist here; ``!=``, ``=~`` and ``!~`` are refused. The empty string
means "not read" (``parse_metric_spec`` returns ``None``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final

from domain.datalayer.prometheus_text import Sample

__all__ = ["MetricSpec", "latest_by_timestamp", "latest_by_value", "parse_metric_spec"]

_NAME_RE: Final = re.compile(r"[ \t]*([a-zA-Z_:][a-zA-Z0-9_:]*)[ \t]*")
_LABEL_NAME_RE: Final = re.compile(r"[ \t]*([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*")
_OPERATOR_RE: Final = re.compile(r"(=~|!~|!=|=)[ \t]*")
_DOUBLE_QUOTED_RE: Final = re.compile(r'"((?:[^"\\]|\\.)*)"[ \t]*')
_SINGLE_QUOTED_RE: Final = re.compile(r"'((?:[^'\\]|\\.)*)'[ \t]*")
_BARE_RE: Final = re.compile(r"([^\"',}\s]+)[ \t]*")
_ESCAPE_RE: Final = re.compile(r"\\(.)")
_ESCAPES: Final = {"\\": "\\", '"': '"', "'": "'", "n": "\n", "t": "\t"}


@dataclass(frozen=True, slots=True, kw_only=True)
class MetricSpec:
    """A metric family name and the label values its series must carry."""

    name: str
    labels: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    def matches(self, labels: Mapping[str, str]) -> bool:
        """Whether a series with ``labels`` carries every label of the spec."""
        wanted = self.labels
        return not wanted or all(labels.get(key) == value for key, value in wanted.items())

    def __str__(self) -> str:
        if not self.labels:
            return self.name
        inner = ",".join(f'{key}="{_quote(value)}"' for key, value in self.labels.items())
        return f"{self.name}{{{inner}}}"


def _quote(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _unescape(text: str) -> str:
    def replace(match: re.Match[str]) -> str:
        char = match.group(1)
        if char not in _ESCAPES:
            raise ValueError(f"invalid escape sequence '\\{char}'")
        return _ESCAPES[char]

    return _ESCAPE_RE.sub(replace, text)


def parse_metric_spec(text: str) -> MetricSpec | None:
    """The spec written as ``text``; ``None`` for the empty string.

    Raises ``ValueError`` naming the problem for anything else that is not
    ``name`` or ``name{label=value,...}`` (a trailing comma is allowed).
    """
    if text == "":
        return None
    name_match = _NAME_RE.match(text)
    if name_match is None:
        raise ValueError(f"{text!r} is not a metric spec: it must start with a metric name")
    pos = name_match.end()
    labels: dict[str, str] = {}
    if pos < len(text) and text[pos] == "{":
        pos += 1
        while True:
            label_match = _LABEL_NAME_RE.match(text, pos)
            if label_match is None:
                if text.startswith("}", _skip_blanks(text, pos)):
                    pos = _skip_blanks(text, pos) + 1
                    break
                raise ValueError(f"{text!r} is not a metric spec: expected a label name")
            label = label_match.group(1)
            operator = _OPERATOR_RE.match(text, label_match.end())
            if operator is None:
                raise ValueError(f"{text!r} is not a metric spec: expected '=' after {label!r}")
            if operator.group(1) != "=":
                raise ValueError(
                    f"{text!r}: only '=' label matchers are supported, not {operator.group(1)!r}"
                )
            value, pos = _label_value(text, operator.end())
            if label in labels:
                raise ValueError(f"{text!r}: label {label!r} is given twice")
            labels[label] = value
            if text.startswith(",", pos):
                pos += 1
            elif text.startswith("}", pos):
                pos += 1
                break
            else:
                raise ValueError(f"{text!r} is not a metric spec: expected ',' or '}}'")
    if text[pos:].strip(" \t"):
        raise ValueError(f"{text!r} is not a metric spec: unexpected {text[pos:].strip()!r}")
    return MetricSpec(name=name_match.group(1), labels=MappingProxyType(labels))


def _skip_blanks(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t":
        pos += 1
    return pos


def _label_value(text: str, pos: int) -> tuple[str, int]:
    for pattern in (_DOUBLE_QUOTED_RE, _SINGLE_QUOTED_RE):
        match = pattern.match(text, pos)
        if match is not None:
            try:
                return _unescape(match.group(1)), match.end()
            except ValueError as exc:
                raise ValueError(f"{text!r}: {exc}") from None
    bare = _BARE_RE.match(text, pos)
    if bare is None:
        raise ValueError(f"{text!r} is not a metric spec: expected a label value")
    return bare.group(1), bare.end()


def latest_by_timestamp(spec: MetricSpec, samples: Sequence[Sample]) -> Sample | None:
    """Among the samples named ``spec.name`` that carry the spec's labels, the one with the
    largest timestamp (the first such when several share it, or when none has one);
    ``None`` when none matches. A sample with a timestamp beats one without."""
    best: Sample | None = None
    best_ts = -math.inf
    name = spec.name
    for sample in samples:
        if sample.name != name or not spec.matches(sample.labels):
            continue
        ts = -math.inf if sample.timestamp_ms is None else sample.timestamp_ms
        if best is None or ts > best_ts:
            best, best_ts = sample, ts
    return best


def latest_by_value(spec: MetricSpec, samples: Sequence[Sample]) -> Sample | None:
    """Among the matching samples (as ``latest_by_timestamp``), the one with the largest
    value, the first of equals; NaN values never win. For info series whose value is the
    time they were last updated, such as LoRA's ``vllm:lora_requests_info``."""
    best: Sample | None = None
    name = spec.name
    for sample in samples:
        if sample.name != name or math.isnan(sample.value) or not spec.matches(sample.labels):
            continue
        if best is None or sample.value > best.value:
            best = sample
    return best
