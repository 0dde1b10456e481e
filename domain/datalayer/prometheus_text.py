"""A parser of the Prometheus text exposition format, version 0.0.4.

``parse_families(text)`` returns every metric family of a ``/metrics`` body by name;
``parse_families(text, wanted)`` parses only the named families and is the data layer's hot
path: one regular-expression pass locates the lines that start with a wanted name (or are
its ``# HELP``/``# TYPE`` comments) and only those are parsed, so the other lines cost next
to nothing. Parsed lines are remembered by their bytes (a bounded cache), since most of them
repeat from scrape to scrape and across the endpoints of a pool.

What is accepted, as the reference's parser does (except that blanks may end a sample line
and unknown escapes in HELP text are kept as written):

- lines end with ``\\n``; blank lines and leading blanks/tabs are ignored;
- ``# HELP name doc`` (doc escapes ``\\\\`` and ``\\n``) and ``# TYPE name type`` (``counter``,
  ``gauge``, ``histogram``, ``summary``, ``untyped``; case-insensitive) describe a family;
  at most one of each per family, and TYPE before the family's first sample; any other
  comment is ignored;
- a sample is ``name[{labels}] value [timestamp]``: names match ``[a-zA-Z_:][a-zA-Z0-9_:]*``,
  label names ``[a-zA-Z_][a-zA-Z0-9_]*`` (``__name__`` is reserved), label values are
  double-quoted with the escapes ``\\\\``, ``\\"`` and ``\\n``; a label set may end with a
  comma; blanks may separate the tokens; values are floats (``NaN``, ``+Inf``, ``-Inf``,
  scientific notation); the timestamp is an integer of milliseconds;
- ``<base>_bucket`` (with an ``le`` label), ``<base>_sum`` and ``<base>_count`` belong to the
  family ``<base>`` when it was declared a histogram before them; ``<base>`` (with a
  ``quantile`` label), ``_sum`` and ``_count`` to a summary. A name whose family was seen
  first keeps its own family. A sample of an undeclared name makes an ``untyped`` family;
- families that end up without samples are left out.

A malformed line raises ``ValueError("line N: <problem>")``; with ``wanted`` given, only the
lines of the wanted families are checked. Since a cut body could otherwise end in a
plausible but wrong value, a sample or HELP/TYPE line that is not followed by ``\\n`` is an
error ("unexpected end of input"), as in the reference.
"""

from __future__ import annotations

import functools
import itertools
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final

__all__ = ["METRIC_TYPES", "MetricFamily", "Sample", "TooManyLinesError", "parse_families"]

#: The family types of format 0.0.4.
METRIC_TYPES: Final = frozenset({"counter", "gauge", "histogram", "summary", "untyped"})

_SUFFIXES: Final = ("_bucket", "_sum", "_count")
_INT64_MIN: Final = -(2**63)
_INT64_MAX: Final = 2**63 - 1
#: The label name that holds a series' name inside Prometheus; the reference refuses it.
_RESERVED_LABEL: Final = "__name__"


@dataclass(frozen=True, slots=True, kw_only=True)
class Sample:
    """One series' value: ``name`` is the sample's own name (``x_bucket`` in family ``x``)."""

    name: str
    labels: Mapping[str, str]
    value: float
    timestamp_ms: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class MetricFamily:
    """A metric family: its name, type (one of ``METRIC_TYPES``), help text and samples in
    the order of the body."""

    name: str
    type: str
    help: str
    samples: tuple[Sample, ...]


# --- line grammar ----------------------------------------------------------------------

_BLANKS = r"[ \t]*+"
_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*+"
_LABEL_NAME = r"[a-zA-Z_][a-zA-Z0-9_]*+"
# Unrolled ("normal* (special normal*)*") so the common run of plain characters is one
# tight loop inside the regex engine.
_LABEL_VALUE_BODY = r'[^"\\\n]*+(?:\\[\\"n][^"\\\n]*+)*+'
_LABEL_VALUE = '"' + _LABEL_VALUE_BODY + '"'
_LABEL = _LABEL_NAME + _BLANKS + "=" + _BLANKS + _LABEL_VALUE
_FLOAT = (
    r"[+-]?+(?:[0-9]++\.?+[0-9]*+|\.[0-9]++)(?:[eE][+-]?+[0-9]++)?+"
    r"|[+-]?+(?i:inf(?:inity)?+)|(?i:nan)"
)

