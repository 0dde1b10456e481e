"""``--static-objectives``: InferenceObjective and InferenceModelRewrite manifests from a file.

The file holds the same YAML documents one would apply to a cluster (``kind:
InferenceObjective`` / ``InferenceModelRewrite``, several per file separated by ``---``),
so priorities and model rewrites work without Kubernetes. Other kinds are refused. The
file has the config file's limits: ``MAX_CONFIG_BYTES`` and ``MAX_CONFIG_DEPTH`` nested
collections, checked before anything is built.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from adapters.kubernetes.objectives import objective_priority, rewrite_rules
from app.config.decoding import MAX_CONFIG_BYTES, BoundedLoader, yaml_problem
from ports.objectives import ModelRewriteRule, ObjectiveSink

__all__ = ["StaticObjectivesError", "load_static_objectives"]


class StaticObjectivesError(ValueError):
    """The file cannot be used; the message names the document and the problem."""


def load_static_objectives(path: Path, sink: ObjectiveSink) -> tuple[int, int]:
    """Load the manifests into ``sink``; returns (objectives, rewrite rules) counts."""
    documents = _documents(path)
    priorities: dict[str, int | None] = {}
    rules: list[ModelRewriteRule] = []
    for index, document in enumerate(documents):
        where = f"{path} document {index + 1}"
        if not isinstance(document, dict):
            raise StaticObjectivesError(f"{where}: not a mapping")
        kind = document.get("kind")
        if kind not in ("InferenceObjective", "InferenceModelRewrite"):
            raise StaticObjectivesError(
                f"{where}: kind {kind!r} is not InferenceObjective or InferenceModelRewrite"
            )
        name = _name(document, where)
        try:
            if kind == "InferenceObjective":
                spec = document.get("spec") or {}
                raw = spec.get("priority") if isinstance(spec, dict) else None
                if raw is not None and (isinstance(raw, bool) or not isinstance(raw, int)):
                    raise StaticObjectivesError(
                        f"{where} ({name}): spec.priority must be an integer, not {raw!r}"
                    )
                priorities[name] = objective_priority(document)
            elif kind == "InferenceModelRewrite":
                rules.extend(rewrite_rules(document))
            else:
                raise StaticObjectivesError(
                    f"{where}: kind {kind!r} is not InferenceObjective or InferenceModelRewrite"
                )
        except (TypeError, ValueError, KeyError) as exc:
            if isinstance(exc, StaticObjectivesError):
                raise
            raise StaticObjectivesError(f"{where} ({name}): {exc}") from exc
    sink.set_objectives(priorities)
    sink.set_rules(rules)
    return len(priorities), len(rules)


def _documents(path: Path) -> list[Any]:
    """The file's YAML documents, within the config file's size and depth limits."""
    try:
        with path.open("rb") as file:
            data = file.read(MAX_CONFIG_BYTES + 1)  # a huge file is never read whole
    except OSError as exc:
        raise StaticObjectivesError(f"{path}: {exc}") from exc
    if len(data) > MAX_CONFIG_BYTES:
        raise StaticObjectivesError(f"{path}: more than the {MAX_CONFIG_BYTES} bytes allowed")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise StaticObjectivesError(f"{path}: not UTF-8 text ({exc.reason})") from None
    try:
        return [d for d in yaml.load_all(text, Loader=BoundedLoader) if d is not None]
    except yaml.YAMLError as exc:
        raise StaticObjectivesError(f"{path}: {yaml_problem(exc, context=True)}") from None


def _name(document: dict[str, Any], where: str) -> str:
    metadata = document.get("metadata")
    name = metadata.get("name") if isinstance(metadata, dict) else None
    if not isinstance(name, str) or not name:
        raise StaticObjectivesError(f"{where}: metadata.name is required")
    return name
