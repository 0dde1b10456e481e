"""The Prometheus text-format parser: every format feature, on small and real-looking bodies."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from domain.datalayer.prometheus_text import MetricFamily, Sample, parse_families

FIXTURES = Path(__file__).parent / "fixtures"
FIXTURE_NAMES = ("vllm", "sglang", "trtllm_serve", "triton_trtllm")


def fixture(name: str) -> bytes:
    return (FIXTURES / f"{name}.txt").read_bytes()


def both(body: str, name: str) -> MetricFamily:
    """The family ``name`` from the full parse, checked equal to the wanted-only parse."""
    full = parse_families(body)
    assert parse_families(body, [name]) == {name: full[name]}
    return full[name]


def values(family: MetricFamily) -> list[float]:
    return [sample.value for sample in family.samples]


# --- comments --------------------------------------------------------------------------


def test_help_and_type_describe_the_family() -> None:
    family = both(
        "# HELP http_requests_total The total number of HTTP requests.\n"
        "# TYPE http_requests_total counter\n"
        'http_requests_total{method="post",code="200"} 1027 1395066363000\n'
        'http_requests_total{method="post",code="400"}    3 1395066363000\n',
        "http_requests_total",
    )
    assert family.type == "counter"
    assert family.help == "The total number of HTTP requests."
    assert family.samples == (
        Sample(
            name="http_requests_total",
            labels={"method": "post", "code": "200"},
            value=1027.0,
            timestamp_ms=1395066363000,
        ),
        Sample(
            name="http_requests_total",
            labels={"method": "post", "code": "400"},
            value=3.0,
            timestamp_ms=1395066363000,
        ),
    )


def test_help_escapes_and_other_comments() -> None:
    family = both(
        "# A free comment mentioning m 5\n"
        "#\n"
        "# HELP m Line one\\nline two, a backslash \\\\ and \\q kept.\n"
        "#TYPE m gauge\n"
        "#  EOF-ish comment\n"
        "m 1\n",
        "m",
    )
    assert family.help == "Line one\nline two, a backslash \\ and \\q kept."
    assert family.type == "gauge"


def test_type_is_case_insensitive_and_help_may_be_empty() -> None:
    family = both("# HELP g\n# TYPE g GAUGE\ng 2\n", "g")
    assert (family.type, family.help) == ("gauge", "")


def test_families_without_samples_are_left_out() -> None:
    assert parse_families("# HELP lonely Nothing here.\n# TYPE lonely gauge\n") == {}
    assert parse_families("") == {}
    assert parse_families("\n\n  \n") == {}


# --- names, labels, whitespace -----------------------------------------------------------


def test_metric_names_with_colons() -> None:
    family = both('vllm:num_requests_waiting{model_name="m"} 4.0\n', "vllm:num_requests_waiting")
    assert family.type == "untyped"
    assert values(family) == [4.0]


def test_label_values_with_escapes_and_special_characters() -> None:
    family = both(
        'm{path="C:\\\\dir\\\\",quote="say \\"hi\\"",nl="a\\nb",odd="},= {x=\\"y\\"}"} 1\n', "m"
    )
    assert family.samples[0].labels == {
        "path": "C:\\dir\\",
        "quote": 'say "hi"',
        "nl": "a\nb",
        "odd": '},= {x="y"}',
    }


def test_trailing_comma_empty_label_set_and_blanks() -> None:
    body = '   m{a="1",} 1\n\tm { a = "2" , b="x" , } 2\nm{} 3\nm{a="4"}4\nm\t5\t-7\t\n'
    family = both(body, "m")
    assert [dict(s.labels) for s in family.samples] == [
        {"a": "1"},
        {"a": "2", "b": "x"},
        {},
        {"a": "4"},
        {},
    ]
    assert values(family) == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert family.samples[4].timestamp_ms == -7


def test_special_and_scientific_values() -> None:
    body = "".join(
        f'v{{i="{i}"}} {text}\n'
        for i, text in enumerate(
            ["NaN", "+Inf", "-Inf", "1e3", "1.5E-3", "-0.5", "42", ".5", "7.", "+3", "Inf", "nan"]
        )
    )
    for family in (parse_families(body)["v"], parse_families(body, ["v"])["v"]):
        got = values(family)
        assert math.isnan(got[0])
        assert got[1:-1] == [
            math.inf,
            -math.inf,
            1000.0,
            0.0015,
            -0.5,
            42.0,
            0.5,
            7.0,
            3.0,
            math.inf,
        ]
        assert math.isnan(got[-1])


def test_timestamps_are_optional_integers() -> None:
    family = both("t 1 1712345678901\nt 2\n", "t")
    assert [s.timestamp_ms for s in family.samples] == [1712345678901, None]


def test_untyped_metrics() -> None:
    assert both("# TYPE u untyped\nu 1\n", "u").type == "untyped"
    assert both("plain 1\n", "plain").type == "untyped"


# --- histograms and summaries -----------------------------------------------------------

HISTOGRAM = (
    "# HELP lat Request latency.\n"
    "# TYPE lat histogram\n"
    'lat_bucket{le="0.1"} 3\n'
    'lat_bucket{le="1"} 7\n'
    'lat_bucket{le="+Inf"} 9\n'
    "lat_sum 4.2\n"
    "lat_count 9\n"
)


def test_histogram_series_belong_to_their_family() -> None:
    families = parse_families(HISTOGRAM)
    assert list(families) == ["lat"]
    family = both(HISTOGRAM, "lat")
    assert family.type == "histogram"
    assert [s.name for s in family.samples] == [
        "lat_bucket",
        "lat_bucket",
        "lat_bucket",
        "lat_sum",
        "lat_count",
    ]
    assert values(family) == [3.0, 7.0, 9.0, 4.2, 9.0]


def test_summary_series_belong_to_their_family() -> None:
    body = (
        "# TYPE rpc summary\n"
        'rpc{quantile="0.5"} 0.01\n'
        'rpc{quantile="0.99"} 0.2\n'
        "rpc_sum 17\n"
        "rpc_count 1000\n"
    )
    family = both(body, "rpc")
    assert family.type == "summary"
    assert [s.name for s in family.samples] == ["rpc", "rpc", "rpc_sum", "rpc_count"]


def test_suffixed_names_without_such_a_parent_are_families_of_their_own() -> None:
    body = "# TYPE c counter\nc 1\nc_count 2\nc_sum 3\nlat_bucket 4\n"
    assert set(parse_families(body)) == {"c", "c_count", "c_sum", "lat_bucket"}
    assert parse_families(body, ["c_count"])["c_count"].samples[0].value == 2.0


def test_a_name_seen_first_keeps_its_own_family() -> None:
    body = "x_count 5\n# TYPE x summary\nx_count 6\nx_sum 1\n"
    full = parse_families(body)
    assert values(full["x_count"]) == [5.0, 6.0]
    assert values(full["x"]) == [1.0]
    assert parse_families(body, ["x_count"]) == {"x_count": full["x_count"]}
    assert parse_families(body, ["x"]) == {"x": full["x"]}


def test_wanted_suffixed_name_under_a_histogram_parent_is_not_a_family() -> None:
    # vllm:e2e_request_latency_seconds_count belongs to the histogram family.
    assert parse_families(fixture("vllm"), ["vllm:e2e_request_latency_seconds_count"]) == {}


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        ('# TYPE h histogram\nh_bucket{x="1"} 1\n', "no 'le' label"),
        ('# TYPE h histogram\nh_bucket{le="high"} 1\n', "invalid 'le' label"),
        ("# TYPE h histogram\nh 1\n", "is not a _bucket, _sum or _count"),
        ("# TYPE s summary\ns 1\n", "no 'quantile' label"),
    ],
)
def test_histogram_and_summary_rules(body: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        parse_families(body)
    with pytest.raises(ValueError, match=problem):
        parse_families(body, [body.split()[2]])


# --- errors ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ('m{a="1",a="2"} 1', "duplicate label 'a'"),
        ('m{a="1",__name__="x"} 1', "label name '__name__' is reserved"),
        ('m{a="\\t"} 1', "invalid escape sequence"),
        ('m{a="1"', "unterminated value|expected ','"),
        ('m{a="1} 1', "unterminated value"),
        ("m{a=1} 1", "expected '\"'"),
        ('m{a "1"} 1', "expected '='"),
        ('m{1a="1"} 1', "invalid label name"),
        ('m{a="1" b="2"} 1', "expected ',' or '}'"),
        ("m", "missing value"),
        ('m{a="1"}', "missing value"),
        ("m abc", "invalid value 'abc'"),
        ("m 1_000", "invalid value"),
        ("m 1 1.5", "invalid timestamp '1.5'"),
        ("m 1 2 3", "unexpected text after the timestamp"),
        ("m 1 99999999999999999999", "out of range"),
        ("m 1\r", "invalid value"),
    ],
)
def test_malformed_sample_lines_name_line_and_problem(line: str, problem: str) -> None:
    body = f"# TYPE m gauge\nok 1\n{line}\n"
    with pytest.raises(ValueError, match=rf"^line 3: .*({problem})"):
        parse_families(body)
    with pytest.raises(ValueError, match=rf"^line 3: .*({problem})"):
        parse_families(body, ["m"])


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        ("# TYPE m gauge\n# TYPE m counter\nm 1\n", "second TYPE line"),
        ("m 1\n# TYPE m gauge\n", "TYPE reported after samples"),
        ("# HELP m a\n# HELP m b\nm 1\n", "second HELP line"),
        ("# TYPE m gaug\nm 1\n", "unknown metric type 'gaug'"),
        ("# TYPE m-x gauge\nm 1\n", "invalid metric name in TYPE comment"),
    ],
)
def test_malformed_comments_of_a_family(body: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        parse_families(body)
    with pytest.raises(ValueError, match=problem):
        parse_families(body, ["m"])


def test_invalid_names_and_encoding() -> None:
    with pytest.raises(ValueError, match=r"line 2: invalid metric name"):
        parse_families("a 1\n9lives 1\n")
    with pytest.raises(ValueError, match=r"line 2: invalid UTF-8"):
        parse_families(b'a 1\nm{a="\xff"} 1\n')
    with pytest.raises(ValueError, match=r"line 2: invalid UTF-8"):
        parse_families(b'a 1\nm{a="\xff"} 1\n', ["m"])
    assert parse_families('m{a="é"} 1\n'.encode(), ["m"])["m"].samples[0].labels == {"a": "é"}


def test_truncated_last_line_is_an_error() -> None:
    body = fixture("vllm")
    start = body.index(b"vllm:num_requests_waiting{")
    cut = body[: body.index(b"} 3.0\n", start) + 4]
    assert cut.endswith(b"} 3.")
    with pytest.raises(ValueError, match="unexpected end of input"):
        parse_families(cut)
    with pytest.raises(ValueError, match="unexpected end of input"):
        parse_families(cut, ["vllm:num_requests_waiting"])
    # Even when what is left would parse as a (wrong) value.
    whole = b"q 12\n"
    with pytest.raises(ValueError, match="line 1: unexpected end of input"):
        parse_families(whole[:3], ["q"])
    with pytest.raises(ValueError, match="unexpected end of input"):
        parse_families(b"q 1\n# HELP q cut here", ["q"])


def test_truncation_elsewhere_does_not_affect_the_wanted_families() -> None:
    body = fixture("vllm")
    cut = body[: body.index(b"vllm:lora_requests_info{") + 40]
    wanted = parse_families(cut, ["vllm:num_requests_waiting"])
    assert values(wanted["vllm:num_requests_waiting"]) == [3.0]
    # A trailing comment without a newline is harmless.
    assert parse_families(b"q 1\n# the end")["q"].samples[0].value == 1.0


# --- the wanted-only path ---------------------------------------------------------------


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_wanted_parse_equals_full_parse_for_every_family(name: str) -> None:
    body = fixture(name)
    full = parse_families(body)
    assert len(full) >= 10
    for family_name, family in full.items():
        assert parse_families(body, [family_name]) == {family_name: family}
    assert parse_families(body, list(full)) == full
    assert parse_families(body.decode()) == full


def test_vllm_fixture_families() -> None:
    full = parse_families(fixture("vllm"))
    waiting = full["vllm:num_requests_waiting"]
    assert (waiting.type, waiting.help) == ("gauge", "Number of requests waiting to be processed.")
    assert waiting.samples[0].labels == {
        "engine": "0",
        "model_name": "meta-llama/Llama-3.1-8B-Instruct",
    }
    lora = full["vllm:lora_requests_info"]
    assert values(lora) == [1745123400.1234, 1745123456.789, 1745123012.5]
    ttft = full["vllm:time_to_first_token_seconds"]
    assert ttft.type == "histogram"
    assert ttft.samples[-1].name == "vllm:time_to_first_token_seconds_sum"
    assert full["process_virtual_memory_bytes"].samples[0].value == 71353446400.0
    assert full["vllm:prompt_tokens_created"].type == "gauge"


def test_wanted_only_returns_the_wanted_and_skips_other_lines() -> None:
    body = (
        "garbage that is not a metric line {{{\n"
        "# TYPE good gauge\n"
        "good 1\n"
        'other{a="unterminated} 2\n'
        "good_total 3\n"
        'labelled{note="good 5"} 4\n'
        "# HELP docs see good 6\n"
    )
    assert parse_families(body, ["good"]) == {
        "good": MetricFamily(
            name="good",
            type="gauge",
            help="",
            samples=(Sample(name="good", labels={}, value=1.0),),
        )
    }
    assert parse_families(body, {"absent"}) == {}
    assert parse_families(body, []) == {}
    with pytest.raises(ValueError, match="line 1"):
        parse_families(body)


def test_wanted_lines_at_the_start_with_blanks_and_comment_variants() -> None:
    body = "w 1\n  w 2\n#\tHELP\tw Tabs.\n# TYPE other gauge\n\t w 3\n"
    family = parse_families(body, ["w"])["w"]
    assert values(family) == [1.0, 2.0, 3.0]
    assert family.help == "Tabs."


def test_labels_cannot_be_changed_through_a_result() -> None:
    body = 'm{a="1"} 1\n'
    sample = parse_families(body, ["m"])["m"].samples[0]
    with pytest.raises(TypeError):
        sample.labels["a"] = "2"  # type: ignore[index]
    assert parse_families(body, ["m"])["m"].samples[0].labels == {"a": "1"}


# --- round trip --------------------------------------------------------------------------

_names = st.from_regex(r"[a-zA-Z_:][a-zA-Z0-9_:]{0,12}", fullmatch=True)
_label_names = st.from_regex(r"[a-zA-Z_][a-zA-Z0-9_]{0,8}", fullmatch=True)
_label_values = st.text(st.characters(codec="utf-8"), max_size=12)
_values = st.floats(allow_nan=False) | st.sampled_from([math.inf, -math.inf])


def _format(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(value)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


@settings(max_examples=60, deadline=None)
@given(
    families=st.dictionaries(
        _names,
        st.lists(
            st.tuples(
                st.dictionaries(_label_names, _label_values, max_size=3),
                _values,
                st.none() | st.integers(-(2**63), 2**63 - 1),
            ),
            min_size=1,
            max_size=4,
        ),
        min_size=1,
        max_size=5,
    ),
    kind=st.sampled_from(["gauge", "counter", "untyped"]),
)
def test_round_trip(
    families: dict[str, list[tuple[dict[str, str], float, int | None]]], kind: str
) -> None:
    suffixed = [n for n in families if n.endswith(("_bucket", "_sum", "_count"))]
    for name in suffixed:  # keep names unambiguous
        families.pop(name)
    lines: list[str] = []
    for name, samples in families.items():
        lines += [f"# HELP {name} About {name}.", f"# TYPE {name} {kind}"]
        for labels, value, timestamp in samples:
            rendered = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
            stamp = "" if timestamp is None else f" {timestamp}"
            lines.append(f"{name}{{{rendered}}} {_format(value)}{stamp}")
    body = "\n".join(lines) + "\n"
    parsed = parse_families(body)
    assert set(parsed) == set(families)
    for name, samples in families.items():
        family = parsed[name]
        assert (family.type, family.help) == (kind, f"About {name}.")
        assert [(dict(s.labels), s.value, s.timestamp_ms) for s in family.samples] == samples
        assert parse_families(body, [name]) == {name: family}


def test_a_known_series_with_a_new_value_is_read_afresh() -> None:
    wanted = {"vllm:kv_cache_usage_perc"}
    for value in ("0.25", "0.5", "NaN", "+Inf", "1e-3"):
        body = f'vllm:kv_cache_usage_perc{{model_name="m",x="a}}b"}} {value} 1700\n'.encode()
        (sample,) = parse_families(body, wanted)["vllm:kv_cache_usage_perc"].samples
        expected = float(value)
        assert sample.value == expected or (expected != expected and sample.value != sample.value)
        assert sample.labels == {"model_name": "m", "x": "a}b"}
        assert sample.timestamp_ms == 1700


def test_a_known_series_with_a_bad_value_is_still_an_error() -> None:
    wanted = {"vllm:num_requests_waiting"}
    good = b'vllm:num_requests_waiting{model_name="m"} 3\n'
    assert parse_families(good, wanted)["vllm:num_requests_waiting"].samples[0].value == 3
    with pytest.raises(ValueError, match="line 1"):
        parse_families(b'vllm:num_requests_waiting{model_name="m"} 3x\n', wanted)
    with pytest.raises(ValueError, match="line 1"):
        parse_families(b"vllm:num_requests_waiting 3 4 5\n", wanted)


def test_max_lines_bounds_the_lines_of_the_wanted_families() -> None:
    body = b"# TYPE a gauge\nother 1\na 1\nab 2\na_sum 3\n"
    # located: the TYPE line, "a", "ab" (a name starting with "a") and "a_sum"
    assert parse_families(body, {"a"}, max_lines=4)["a"].samples[0].value == 1.0
    with pytest.raises(ValueError, match=r"^line 5: more than 3 series .*'a_sum'"):
        parse_families(body, {"a"}, max_lines=3)
    with pytest.raises(ValueError, match="max_lines"):
        parse_families(body, {"a"}, max_lines=-1)
    assert parse_families(b"other 1\n", {"a"}, max_lines=0) == {}