_SAMPLE_RE: Final = re.compile(
    rf"{_BLANKS}(?P<name>{_NAME}){_BLANKS}"
    rf"(?:\{{(?P<labels>{_BLANKS}(?:{_LABEL}{_BLANKS},{_BLANKS})*+(?:{_LABEL}{_BLANKS})?+)\}}"
    rf"{_BLANKS})?+"
    rf"(?P<value>{_FLOAT})(?:[ \t]++(?P<ts>[+-]?+[0-9]++))?+{_BLANKS}"
)
_LABEL_PAIR_RE: Final = re.compile(rf'({_LABEL_NAME}){_BLANKS}={_BLANKS}"({_LABEL_VALUE_BODY})"')
_COMMENT_RE: Final = re.compile(
    rf"{_BLANKS}#{_BLANKS}(?P<kind>HELP|TYPE)[ \t]++(?P<name>{_NAME})(?:[ \t]++(?P<rest>.*))?+"
)
_ESCAPE_RE: Final = re.compile(r"\\(.)")
_LABEL_UNESCAPES: Final = {"\\": "\\", '"': '"', "n": "\n"}
_HELP_UNESCAPES: Final = {"\\": "\\", "n": "\n"}

# Pieces used only to explain why a line does not match.
_NAME_AT: Final = re.compile(_NAME)
_LABEL_NAME_AT: Final = re.compile(_LABEL_NAME)
_FLOAT_FULL: Final = re.compile(_FLOAT)


class TooManyLinesError(ValueError):
    """The body holds more lines of the wanted families than ``max_lines``."""


class _LineError(Exception):
    """A problem with one line; the caller adds the line number."""


def _unescape_label(value: str) -> str:
    if "\\" not in value:
        return value
    return _ESCAPE_RE.sub(lambda m: _LABEL_UNESCAPES[m.group(1)], value)


def _unescape_help(text: str) -> str:
    if "\\" not in text:
        return text
    # Unknown escapes are kept as written: HELP text never affects a value.
    return _ESCAPE_RE.sub(lambda m: _HELP_UNESCAPES.get(m.group(1), m.group(0)), text)


def _skip_blanks(line: str, pos: int) -> int:
    while pos < len(line) and line[pos] in " \t":
        pos += 1
    return pos


def _token_at(line: str, pos: int) -> str:
    end = pos
    while end < len(line) and line[end] not in " \t":
        end += 1
    return line[pos:end]


def _explain_sample(line: str) -> str:
    """Why ``line`` is not a valid sample line (called only after the full match failed)."""
    pos = _skip_blanks(line, 0)
    name = _NAME_AT.match(line, pos)
    if name is None:
        return f"invalid metric name at {line[pos : pos + 20]!r}"
    pos = _skip_blanks(line, name.end())
    if line.startswith("{", pos):
        pos = _skip_blanks(line, pos + 1)
        seen: set[str] = set()
        while not line.startswith("}", pos):
            label = _LABEL_NAME_AT.match(line, pos)
            if label is None:
                return f"invalid label name at {line[pos : pos + 20]!r}"
            key = label.group()
            if key == _RESERVED_LABEL:
                return f"label name {key!r} is reserved"
            pos = _skip_blanks(line, label.end())
            if not line.startswith("=", pos):
                return f"expected '=' after label name {key!r}"
            pos = _skip_blanks(line, pos + 1)
            if not line.startswith('"', pos):
                return f"expected '\"' to open the value of label {key!r}"
            pos += 1
            while not line.startswith('"', pos):
                if pos >= len(line):
                    return f"unterminated value of label {key!r}"
                if line[pos] == "\\":
                    escaped = line[pos + 1 : pos + 2]
                    if escaped not in _LABEL_UNESCAPES:
                        return f"invalid escape sequence '\\{escaped}' in label {key!r}"
                    pos += 1
                pos += 1
            if key in seen:
                return f"duplicate label {key!r}"
            seen.add(key)
            pos = _skip_blanks(line, pos + 1)
            if line.startswith(",", pos):
                pos = _skip_blanks(line, pos + 1)
            elif not line.startswith("}", pos):
                return f"expected ',' or '}}' after the value of label {key!r}"
        pos = _skip_blanks(line, pos + 1)
    value = _token_at(line, pos)
    if not value:
        return "missing value"
    if _FLOAT_FULL.fullmatch(value) is None:
        return f"invalid value {value!r}"
    pos = _skip_blanks(line, pos + len(value))
    timestamp = _token_at(line, pos)
    if not re.fullmatch(r"[+-]?[0-9]+", timestamp):
        return f"invalid timestamp {timestamp!r}"
    return f"unexpected text after the timestamp: {line[pos + len(timestamp) :].strip()!r}"


