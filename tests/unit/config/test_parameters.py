"""Validating a plugin's ``parameters`` mapping against its parameters dataclass."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Literal

import pytest
from pydantic import BaseModel, ConfigDict

from app.config.parameters import ParameterError, validate_parameters
from domain.plugins.base import Duration, EmptyParameters, Quantity


@dataclass(frozen=True, slots=True, kw_only=True)
class ProducerParameters:
    auto_tune: bool = True
    block_size_tokens: int = 16
    max_prefix_blocks_to_match: int = 256
    lru_capacity_per_server: int = 31250

    def __post_init__(self) -> None:
        if self.block_size_tokens <= 0:
            raise ValueError("blockSizeTokens: must be > 0")


DEFAULT_STALENESS = Duration(0.2)
DEFAULT_MAX_BYTES = Quantity(1024)


class Mode(enum.Enum):
    REQUESTS = "requests"
    TOKENS = "tokens"


@dataclass(frozen=True, slots=True, kw_only=True)
class MixedParameters:
    staleness: Duration = DEFAULT_STALENESS
    timeout: Duration | None = None
    max_bytes: Quantity = DEFAULT_MAX_BYTES
    limits: tuple[Quantity, ...] = ()
    ratio: float = 0.8
    mode: Literal["requests", "tokens"] = "requests"
    color: Mode = Mode.REQUESTS
    labels: dict[str, str] = field(default_factory=dict)
    names: tuple[str, ...] = ("a",)


@dataclass(frozen=True, slots=True, kw_only=True)
class AttributeKey:
    namespace: str = "envoy.lb"
    name: str

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("name: must not be empty")


@dataclass(frozen=True, slots=True, kw_only=True)
class Attribute:
    key: AttributeKey
    expression: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ReporterParameters:
    attributes: tuple[Attribute, ...] = ()

    def __post_init__(self) -> None:
        if len(self.attributes) != 1:
            raise ValueError("attributes: exactly one attribute is required")


@dataclass(frozen=True, slots=True, kw_only=True)
class RequiredParameters:
    threshold: float


@dataclass(frozen=True, slots=True, kw_only=True)
class UnkeyedErrorParameters:
    low: int = 0
    high: int = 1

    def __post_init__(self) -> None:
        if self.low > self.high:
            raise ValueError("low must not exceed high")


class ModelParameters(BaseModel):
    model_config = ConfigDict(extra="forbid")
    size: int = 3


def _error(parameters_type: type, raw: object) -> ParameterError:
    with pytest.raises(ParameterError) as caught:
        validate_parameters(parameters_type, raw)
    return caught.value


def test_absent_or_empty_parameters_give_the_defaults() -> None:
    assert validate_parameters(ProducerParameters, None) == ProducerParameters()
    assert validate_parameters(ProducerParameters, {}) == ProducerParameters()


def test_camel_case_keys_fill_snake_case_fields() -> None:
    parameters = validate_parameters(
        ProducerParameters,
        {"blockSizeTokens": 5, "maxPrefixBlocksToMatch": 128, "autoTune": False},
    )
    assert parameters == ProducerParameters(
        block_size_tokens=5, max_prefix_blocks_to_match=128, auto_tune=False
    )


def test_snake_case_keys_are_unknown() -> None:
    error = _error(ProducerParameters, {"block_size_tokens": 5})
    assert error.path == "block_size_tokens"
    assert error.reason.startswith("unknown field (expected one of autoTune, blockSizeTokens")


def test_unknown_key_is_named() -> None:
    assert str(_error(ProducerParameters, {"blockSize": 64})).startswith("blockSize: unknown field")


def test_a_plugin_without_parameters_rejects_any() -> None:
    assert validate_parameters(EmptyParameters, None) == EmptyParameters()
    assert validate_parameters(EmptyParameters, {}) == EmptyParameters()
    error = _error(EmptyParameters, {"anything": 1})
    assert str(error) == "anything: unknown field (this plugin type takes no parameters)"


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"blockSizeTokens": "5"}, "blockSizeTokens: Input should be a valid integer"),
        ({"blockSizeTokens": 5.5}, "blockSizeTokens: Input should be a valid integer"),
        ({"blockSizeTokens": None}, "blockSizeTokens: Input should be a valid integer"),
        ({"autoTune": "true"}, "autoTune: Input should be a valid boolean"),
        ({"autoTune": 1}, "autoTune: Input should be a valid boolean"),
    ],
)
def test_types_are_checked_strictly(raw: dict[str, object], message: str) -> None:
    assert str(_error(ProducerParameters, raw)) == message


def test_post_init_error_is_placed_at_its_key() -> None:
    error = _error(ProducerParameters, {"blockSizeTokens": 0})
    assert (error.path, error.reason) == ("blockSizeTokens", "must be > 0")
    assert str(error) == "blockSizeTokens: must be > 0"


def test_post_init_error_without_a_key_is_about_the_whole_mapping() -> None:
    error = _error(UnkeyedErrorParameters, {"low": 3})
    assert (error.path, error.reason) == ("", "low must not exceed high")


def test_not_a_mapping() -> None:
    error = _error(ProducerParameters, [1, 2])
    assert str(error) == "must be a mapping, got list"


def test_required_field() -> None:
    assert str(_error(RequiredParameters, {})) == "threshold: required field is missing"
    assert validate_parameters(RequiredParameters, {"threshold": 1}) == RequiredParameters(
        threshold=1.0
    )


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ({"staleness": "200ms"}, MixedParameters(staleness=Duration(0.2))),
        ({"staleness": "1m30s"}, MixedParameters(staleness=Duration(90.0))),
        ({"staleness": 2}, MixedParameters(staleness=Duration(2.0))),
        ({"staleness": 0.25}, MixedParameters(staleness=Duration(0.25))),
        ({"timeout": "5s"}, MixedParameters(timeout=Duration(5.0))),
        ({"timeout": None}, MixedParameters(timeout=None)),
        ({"maxBytes": "10Gi"}, MixedParameters(max_bytes=Quantity(10 * 1024**3))),
        ({"maxBytes": "1e3"}, MixedParameters(max_bytes=Quantity(1000))),
        ({"maxBytes": 5000}, MixedParameters(max_bytes=Quantity(5000))),
        ({"limits": ["1k", 2]}, MixedParameters(limits=(Quantity(1000), Quantity(2)))),
        ({"ratio": 1}, MixedParameters(ratio=1.0)),
        ({"mode": "tokens"}, MixedParameters(mode="tokens")),
        ({"color": "tokens"}, MixedParameters(color=Mode.TOKENS)),
        ({"labels": {"a": "b"}}, MixedParameters(labels={"a": "b"})),
        ({"names": ["x", "y"]}, MixedParameters(names=("x", "y"))),
    ],
)
def test_durations_quantities_and_containers(
    raw: dict[str, object], expected: MixedParameters
) -> None:
    assert validate_parameters(MixedParameters, raw) == expected


def test_sequences_become_tuples() -> None:
    parameters = validate_parameters(MixedParameters, {"names": ["x"]})
    assert isinstance(parameters.names, tuple)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"staleness": "-1s"}, "staleness: '-1s': durations cannot be negative"),
        ({"staleness": "soon"}, "staleness: 'soon' is not a duration such as 50ms, 2s or 1m30s"),
        ({"staleness": -1}, "staleness: -1 is not a non-negative duration"),
        ({"staleness": True}, "staleness: True is not a duration such as 50ms, 2s or 1m30s"),
        ({"maxBytes": "100m"}, "maxBytes: '100m' is not a whole number"),
        ({"maxBytes": "10GB"}, "maxBytes: '10GB': unknown quantity suffix 'GB'"),
        ({"maxBytes": "-1"}, "maxBytes: '-1': must not be negative"),
        ({"limits": ["1k", "x"]}, "limits[1]: 'x' is not a quantity such as 10Gi, 500M or 1000"),
        ({"mode": "bytes"}, "mode: Input should be 'requests' or 'tokens'"),
        ({"color": "red"}, "color: 'red' is not one of 'requests', 'tokens'"),
        ({"labels": {"a": 1}}, "labels.a: Input should be a valid string"),
        ({"ratio": "0.5"}, "ratio: Input should be a valid number"),
    ],
)
def test_invalid_durations_quantities_and_containers(raw: dict[str, object], message: str) -> None:
    assert str(_error(MixedParameters, raw)) == message


def test_nested_dataclasses() -> None:
    parameters = validate_parameters(
        ReporterParameters,
        {"attributes": [{"key": {"name": "tokens"}, "expression": "usage.total_tokens"}]},
    )
    assert parameters == ReporterParameters(
        attributes=(Attribute(key=AttributeKey(name="tokens"), expression="usage.total_tokens"),)
    )


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (
            {"attributes": [{"key": {"nmae": "x"}, "expression": "1"}]},
            "attributes[0].key.nmae: unknown field",
        ),
        (
            {"attributes": [{"key": {"name": ""}, "expression": "1"}]},
            "attributes[0].key.name: must not be empty",
        ),
        (
            {"attributes": [{"key": {"name": "x"}}]},
            "attributes[0].expression: required field is missing",
        ),
        ({"attributes": []}, "attributes: exactly one attribute is required"),
    ],
)
def test_nested_errors_name_their_path(raw: dict[str, object], message: str) -> None:
    assert str(_error(ReporterParameters, raw)) == message


def test_pydantic_model_parameters_are_validated_as_such() -> None:
    assert validate_parameters(ModelParameters, {"size": 4}) == ModelParameters(size=4)
    assert str(_error(ModelParameters, {"other": 1})) == "other: unknown field"


def test_other_parameter_types_receive_the_raw_mapping() -> None:
    assert validate_parameters(dict, {"free": ["form"]}) == {"free": ["form"]}
