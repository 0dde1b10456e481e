"""Validating a plugin's ``parameters`` mapping against its parameters dataclass.

A plugin type declares its parameters as a frozen stdlib dataclass (``PluginSpec.parameters``)
whose snake_case fields are the camelCase keys of the YAML. This module builds, once per
dataclass, a strict pydantic model with those keys as aliases and validates the YAML value
with it: unknown keys are refused, types are checked without lenient coercion (``"5"`` is not
an int, ``1`` is not a bool), ``Duration`` fields take Go duration strings or numbers of
seconds, ``Quantity`` fields take Kubernetes quantities. The dataclass is then built from the
keys that were given (its own defaults fill the rest), so its ``__post_init__`` checks run;
their ``ValueError("<camelCaseKey>: <why>")`` becomes a ``ParameterError`` at that key.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import types
import typing
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Union

import pydantic
from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationError
from pydantic_core import PydanticUndefined

from app.config.quantity import parse_quantity
from app.durations import parse_duration
from domain.plugins.base import Duration, Quantity, parameter_names

__all__ = [
    "ParameterError",
    "parse_duration_value",
    "parse_quantity_value",
    "render_validation_error",
    "validate_parameters",
]


class ParameterError(ValueError):
    """A parameters mapping is invalid. ``path`` is relative to the mapping ("" = itself)."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}" if path else reason)
        self.path = path
        self.reason = reason


def parse_duration_value(value: object) -> float:
    """Seconds from a Go duration string (``200ms``) or a non-negative number of seconds."""
    if isinstance(value, str):
        return parse_duration(value)
    if isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
        if not math.isfinite(seconds) or seconds < 0:
            raise ValueError(f"{value!r} is not a non-negative duration")
        return seconds
    raise ValueError(f"{value!r} is not a duration such as 50ms, 2s or 1m30s")


def parse_quantity_value(value: object) -> int:
    """A non-negative whole Kubernetes quantity (``10Gi``, ``500M``, ``1000``)."""
    return parse_quantity(value)


def _to_tuple(value: object) -> object:
    return tuple(value) if isinstance(value, list) else value


def _to_frozenset(value: object) -> object:
    return frozenset(value) if isinstance(value, list | set) else value


def _to_enum(enum_type: type[enum.Enum]) -> Callable[[object], object]:
    def convert(value: object) -> object:
        if isinstance(value, enum_type):
            return value
        try:
            return enum_type(value)
        except ValueError:
            allowed = ", ".join(repr(member.value) for member in enum_type)
            raise ValueError(f"{value!r} is not one of {allowed}") from None

    return convert


_DURATION = Annotated[float, BeforeValidator(parse_duration_value)]
_QUANTITY = Annotated[int, BeforeValidator(parse_quantity_value)]
_MODEL_CONFIG = ConfigDict(
    extra="forbid", strict=True, populate_by_name=False, arbitrary_types_allowed=True
)

# The dataclass each generated model stands for.
_DATACLASS_OF: dict[type[BaseModel], type[Any]] = {}


def _field_type(annotation: Any) -> Any:
    """The pydantic type standing for a dataclass field's annotation."""
    if annotation is Duration:
        return _DURATION
    if annotation is Quantity:
        return _QUANTITY
    if isinstance(annotation, type):
        if dataclasses.is_dataclass(annotation):
            return _model_for(annotation)
        if issubclass(annotation, enum.Enum):
            return Annotated[annotation, BeforeValidator(_to_enum(annotation))]
        return annotation
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is None or not args:
        return annotation
    if origin is Annotated:
        return Annotated[(_field_type(args[0]), *annotation.__metadata__)]
    if origin is typing.Literal:
        return annotation
    converted = tuple(arg if arg is Ellipsis else _field_type(arg) for arg in args)
    if origin is Union or origin is types.UnionType:
        return Union[converted]  # noqa: UP007 - built from a runtime tuple
    rebuilt = origin[converted]
    if origin is tuple:
        return Annotated[rebuilt, BeforeValidator(_to_tuple)]
    if origin is frozenset:
        return Annotated[rebuilt, BeforeValidator(_to_frozenset)]
    return rebuilt