def _parse_sample(line: str) -> Sample:
    match = _SAMPLE_RE.fullmatch(line)
    if match is None:
        raise _LineError(_explain_sample(line))
    name, raw_labels, raw_value, raw_ts = match.group("name", "labels", "value", "ts")
    labels: dict[str, str]
    if raw_labels:
        pairs = _LABEL_PAIR_RE.findall(raw_labels)
        labels = dict(pairs)
        if len(labels) != len(pairs) or _RESERVED_LABEL in labels:
            raise _LineError(_explain_sample(line))
        if "\\" in raw_labels:
            labels = {key: _unescape_label(value) for key, value in labels.items()}
    else:
        labels = {}
    timestamp: int | None = None
    if raw_ts is not None:
        timestamp = int(raw_ts)
        if not _INT64_MIN <= timestamp <= _INT64_MAX:
            raise _LineError(f"timestamp {raw_ts} is out of range")
    return Sample(
        name=name, labels=MappingProxyType(labels), value=float(raw_value), timestamp_ms=timestamp
    )


@dataclass(slots=True)
class _Family:
    name: str
    type: str | None = None
    help: str | None = None
    samples: list[Sample] = field(default_factory=list)


class _Builder:
    """Families under construction, resolving sample names the way the reference does."""

    __slots__ = ("families",)

    def __init__(self) -> None:
        self.families: dict[str, _Family] = {}

    def resolve(self, name: str) -> _Family:
        family = self.families.get(name)
        if family is not None:
            return family
        if name.endswith(_SUFFIXES):
            base = self.families.get(name[: name.rindex("_")])
            if base is not None and (
                base.type == "histogram" or (base.type == "summary" and name[-7:] != "_bucket")
            ):
                return base
        family = self.families[name] = _Family(name)
        return family

    def line(self, text: str) -> None:
        """Feeds one line (without its newline) that is not blank."""
        if text.lstrip(" \t")[:1] == "#":
            match = _COMMENT_RE.fullmatch(text)
            if match is not None:
                self.comment(*match.group("kind", "name", "rest"))
                return
            stripped = text.lstrip(" \t")[1:].lstrip(" \t")
            keyword = stripped[:4]
            if (
                keyword in ("HELP", "TYPE")
                and stripped[4:5] in (" ", "\t")
                and stripped[4:].strip()
            ):
                raise _LineError(f"invalid metric name in {keyword} comment")
            return  # any other comment
        self.sample(_parse_sample(text))

    def comment(self, kind: str, name: str, rest: str | None) -> None:
        """A ``# HELP`` or ``# TYPE`` line of ``name``; ``rest`` follows the name's blanks."""
        family = self.resolve(name)
        if not rest:
            return  # "# HELP name" / "# TYPE name" alone say nothing
        if kind == "HELP":
            if family.help is not None:
                raise _LineError(f"second HELP line for metric name {name!r}")
            family.help = _unescape_help(rest)
            return
        metric_type = rest.rstrip(" \t").lower()
        if metric_type not in METRIC_TYPES:
            raise _LineError(f"unknown metric type {rest.strip()!r}")
        if family.type is not None:
            raise _LineError(
                f"second TYPE line for metric name {name!r}, or TYPE reported after samples"
            )
        family.type = metric_type

    def sample(self, sample: Sample) -> None:
        family = self.resolve(sample.name)
        if family.type is None:
            family.type = "untyped"
        elif family.type == "histogram":
            suffix = sample.name[len(family.name) :]
            if suffix == "_bucket":
                _check_bound(sample, "le")
            elif suffix not in ("_sum", "_count"):
                raise _LineError(
                    f"histogram {family.name!r} sample {sample.name!r} is not a _bucket, "
                    "_sum or _count"
                )
        elif family.type == "summary" and sample.name == family.name:
            _check_bound(sample, "quantile")
        family.samples.append(sample)

    def result(self, wanted: Collection[str] | None) -> dict[str, MetricFamily]:
        return {
            name: MetricFamily(
                name=name,
                type=family.type or "untyped",
                help=family.help or "",
                samples=tuple(family.samples),
            )
            for name, family in self.families.items()
            if family.samples and (wanted is None or name in wanted)
        }


