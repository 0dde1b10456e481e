"""``JsonCodec`` on orjson: one parse per body, no intermediate copies."""

from __future__ import annotations

from typing import Any

import orjson

from ports.codec import JsonDecodeError

__all__ = ["OrjsonCodec"]


class OrjsonCodec:
    def loads(self, data: bytes) -> Any:
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise JsonDecodeError(str(exc)) from exc

    def dumps(self, value: Any, *, sort_keys: bool = False) -> bytes:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS if sort_keys else 0)
