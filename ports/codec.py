"""JSON encoding, behind a port so the domain stays free of third-party packages."""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["JsonCodec", "JsonDecodeError"]


class JsonDecodeError(ValueError):
    """Raised by ``JsonCodec.loads`` for input that is not valid JSON (UTF-8)."""


class JsonCodec(Protocol):
    """Thread-safe, stateless JSON codec.

    ``loads`` raises ``JsonDecodeError`` (and nothing else) on invalid input.
    ``dumps`` returns compact UTF-8 JSON; with ``sort_keys`` object keys are sorted
    (the reference re-marshals mutated bodies with sorted keys).
    """

    def loads(self, data: bytes) -> Any: ...

    def dumps(self, value: Any, *, sort_keys: bool = False) -> bytes: ...