@functools.cache
def _model_for(parameters_type: type[Any]) -> type[BaseModel]:
    """The strict pydantic model validating ``parameters_type``'s YAML form (cached)."""
    hints = typing.get_type_hints(parameters_type, include_extras=True)
    aliases = {field: key for key, field in parameter_names(parameters_type).items()}
    definitions: dict[str, Any] = {}
    for field in dataclasses.fields(parameters_type):
        if not field.init:
            continue
        required = (
            field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
        )
        definitions[field.name] = (
            _field_type(hints[field.name]),
            pydantic.Field(
                default=PydanticUndefined if required else None, alias=aliases[field.name]
            ),
        )
    model: type[BaseModel] = pydantic.create_model(
        f"{parameters_type.__name__}Model", __config__=_MODEL_CONFIG, **definitions
    )
    _DATACLASS_OF[model] = parameters_type
    return model


def _location(loc: tuple[int | str, ...]) -> str:
    """``('attributes', 0, 'key')`` → ``attributes[0].key``; pydantic's union-member tags
    (``int``, ``function-before[...]``) are left out."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part in _TYPE_TAGS or "[" in part:
            continue
        else:
            path += f".{part}" if path else part
    return path


_TYPE_TAGS = frozenset(
    {"int", "float", "str", "bool", "none", "bytes", "list", "tuple", "dict", "set", "frozenset"}
)


def _reason(error: Mapping[str, Any]) -> str:
    kind = error.get("type")
    if kind == "extra_forbidden":
        return "unknown field"
    if kind == "missing":
        return "required field is missing"
    message = str(error.get("msg", "invalid value"))
    return message.removeprefix("Value error, ")


def render_validation_error(exc: ValidationError) -> tuple[str, str]:
    """The first problem of a pydantic error as (path, reason); unknown keys come first,
    since a misspelt key usually explains the other errors."""
    errors = exc.errors()
    errors.sort(key=lambda e: e.get("type") != "extra_forbidden")
    first = errors[0]
    return _location(tuple(first["loc"])), _reason(first)


def _split(parameters_type: type[Any], message: str) -> tuple[str, str]:
    """Splits a ``__post_init__`` message ``"key: why"`` when ``key`` is a field's key."""
    key, sep, reason = message.partition(":")
    if sep and key.strip() in parameter_names(parameters_type):
        return key.strip(), reason.strip()
    return "", message


def _join(prefix: str, path: str) -> str:
    if not prefix:
        return path
    if not path:
        return prefix
    return prefix + path if path.startswith("[") else f"{prefix}.{path}"


def _build(value: Any, path: str) -> Any:
    """Turns validated models (recursively, in containers) into their dataclasses."""
    if isinstance(value, BaseModel) and type(value) in _DATACLASS_OF:
        parameters_type = _DATACLASS_OF[type(value)]
        aliases = {field: key for key, field in parameter_names(parameters_type).items()}
        kwargs = {
            name: _build(getattr(value, name), _join(path, aliases[name]))
            for name in value.model_fields_set
        }
        try:
            return parameters_type(**kwargs)
        except ValueError as exc:
            key, reason = _split(parameters_type, str(exc))
            raise ParameterError(_join(path, key), reason) from exc
    if isinstance(value, list | tuple):
        built = [_build(item, f"{path}[{i}]") for i, item in enumerate(value)]
        return type(value)(built)
    if isinstance(value, dict):
        return {k: _build(v, _join(path, str(k))) for k, v in value.items()}
    return value


def validate_parameters(parameters_type: type[Any], raw: object) -> Any:
    """An instance of ``parameters_type`` from a plugin's YAML ``parameters`` value.

    ``raw`` is ``None`` (absent: all defaults) or a mapping with camelCase keys. A
    dataclass without fields accepts only an empty mapping. A parameters type that is a
    pydantic model is validated as such; any other type receives the mapping as a ``dict``.
    Raises ``ParameterError`` naming the offending key.
    """
    if raw is not None and not isinstance(raw, Mapping):
        raise ParameterError("", f"must be a mapping, got {type(raw).__name__}")
    values: Mapping[Any, Any] = raw or {}
    if dataclasses.is_dataclass(parameters_type):
        known = parameter_names(parameters_type)
        for key in values:
            if key not in known:
                hint = (
                    f"expected one of {', '.join(known)}"
                    if known
                    else "this plugin type takes no parameters"
                )
                raise ParameterError(str(key), f"unknown field ({hint})")
        model = _model_for(parameters_type)
    elif isinstance(parameters_type, type) and issubclass(parameters_type, BaseModel):
        model = parameters_type
    else:
        return dict(values)
    try:
        validated = model.model_validate(dict(values))
    except ValidationError as exc:
        path, reason = render_validation_error(exc)
        raise ParameterError(path, reason) from None
    if model is parameters_type:
        return validated
    return _build(validated, "")
