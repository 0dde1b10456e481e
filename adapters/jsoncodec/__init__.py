"""JSON codec adapter (orjson)."""

from adapters.jsoncodec.orjson_codec import OrjsonCodec

__all__ = ["OrjsonCodec"]
