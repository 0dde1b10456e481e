"""A standard-library ``JsonCodec``, for tests and for running without the orjson adapter."""

from __future__ import annotations

import json
from typing import Any

from ports.codec import JsonDecodeError

__all__ = ["StdlibJsonCodec"]


class StdlibJsonCodec:
    def loads(self, data: bytes) -> Any:
        try:
            return json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise JsonDecodeError(str(exc)) from exc

    def dumps(self, value: Any, *, sort_keys: bool = False) -> bytes:
        return json.dumps(
            value, sort_keys=sort_keys, separators=(",", ":"), ensure_ascii=False
        ).encode()
