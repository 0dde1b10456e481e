"""``JsonCodec`` on orjson: one parse per body, no intermediate copies."""

from __future__ import annotations

from typing import Any

import orjson

from ports.codec import JsonDecodeError

__all__ = ["OrjsonCodec"]

_INFINITE_NUMBER = "number is infinity when parsed as double"


class OrjsonCodec:
    def loads(self, data: bytes) -> Any:
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            message = str(exc)
            if message.startswith(_INFINITE_NUMBER):
                # orjson reads integers past 64 bits as doubles; past a double's range the
                # number is what is wrong, not an "infinity" the client never wrote.
                message = "number too large" + message[len(_INFINITE_NUMBER) :]
            raise JsonDecodeError(message) from exc

    def dumps(self, value: Any, *, sort_keys: bool = False) -> bytes:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS if sort_keys else 0)