def _check_bound(sample: Sample, label: str) -> None:
    bound = sample.labels.get(label)
    if bound is None:
        raise _LineError(f"{sample.name!r} sample has no {label!r} label")
    if _FLOAT_FULL.fullmatch(bound) is None:
        raise _LineError(f"{sample.name!r} sample has an invalid {label!r} label {bound!r}")


# --- whole bodies ----------------------------------------------------------------------


def _needs_check(text: str) -> bool:
    """Whether an unterminated last line is one that carries data (sample, HELP, TYPE)."""
    stripped = text.strip(" \t")
    if not stripped:
        return False
    if stripped[0] != "#":
        return True
    return _COMMENT_RE.fullmatch(text) is not None


def _parse_all(body: bytes) -> dict[str, MetricFamily]:
    builder = _Builder()
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        number = body.count(b"\n", 0, exc.start) + 1
        raise ValueError(f"line {number}: invalid UTF-8") from None
    lines = text.split("\n")
    last = len(lines) - 1
    for number, line in enumerate(lines, 1):
        if not line.strip(" \t"):
            continue
        try:
            if number - 1 == last and _needs_check(line):
                raise _LineError("unexpected end of input (no newline after the last line)")
            builder.line(line)
        except _LineError as exc:
            raise ValueError(f"line {number}: {exc}") from None
    return builder.result(None)


@dataclass(frozen=True, slots=True)
class _Plan:
    """What the wanted-only path looks for.

    ``names`` are the wanted names plus, closed under taking off a histogram/summary
    suffix, the bases whose TYPE decides where a suffixed name belongs; ``tokens`` are the
    line names that matter (``names`` with and without a suffix). ``after_newline`` finds,
    in one pass over the body, every line that starts (after blanks, or after ``# HELP`` or
    ``# TYPE``) with one of ``names``; ``at_start`` does the same for the body's first line.
    Both capture ``kind`` (HELP/TYPE, or none for a sample) and the line's name ``token``.
    """

    tokens: frozenset[bytes]
    after_newline: re.Pattern[bytes]
    at_start: re.Pattern[bytes]


@functools.lru_cache(maxsize=256)
def _plan(wanted: frozenset[str]) -> _Plan:
    names = set(wanted)
    pending = list(wanted)
    while pending:
        name = pending.pop()
        if name.endswith(_SUFFIXES):
            base = name[: name.rindex("_")]
            if base and base not in names:
                names.add(base)
                pending.append(base)
    encoded = sorted((name.encode() for name in names), key=lambda n: (-len(n), n))
    tokens = {*encoded, *(name + suffix.encode() for name in encoded for suffix in _SUFFIXES)}
    # An empty alternation would match every line; "(?!)" matches none.
    alternation = b"|".join(re.escape(name) for name in encoded) or b"(?!)"
    head = (
        rb"(?P<line>[ \t]*+(?:#[ \t]*+(?P<kind>HELP|TYPE)[ \t]++)?+)"
        rb"(?P<token>(?:" + alternation + rb")[a-zA-Z0-9_:]*+)"
    )
    return _Plan(
        tokens=frozenset(tokens),
        after_newline=re.compile(b"\n" + head),
        at_start=re.compile(head),
    )


# Parsed lines of the wanted-only path, by their bytes: HELP/TYPE lines, info series and
# most gauge values repeat from scrape to scrape and across the endpoints of a pool, so
# most lines are parsed once. Parsing a line does not depend on its context, and only
# lines that parsed are kept. Emptied when full.
_LINE_CACHE_SIZE: Final = 4096
_line_cache: dict[bytes, Sample | tuple[str, str, str]] = {}


