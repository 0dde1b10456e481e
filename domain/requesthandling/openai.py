"""Parsing and validating OpenAI-style request bodies.

The API is chosen from the request path; the body is decoded through the
``JsonCodec`` port, validated per API, and kept whole as the payload so that it
can be re-encoded later (for instance after rewriting the model name).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from domain.errors import BadRequestError
from ports.codec import JsonCodec, JsonDecodeError

__all__ = [
    "ApiKind",
    "OpenAIParser",
    "ParsedRequest",
    "detect_api",
    "rewrite_model",
]

_DEFAULT_PATH = "/v1/completions"
_PATH_HEADERS = (":path", "x-original-path", "x-forwarded-path")

MODEL_NOT_FOUND = "model not found in request body"


class ApiKind(enum.StrEnum):
    """The OpenAI-compatible API a request targets."""

    COMPLETIONS = "completions"
    CHAT_COMPLETIONS = "chat_completions"
    RESPONSES = "responses"
    CONVERSATIONS = "conversations"
    EMBEDDINGS = "embeddings"
    #: The Anthropic Messages API (``anthropic-parser``).
    MESSAGES = "messages"


# Checked in order: ``/chat/completions`` must win over ``/completions``.
_SUFFIXES: tuple[tuple[str, ApiKind], ...] = (
    ("/conversations", ApiKind.CONVERSATIONS),
    ("/responses", ApiKind.RESPONSES),
    ("/chat/completions", ApiKind.CHAT_COMPLETIONS),
    ("/completions", ApiKind.COMPLETIONS),
    ("/embeddings", ApiKind.EMBEDDINGS),
)


def detect_api(headers: Mapping[str, str]) -> ApiKind:
    """Pick the API from the request path suffix.

    The path is taken from ``:path``, else ``x-original-path``, else
    ``x-forwarded-path`` (header names lower-case); without any of them it is
    ``/v1/completions``. A query string is ignored. Unknown paths are treated as
    completions.
    """
    path = _DEFAULT_PATH
    for name in _PATH_HEADERS:
        value = headers.get(name)
        if value:
            path = value
            break
    path = path.split("?", 1)[0]
    for suffix, kind in _SUFFIXES:
        if path.endswith(suffix):
            return kind
    return ApiKind.COMPLETIONS


@dataclass(frozen=True, slots=True, kw_only=True)
class ParsedRequest:
    """A validated OpenAI-style request.

    ``payload`` is the whole decoded body object; fields the EPP does not
    interpret (``tools``, ``documents``, ``chat_template``, ...) stay in it.
    """

    api: ApiKind
    model: str
    payload: dict[str, Any]
    stream: bool
    cache_salt: str = ""
    include_usage: bool = False
    #: The body was not interpreted (``passthrough-parser``): ``payload`` is empty,
    #: ``raw`` holds the bytes, and there is no model rewrite.
    opaque: bool = False
    raw: bytes = b""

    def prefix_input(self, codec: JsonCodec, limit: int | None = None) -> bytes:
        """The user-input bytes that prefix-cache hashing works on.

        - chat completions: JSON of ``messages``;
        - completions: the prompt text (a list of strings joined with single
          spaces), or JSON of the token-id array(s);
        - responses: JSON of a list of ``{"instructions": ...}``,
          ``{"tools": ...}`` and ``{"input": ...}`` objects, absent parts skipped;
        - conversations: JSON of ``items``;
        - embeddings: JSON of ``input``;
        - messages (Anthropic): JSON of a list of ``{"system": ...}``, ``{"tools": ...}``
          and ``{"messages": ...}`` objects, absent parts skipped.

        JSON is encoded with sorted keys, so the client's key order does not
        change the bytes. With ``limit``, a text prompt is cut to at most ``limit``
        characters before encoding (enough for ``limit`` bytes of blocks: hashing never
        looks further), so a long prompt is not encoded whole.
        """
        if self.opaque:
            return self.raw
        payload = self.payload
        match self.api:
            case ApiKind.CHAT_COMPLETIONS:
                return codec.dumps(payload.get("messages"), sort_keys=True)
            case ApiKind.COMPLETIONS:
                prompt = payload.get("prompt")
                if isinstance(prompt, str):
                    return (prompt[:limit] if limit is not None else prompt).encode()
                if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
                    text = " ".join(prompt)
                    return (text[:limit] if limit is not None else text).encode()
                return codec.dumps(prompt, sort_keys=True)
            case ApiKind.RESPONSES:
                parts = [
                    {key: payload[key]}
                    for key in ("instructions", "tools", "input")
                    if payload.get(key) is not None
                ]
                return codec.dumps(parts, sort_keys=True)
            case ApiKind.CONVERSATIONS:
                return codec.dumps(payload.get("items"), sort_keys=True)
            case ApiKind.EMBEDDINGS:
                return codec.dumps(payload.get("input"), sort_keys=True)
            case ApiKind.MESSAGES:
                parts = [
                    {key: payload[key]}
                    for key in ("system", "tools", "messages")
                    if payload.get(key) is not None
                ]
                return codec.dumps(parts, sort_keys=True)


class OpenAIParser:
    """Decodes and validates OpenAI-style request bodies.

    Every validation failure raises ``BadRequestError``.
    """

    def __init__(self, codec: JsonCodec) -> None:
        self._codec = codec

    def parse(self, body: bytes, headers: Mapping[str, str]) -> ParsedRequest:
        api = detect_api(headers)
        try:
            decoded = self._codec.loads(body)
        except JsonDecodeError as exc:
            raise BadRequestError(_decode_failure(body, exc)) from exc
        if not isinstance(decoded, dict):
            raise BadRequestError("request body must be a JSON object")
        payload: dict[str, Any] = decoded

        model = payload.get("model")
        if not isinstance(model, str) or not model:
            raise BadRequestError(MODEL_NOT_FOUND)

        match api:
            case ApiKind.COMPLETIONS:
                _validate_prompt(payload.get("prompt"))
            case ApiKind.CHAT_COMPLETIONS:
                _validate_messages(payload.get("messages"))
                _validate_chat_fields(payload)
            case ApiKind.RESPONSES:
                if payload.get("input") is None:
                    raise BadRequestError("input is required for the responses API")
            case ApiKind.CONVERSATIONS:
                if payload.get("items") is None:
                    raise BadRequestError("items is required for the conversations API")
            case ApiKind.EMBEDDINGS:
                if _is_empty(payload.get("input")):
                    raise BadRequestError("input is required for the embeddings API")

        cache_salt = payload.get("cache_salt")
        if cache_salt is None:
            cache_salt = ""
        elif not isinstance(cache_salt, str):
            raise BadRequestError("cache_salt must be a string")

        stream_options = payload.get("stream_options")
        include_usage = (
            isinstance(stream_options, dict) and stream_options.get("include_usage") is True
        )

        return ParsedRequest(
            api=api,
            model=model,
            payload=payload,
            stream=_is_true(payload.get("stream")),
            cache_salt=cache_salt,
            include_usage=include_usage,
        )


def rewrite_model(parsed: ParsedRequest, target: str, codec: JsonCodec) -> bytes:
    """The request body with ``model`` set to ``target``, encoded with sorted keys."""
    body = dict(parsed.payload)
    body["model"] = target
    return codec.dumps(body, sort_keys=True)


def _is_true(value: Any) -> bool:
    if value is True:
        return True
    return isinstance(value, str) and value.lower() == "true"


def _is_empty(value: Any) -> bool:
    return value is None or (isinstance(value, str | list | dict) and len(value) == 0)


def _is_token_id(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return True
    return isinstance(value, float) and value.is_integer()


_PROMPT_SHAPE = (
    "prompt must be a non-empty string, a list of strings, "
    "a list of token ids or a list of token-id lists"
)


def _validate_prompt(prompt: Any) -> None:
    if prompt is None:
        raise BadRequestError("prompt is required for the completions API")
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequestError("prompt must not be empty")
        return
    if not isinstance(prompt, list):
        raise BadRequestError(_PROMPT_SHAPE)
    if not prompt:
        raise BadRequestError("prompt must not be empty")
    if all(isinstance(item, str) for item in prompt):
        return
    if all(_is_token_id(item) for item in prompt):
        return
    if all(
        isinstance(item, list) and item and all(_is_token_id(t) for t in item) for item in prompt
    ):
        return
    raise BadRequestError(_PROMPT_SHAPE)


def _decode_failure(body: bytes, exc: JsonDecodeError) -> str:
    """The 400 text of a body the codec could not decode, naming the real cause: JSON is
    UTF-8, so bytes that are not UTF-8 are reported as such (with the first bad byte)."""
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as bad:
        byte = body[bad.start]
        return (
            f"request body is not valid JSON: it is not UTF-8 "
            f"(byte 0x{byte:02x} at offset {bad.start})"
        )
    return f"request body is not valid JSON: {exc}"


#: Chat fields the reference decodes into typed fields (a wrong type is a 400 there);
#: ``null`` means absent.
_CHAT_FIELD_TYPES: tuple[tuple[str, type, str], ...] = (
    ("chat_template_kwargs", dict, "an object"),
    ("chat_template", str, "a string"),
    ("tools", list, "a list"),
    ("documents", list, "a list"),
    ("add_generation_prompt", bool, "a boolean"),
    ("continue_final_message", bool, "a boolean"),
    ("return_assistant_tokens_mask", bool, "a boolean"),
)


def _validate_chat_fields(payload: dict[str, Any]) -> None:
    for name, kind, what in _CHAT_FIELD_TYPES:
        value = payload.get(name)
        if value is not None and not isinstance(value, kind):
            raise BadRequestError(f"{name} must be {what}")


def _validate_messages(messages: Any) -> None:
    if messages is None:
        raise BadRequestError("messages is required for the chat completions API")
    if not isinstance(messages, list):
        raise BadRequestError("messages must be a list")
    if not messages:
        raise BadRequestError("messages must have at least one entry")
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadRequestError(f"messages[{index}] must be an object")
        if not isinstance(message.get("role"), str):
            raise BadRequestError(f"messages[{index}].role must be a string")
        content = message.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise BadRequestError(
                f"messages[{index}].content must be a string, null or a list of content blocks"
            )
        for block_index, block in enumerate(content):
            if not isinstance(block, dict) or not isinstance(block.get("type"), str):
                raise BadRequestError(
                    f"messages[{index}].content[{block_index}] must be an object with a string type"
                )
