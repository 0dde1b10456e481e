"""Our text-format parser against ``prometheus_client``'s, on generated exposition text.

Valid bodies (families with HELP/TYPE, counters, gauges, untyped, histograms and summaries,
label values with the escapes ``\\\\`` ``\\"`` ``\\n`` and any unicode, NaN/+Inf/-Inf,
timestamps, blanks and tabs between tokens, blank lines and comments) must give the same
samples (name, labels, value with NaN equal to NaN, timestamp) from both parsers, and the
same from our wanted-only path as from our full parse.

Corrupted bodies that our parser rejects must be rejected by ``prometheus_client`` too,
unless the corruption is one of the intentional differences below. ``prometheus_client``
calls its parser "laxer than the main Go parser"; ours follows the Go parser of the
reference EPP (see the module docstring of ``domain.datalayer.prometheus_text``), so it
rejects these while ``prometheus_client`` accepts them:

- ``no-final-newline``: a last sample line without ``\\n`` (a cut body);
- ``bad-name-before-labels``: an invalid metric name (``9x``) before a label set
  (``prometheus_client`` checks the name only of samples without labels);
- ``float-timestamp``: a timestamp that is not an integer of milliseconds (``1.5``);
- ``second-help`` / ``second-type``: a family's second HELP or TYPE line;
- ``type-after-samples``: a TYPE line after the family's samples;
- ``bucket-without-le`` / ``quantile-missing``: a histogram bucket without ``le``, a summary
  quantile sample without ``quantile``;
- ``bad-le``: an ``le`` label that is not a float;
- ``unknown-escape``: a label value escape other than ``\\\\``, ``\\"`` and ``\\n``
  (``prometheus_client`` keeps it as written);
- ``histogram-bare-name``: a sample named as a histogram family itself, not its
  ``_bucket``, ``_sum`` or ``_count`` (``prometheus_client`` makes it an untyped family);
- ``value-then-junk``: text after the timestamp (``prometheus_client`` reads the first and
  the last token and ignores what is between);
- ``exemplar``: an OpenMetrics exemplar after the value (not part of format 0.0.4);
- ``crlf``: lines ending in ``\\r\\n`` (``prometheus_client`` strips each line).

Comparing the two found one bug in ours, fixed: it accepted the label name
``__name__``, which the reference's parser refuses ("label name "__name__" is reserved")
and ``prometheus_client`` refuses too (``reserved-label-name`` below).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from domain.datalayer.prometheus_text import parse_families

SampleKey = tuple[str, tuple[tuple[str, str], ...], float, float | None]

_BLANK = st.sampled_from([" ", "\t", "  ", " \t"])
_LABEL_NAME = st.from_regex(r"[a-zA-Z][a-zA-Z0-9_]{0,8}", fullmatch=True).filter(
    lambda n: n not in ("le", "quantile")
)
_LABEL_VALUE = st.text(st.characters(codec="utf-8"), max_size=12)
_INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _escape_help(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n")


@st.composite
def _value(draw: st.DrawFn) -> tuple[str, float]:
    kind = draw(st.sampled_from(["float", "int", "special", "sci"]))
    if kind == "special":
        text = draw(st.sampled_from(["NaN", "+Inf", "-Inf", "Inf", "nan", "+inf", "-inf"]))
    elif kind == "int":
        text = str(draw(st.integers(min_value=-(10**20), max_value=10**20)))
    elif kind == "sci":
        mantissa = draw(st.integers(min_value=-999, max_value=999))
        exponent = draw(st.integers(min_value=-30, max_value=30))
        text = f"{mantissa}{draw(st.sampled_from(['e', 'E']))}{exponent:+d}"
    else:
        text = repr(draw(st.floats(allow_nan=False, allow_infinity=False)))
    return text, float(text)


@st.composite
def _labels(draw: st.DrawFn) -> dict[str, str]:
    names = draw(st.lists(_LABEL_NAME, max_size=3, unique=True))
    return {name: draw(_LABEL_VALUE) for name in names}


@st.composite
def _sample_line(draw: st.DrawFn, name: str, labels: dict[str, str]) -> tuple[str, SampleKey]:
    text, value = draw(_value())
    timestamp = draw(st.none() | _INT64)
    lead = draw(st.sampled_from(["", "", " ", "\t"]))
    line = lead + name
    if draw(st.booleans()) or labels:
        blank = st.sampled_from(["", "", "", " ", "\t"])
        pairs = [
            f'{k}{draw(blank)}={draw(blank)}"{_escape_label(v)}"{draw(blank)}'
            for k, v in labels.items()
        ]
        trailing = "," if draw(st.booleans()) and pairs else ""
        line += draw(blank) + "{" + draw(blank) + ",".join(pairs) + trailing + "}"
    line += draw(_BLANK) + text
    if timestamp is not None:
        line += draw(_BLANK) + str(timestamp)
    key: SampleKey = (
        name,
        tuple(sorted(labels.items())),
        value,
        None if timestamp is None else timestamp / 1000,
    )
    return line, key


@st.composite
def _family(draw: st.DrawFn, index: int) -> tuple[list[str], list[SampleKey]]:
    kind = draw(st.sampled_from(["counter", "gauge", "untyped", "histogram", "summary", "none"]))
    base = f"f{index}_" + draw(st.from_regex(r"[a-zA-Z0-9_:]{0,8}", fullmatch=True))
    name = base + "_total" if kind == "counter" else base
    lines: list[str] = []
    if draw(st.booleans()):
        help_text = draw(st.text(st.characters(codec="utf-8"), max_size=20))
        lines.append(f"# HELP {name} {_escape_help(help_text)}".rstrip(" \t\x0b\x0c\r"))
    if kind != "none":
        lines.append(f"# TYPE {name} {kind}")
    keys: list[SampleKey] = []

    def add(sample_name: str, labels: dict[str, str]) -> None:
        line, key = draw(_sample_line(sample_name, labels))
        lines.append(line)
        keys.append(key)

    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        labels = draw(_labels())
        if kind == "histogram":
            bounds = sorted(set(draw(st.lists(st.floats(-1e6, 1e6), max_size=3))))
            for bound in [*(repr(b) for b in bounds), "+Inf"]:
                add(f"{name}_bucket", {**labels, "le": bound})
            add(f"{name}_sum", labels)
            add(f"{name}_count", labels)
        elif kind == "summary":
            for quantile in draw(st.lists(st.sampled_from(["0", "0.5", "0.99", "1"]), max_size=2)):
                add(name, {**labels, "quantile": quantile})
            add(f"{name}_sum", labels)
            add(f"{name}_count", labels)
        else:
            add(name, labels)
    return lines, keys


_FILLER = st.sampled_from(["", " ", "\t", "# a comment", "#", "# x y z", "#  HELPful note"])


@st.composite
def exposition(draw: st.DrawFn) -> tuple[str, list[SampleKey]]:
    """A valid body and its samples, in order."""
    lines: list[str] = []
    keys: list[SampleKey] = []
    for index in range(draw(st.integers(min_value=1, max_value=4))):
        family_lines, family_keys = draw(_family(index))
        for line in family_lines:
            if draw(st.integers(0, 5)) == 0:
                lines.append(draw(_FILLER))
            lines.append(line)
        keys.extend(family_keys)
    return "\n".join(lines) + "\n", keys


def _ours(text: str, wanted: Sequence[str] | None = None) -> list[SampleKey]:
    return [
        (
            sample.name,
            tuple(sorted(sample.labels.items())),
            sample.value,
            None if sample.timestamp_ms is None else sample.timestamp_ms / 1000,
        )
        for family in parse_families(text, wanted).values()
        for sample in family.samples
    ]


def _theirs(text: str) -> list[SampleKey]:
    return [
        (
            sample.name,
            tuple(sorted(sample.labels.items())),
            float(sample.value),
            None if sample.timestamp is None else float(sample.timestamp),
        )
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    ]


def _same(left: Sequence[SampleKey], right: Sequence[SampleKey]) -> bool:
    def norm(key: SampleKey) -> tuple[Any, ...]:
        name, labels, value, timestamp = key
        return (name, labels, "NaN" if math.isnan(value) else value, timestamp)

    return [norm(k) for k in left] == [norm(k) for k in right]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(exposition())
def test_valid_text_parses_to_the_same_samples_as_prometheus_client(
    case: tuple[str, list[SampleKey]],
) -> None:
    text, expected = case
    ours = _ours(text)
    assert _same(ours, expected), (text, ours)
    assert _same(_theirs(text), expected), text
    families = {key[0] for key in expected}  # the wanted-only path agrees with the full one
    assert _same(_ours(text, list(parse_families(text))), ours)
    assert families


# --- what we reject ------------------------------------------------------------------

#: corruptions of a valid body that both parsers must reject
_REJECTED_BY_BOTH: dict[str, Callable[[str], str]] = {
    "bad-name": lambda t: t + "9f0_n 1\n",
    "bad-value": lambda t: _replace_value(t, "1,5"),
    "underscore-value": lambda t: _replace_value(t, "1_000"),
    "unclosed-label-set": lambda t: _in_label_set(t, lambda s: s[: s.rindex("}")]),
    "unquoted-label-value": lambda t: _in_label_set(
        t, lambda s: re.sub(r'=([ \t]*)"', r'=\1x"', s, count=1)
    ),
    "duplicate-label": lambda t: _in_label_set(t, lambda s: s.replace("{", '{a="1",a="2",', 1)),
    "missing-value": lambda t: _replace_value(t, ""),
    "bad-type": lambda t: t + "# TYPE f0_t gauges\nf0_t 1\n",
    "reserved-label-name": lambda t: _in_label_set(t, lambda s: s.replace("{", '{__name__="",', 1)),
}

#: corruptions that only we reject: the intentional differences of the module docstring
_INTENTIONAL: dict[str, Callable[[str], str]] = {
    "no-final-newline": lambda t: t.rstrip("\n"),
    "bad-name-before-labels": lambda t: t + '9f0_n{a="b"} 1\n',
    "float-timestamp": lambda t: _append_to_first_sample(t, " 1.5"),
    "second-help": lambda t: t.replace("\n", "\n# HELP f0_x a\n# HELP f0_x b\n", 1),
    "second-type": lambda t: t + "# TYPE f0_y gauge\n# TYPE f0_y counter\n",
    "type-after-samples": lambda t: t + "f0_z 1\n# TYPE f0_z gauge\n",
    "bucket-without-le": lambda t: t + "# TYPE f0_h histogram\nf0_h_bucket 1\n",
    "quantile-missing": lambda t: t + "# TYPE f0_s summary\nf0_s 1\n",
    "bad-le": lambda t: t + '# TYPE f0_h histogram\nf0_h_bucket{le="x"} 1\n',
    "unknown-escape": lambda t: t + 'f0_e{a="\\q"} 1\n',
    "histogram-bare-name": lambda t: t + "# TYPE f0_h histogram\nf0_h 1\n",
    "value-then-junk": lambda t: _append_to_first_sample(t, " 12 34"),
    "exemplar": lambda t: _append_to_first_sample(t, ' # {trace_id="a"} 2'),
    "crlf": lambda t: t.replace("\n", "\r\n"),
}


def _first_sample(text: str) -> int:
    """The index of the first sample line (after HELP/TYPE/comments/blank lines)."""
    for index, line in enumerate(text.split("\n")):
        stripped = line.strip(" \t")
        if stripped and not stripped.startswith("#"):
            return index
    raise AssertionError(text)


def _in_label_set(text: str, change: Callable[[str], str]) -> str:
    """``change`` applied to the first sample line with a label set (from its ``{``)."""
    lines = text.split("\n")
    for index, line in enumerate(lines):
        stripped = line.strip(" \t")
        if stripped and not stripped.startswith("#") and "{" in line:
            brace = line.index("{")
            lines[index] = line[:brace] + change(line[brace:])
            return "\n".join(lines)
    return text


def _replace_value(text: str, value: str) -> str:
    lines = text.split("\n")
    index = _first_sample(text)
    line = lines[index]
    head = line[: line.rindex("}") + 1] if "}" in line else line.split()[0]
    lines[index] = f"{head} {value}"
    return "\n".join(lines)


def _append_to_first_sample(text: str, tail: str) -> str:
    lines = text.split("\n")
    index = _first_sample(text)
    lines[index] = _replace_value(lines[index] + "\n", "1").split("\n")[0] + tail
    return "\n".join(lines)


def _rejects(parse: Any, text: str) -> bool:
    try:
        parse(text)
    except ValueError:
        return True
    return False


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(exposition(), st.sampled_from(sorted(_REJECTED_BY_BOTH)))
def test_what_we_reject_prometheus_client_rejects_too(
    case: tuple[str, list[SampleKey]], corruption: str
) -> None:
    text = _REJECTED_BY_BOTH[corruption](case[0])
    if text == case[0]:
        return  # nothing to corrupt in this body
    assert _rejects(_ours, text), text
    assert _rejects(_theirs, text), text


@pytest.mark.parametrize("difference", sorted(_INTENTIONAL))
def test_the_intentional_differences(difference: str) -> None:
    text = _INTENTIONAL[difference]('# HELP f0_a x\nf0_a{b="c"} 1\n')
    assert _rejects(_ours, text), text
    assert not _rejects(_theirs, text), text
