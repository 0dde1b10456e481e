"""Metric specs: parsing ``name{label=value}`` and choosing the series a metric is read from."""

from __future__ import annotations

import math

import pytest

from domain.datalayer.metric_spec import (
    MetricSpec,
    latest_by_timestamp,
    latest_by_value,
    parse_metric_spec,
)
from domain.datalayer.prometheus_text import Sample


def spec(text: str) -> MetricSpec:
    parsed = parse_metric_spec(text)
    assert parsed is not None
    return parsed


def test_empty_string_disables() -> None:
    assert parse_metric_spec("") is None


@pytest.mark.parametrize(
    ("text", "name", "labels"),
    [
        ("vllm:num_requests_waiting", "vllm:num_requests_waiting", {}),
        ("  queue_size  ", "queue_size", {}),
        ("m{}", "m", {}),
        ('m{request_type="waiting"}', "m", {"request_type": "waiting"}),
        ("m{request_type=waiting}", "m", {"request_type": "waiting"}),
        ("m{request_type='waiting'}", "m", {"request_type": "waiting"}),
        ('m { a = x , b = "y z" , }', "m", {"a": "x", "b": "y z"}),
        ('m{a="say \\"hi\\"",b="back\\\\slash"}', "m", {"a": 'say "hi"', "b": "back\\slash"}),
        ('m{a="",b="1,2"}', "m", {"a": "", "b": "1,2"}),
        ("m{le=+Inf}", "m", {"le": "+Inf"}),
    ],
)
def test_valid_specs(text: str, name: str, labels: dict[str, str]) -> None:
    parsed = spec(text)
    assert parsed.name == name
    assert parsed.labels == labels


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("{a=b}", "must start with a metric name"),
        ("9m", "must start with a metric name"),
        ("m{a!=b}", "only '=' label matchers"),
        ("m{a=~b.*}", "only '=' label matchers"),
        ("m{a!~b}", "only '=' label matchers"),
        ("m{a}", "expected '=' after 'a'"),
        ("m{a=b", "expected ',' or '}'"),
        ('m{a="b}', "expected a label value"),
        ("m{,}", "expected a label name"),
        ("m{a=b,a=c}", "label 'a' is given twice"),
        ("m{a=b} extra", "unexpected 'extra'"),
        ("m n", "unexpected 'n'"),
        ('m{a="\\q"}', "invalid escape sequence"),
    ],
)
def test_invalid_specs(text: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        parse_metric_spec(text)


def test_str_renders_the_spec() -> None:
    assert str(spec("m")) == "m"
    assert str(spec("m{a=x,b='q\"'}")) == 'm{a="x",b="q\\""}'


def test_matches_requires_every_spec_label() -> None:
    waiting = spec("m{request_type=waiting}")
    assert waiting.matches({"request_type": "waiting", "model": "x"})
    assert not waiting.matches({"request_type": "scheduled"})
    assert not waiting.matches({})
    assert spec("m").matches({"anything": "1"})


def sample(value: float, ts: int | None = None, name: str = "m", **labels: str) -> Sample:
    return Sample(name=name, labels=labels, value=value, timestamp_ms=ts)


def test_latest_by_timestamp_takes_the_newest_matching_series() -> None:
    samples = [
        sample(1, 1000, kind="a"),
        sample(2, 3000, kind="b"),
        sample(3, 2000, kind="a"),
        sample(4, 5000, kind="a"),
    ]
    assert latest_by_timestamp(spec("m{kind=a}"), samples) is samples[3]
    assert latest_by_timestamp(spec("m{kind=b}"), samples) is samples[1]
    assert latest_by_timestamp(spec("m{kind=c}"), samples) is None
    assert latest_by_timestamp(spec("m"), samples) is samples[3]


def test_latest_by_timestamp_without_timestamps_takes_the_first() -> None:
    samples = [sample(1), sample(2), sample(3)]
    assert latest_by_timestamp(spec("m"), samples) is samples[0]
    with_one = [sample(1), sample(2, 10), sample(3)]
    assert latest_by_timestamp(spec("m"), with_one) is with_one[1]
    equal = [sample(1, 10), sample(2, 10)]
    assert latest_by_timestamp(spec("m"), equal) is equal[0]


def test_series_of_other_names_in_the_family_never_match() -> None:
    histogram = [sample(3, name="h_bucket", le="1"), sample(9, name="h_count"), sample(4, name="h")]
    assert latest_by_timestamp(spec("h"), histogram) is histogram[2]
    assert latest_by_timestamp(spec("h"), histogram[:2]) is None


def test_latest_by_value_takes_the_largest_value() -> None:
    samples = [
        sample(1745123400.1, running="a"),
        sample(math.nan, running="x"),
        sample(1745123456.7, running="a,b"),
        sample(1745123456.7, running="dup"),
        sample(17.0, name="other"),
    ]
    assert latest_by_value(spec("m"), samples) is samples[2]
    assert latest_by_value(spec("m{running=a}"), samples) is samples[0]
    assert latest_by_value(spec("m{running=x}"), samples) is None
    assert latest_by_value(spec("m"), []) is None
