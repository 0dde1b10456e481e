"""From YAML text to the typed config spec: strict YAML, then strict schema decoding.

A key repeated in one mapping, a document that is not a mapping, an unknown field or a
value of the wrong type is a ``ConfigError`` naming where it is (a line and column for
YAML, the config path for the schema). The text is bounded before it is built:
``MAX_CONFIG_BYTES`` (a ConfigMap's limit) and ``MAX_CONFIG_DEPTH`` nested collections
(PyYAML composes recursively: deeper text would exhaust the interpreter's stack).
"""

from __future__ import annotations

from typing import Any

import yaml
from pydantic import ValidationError

from app.config.errors import ConfigError
from app.config.parameters import render_validation_error
from app.config.schema import EndpointPickerConfigSpec

__all__ = [
    "MAX_CONFIG_BYTES",
    "MAX_CONFIG_DEPTH",
    "BoundedLoader",
    "decode",
    "parse_yaml",
    "yaml_problem",
]

#: The most bytes a config may have: a ConfigMap's limit (1 MiB).
MAX_CONFIG_BYTES = 1 << 20
#: The most levels of nested nodes a config may have (an EndpointPickerConfig has about 8).
MAX_CONFIG_DEPTH = 64


class BoundedLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses nodes nested deeper than ``MAX_CONFIG_DEPTH`` (the
    limit of every YAML file the EPP reads: config, static objectives)."""

    _depth = 0

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        if self._depth >= MAX_CONFIG_DEPTH:
            raise yaml.composer.ComposerError(
                None,
                None,
                f"nested deeper than {MAX_CONFIG_DEPTH} levels",
                self.peek_event().start_mark,  # type: ignore[no-untyped-call]
            )
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


class _StrictLoader(BoundedLoader):
    """``BoundedLoader`` that also refuses a key repeated in one mapping (strict decoding)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                repeated = key in seen
            except TypeError:  # unhashable: the base class reports it
                continue
            if repeated:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping",
                    node.start_mark,
                    f"found duplicate key {key!r}",
                    key_node.start_mark,
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def parse_yaml(text: str | None) -> dict[str, Any] | None:
    """The YAML document as a mapping; ``None`` for no text, blank text or only comments."""
    if text is None or not text.strip():
        return None
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_CONFIG_BYTES:
        raise ConfigError(f"config: {size} bytes, more than the {MAX_CONFIG_BYTES} bytes allowed")
    try:
        raw = yaml.load(text, Loader=_StrictLoader)  # a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise ConfigError(f"config: {yaml_problem(exc)}") from None
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ConfigError(f"config: must be a mapping, got {type(raw).__name__}")
    return raw


def yaml_problem(exc: yaml.YAMLError, *, context: bool = False) -> str:
    """``exc`` as one line: "invalid YAML at line L, column C: what"; with ``context``, and
    the error has one, followed by "(while ... at line L, column C)"."""
    if not isinstance(exc, yaml.MarkedYAMLError):
        return "invalid YAML: " + " ".join(str(exc).split())
    mark = exc.problem_mark or exc.context_mark
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    text = f"invalid YAML{where}: {exc.problem or exc.context}"
    if context and exc.problem and exc.context and exc.context_mark:
        at = exc.context_mark
        text += f" ({exc.context} at line {at.line + 1}, column {at.column + 1})"
    return text


def decode(raw: dict[str, Any]) -> EndpointPickerConfigSpec:
    """The mapping checked against the schema (unknown keys refused)."""
    try:
        return EndpointPickerConfigSpec.model_validate(raw)
    except ValidationError as exc:
        path, reason = render_validation_error(exc)
        if path == "data" and reason == "unknown field":
            reason = "unknown field (the data-layer section is called dataLayer)"
        raise ConfigError(f"{path or 'config'}: {reason}") from None
