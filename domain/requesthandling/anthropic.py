"""Parsing and validating Anthropic Messages API request bodies (``/v1/messages`` and
``/v1/messages/count_tokens``).

The body must be a JSON object with a non-empty string ``model`` and a non-empty
``messages`` list of objects, each with a string ``role`` and a ``content`` that is a
string or a list of content blocks (objects with a string ``type``). ``system`` is absent,
a string or a list of blocks; ``tools`` absent or a list; ``stream`` a boolean when given.
Any failure raises ``BadRequestError``. The prefix input (what prefix-cache hashing works
on) is the JSON of the ``system``, ``tools`` and ``messages`` parts, in that order.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from domain.errors import BadRequestError
from domain.requesthandling.openai import MODEL_NOT_FOUND, ApiKind, ParsedRequest
from ports.codec import JsonCodec, JsonDecodeError

__all__ = ["MESSAGES_PATHS", "AnthropicParser"]

#: The path suffixes the Messages API is served on.
MESSAGES_PATHS = ("/v1/messages", "/v1/messages/count_tokens")


class AnthropicParser:
    """Decodes and validates Messages API bodies; every failure raises ``BadRequestError``."""

    def __init__(self, codec: JsonCodec) -> None:
        self._codec = codec

    def parse(self, body: bytes, headers: Mapping[str, str]) -> ParsedRequest:
        try:
            decoded = self._codec.loads(body)
        except JsonDecodeError as exc:
            raise BadRequestError(f"request body is not valid JSON: {exc}") from exc
        if not isinstance(decoded, dict):
            raise BadRequestError("request body must be a JSON object")
        payload: dict[str, Any] = decoded
        model = payload.get("model")
        if not isinstance(model, str) or not model:
            raise BadRequestError(MODEL_NOT_FOUND)
        _validate_messages(payload.get("messages"))
        system = payload.get("system")
        if system is not None and not isinstance(system, str):
            _validate_blocks(system, "system")
        tools = payload.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise BadRequestError("tools must be a list")
        stream = payload.get("stream")
        if stream is not None and not isinstance(stream, bool):
            raise BadRequestError("stream must be a boolean")
        return ParsedRequest(
            api=ApiKind.MESSAGES, model=model, payload=payload, stream=stream is True
        )


def _validate_blocks(content: Any, where: str) -> None:
    if not isinstance(content, list):
        raise BadRequestError(f"{where} must be a string or a list of content blocks")
    for index, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise BadRequestError(f"{where}[{index}] must be an object with a string type")


def _validate_messages(messages: Any) -> None:
    if messages is None:
        raise BadRequestError("messages is required for the messages API")
    if not isinstance(messages, list) or not messages:
        raise BadRequestError("messages must be a non-empty list")
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadRequestError(f"messages[{index}] must be an object")
        if not isinstance(message.get("role"), str):
            raise BadRequestError(f"messages[{index}].role must be a string")
        content = message.get("content")
        if not isinstance(content, str):
            _validate_blocks(content, f"messages[{index}].content")