def _parse_wanted(
    body: bytes, wanted: frozenset[str], max_lines: int | None
) -> dict[str, MetricFamily]:
    plan = _plan(wanted)
    tokens = plan.tokens
    cache = _line_cache
    builder = _Builder()
    first = plan.at_start.match(body)
    matches = plan.after_newline.finditer(body)
    located = itertools.chain((first,), matches) if first is not None else matches
    if max_lines is not None:
        located = itertools.islice(located, max_lines + 1)
    count = 0
    for match in located:
        count += 1
        if match.group("token") not in tokens:
            continue
        start = match.start("line")
        end = body.find(b"\n", start)
        try:
            if end < 0:
                raise _LineError("unexpected end of input (no newline after the last line)")
            line = body[start:end]
            parsed = cache.get(line)
            if parsed is None:
                parsed = _parse_located(match, line)
                if len(cache) >= _LINE_CACHE_SIZE:
                    cache.clear()
                cache[line] = parsed
            if type(parsed) is tuple:
                builder.comment(*parsed)
            else:
                builder.sample(parsed)  # type: ignore[arg-type]
        except (_LineError, UnicodeDecodeError) as exc:
            reason = "invalid UTF-8" if isinstance(exc, UnicodeDecodeError) else str(exc)
            number = body.count(b"\n", 0, start) + 1
            raise ValueError(f"line {number}: {reason}") from None
    if max_lines is not None and count > max_lines:
        number = body.count(b"\n", 0, match.start("line")) + 1
        token = match.group("token").decode(errors="replace")[:80]
        raise TooManyLinesError(
            f"line {number}: more than {max_lines} series of the metric families read "
            f"(this one: {token!r}); the body was not read"
        )
    return builder.result(wanted)


# The series part of sample lines (name and labels) already parsed, by its bytes: when only
# a line's value changes between scrapes (KV usage, timestamps), its labels are not parsed
# again; the value and timestamp are checked against the format on every line.
_SERIES_CACHE_SIZE: Final = 4096
_series_cache: dict[bytes, tuple[str, Mapping[str, str]]] = {}
_TAIL_RE: Final = re.compile(
    rf"{_BLANKS}(?P<value>{_FLOAT})(?:[ \t]++(?P<ts>[+-]?+[0-9]++))?+{_BLANKS}".encode()
)


def _split_series(line: bytes) -> int:
    """Where the series (name and label set) of a sample line ends; -1 when unclear."""
    close = line.rfind(b"}")  # a value or timestamp never holds a brace
    if close >= 0:
        return close + 1
    start = len(line) - len(line.lstrip(b" \t"))
    for index in range(start, len(line)):
        if line[index] in b" \t":
            return index
    return -1


def _parse_sample_line(line: bytes) -> Sample:
    cut = _split_series(line)
    if cut > 0:
        cached = _series_cache.get(line[:cut])
        if cached is not None:
            tail = _TAIL_RE.fullmatch(line, cut)
            if tail is not None:
                raw_ts = tail.group("ts")
                timestamp = int(raw_ts) if raw_ts is not None else None
                if timestamp is None or _INT64_MIN <= timestamp <= _INT64_MAX:
                    return Sample(
                        name=cached[0],
                        labels=cached[1],
                        value=float(tail.group("value")),
                        timestamp_ms=timestamp,
                    )
    sample = _parse_sample(line.decode())  # validates fully; raises on a bad line
    if cut > 0:
        if len(_series_cache) >= _SERIES_CACHE_SIZE:
            _series_cache.clear()
        _series_cache[line[:cut]] = (sample.name, sample.labels)
    return sample


def _parse_located(match: re.Match[bytes], line: bytes) -> Sample | tuple[str, str, str]:
    """Parses a line found by a plan: a sample, or a HELP/TYPE comment's parts."""
    kind = match.group("kind")
    if kind is None:
        return _parse_sample_line(line)
    rest = line[match.end() - match.start("line") :]
    if rest and rest[0] not in b" \t":
        raise _LineError(f"invalid metric name in {kind.decode()} comment")
    return kind.decode(), match.group("token").decode(), rest.lstrip(b" \t").decode()


def parse_families(
    text: bytes | str, wanted: Collection[str] | None = None, *, max_lines: int | None = None
) -> dict[str, MetricFamily]:
    """The metric families of a text-format body, by name.

    With ``wanted``, only those families are parsed and returned (a wanted family that is
    absent, or has no samples, is simply missing from the result), and only their lines
    are validated. Raises ``ValueError("line N: <problem>")`` for a malformed line.

    ``max_lines`` (with ``wanted`` only) bounds the work: the lines located for the wanted
    families (their samples and HELP/TYPE lines, and lines of other families whose names
    start with a wanted name) are parsed up to that many, and one more raises
    ``TooManyLinesError`` (a ``ValueError``) without reading the rest of the body.
    """
    body = text.encode("utf-8") if isinstance(text, str) else text
    if wanted is None:
        return _parse_all(body)
    if max_lines is not None and max_lines < 0:
        raise ValueError("max_lines: must be >= 0")
    return _parse_wanted(
        body, wanted if isinstance(wanted, frozenset) else frozenset(wanted), max_lines
    )
