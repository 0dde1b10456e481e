"""OpenAI-compatible request parsing and response bodies, shaped like vLLM's."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from enum import Enum
from typing import Any

from tests.simulator.tokens import ChatInput, PromptTokens


class ApiError(Exception):
    """A request the server rejects; rendered as a vLLM-style JSON error body."""

    def __init__(self, message: str, status: int = 400, error_type: str = "BadRequestError"):
        super().__init__(message)
        self.message = message
        self.status = status
        self.error_type = error_type

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": None,
                "code": self.status,
            }
        }


class Endpoint(Enum):
    COMPLETIONS = "completions"
    CHAT = "chat"

    @property
    def response_object(self) -> str:
        return "text_completion" if self is Endpoint.COMPLETIONS else "chat.completion"

    @property
    def chunk_object(self) -> str:
        return "text_completion" if self is Endpoint.COMPLETIONS else "chat.completion.chunk"

    @property
    def id_prefix(self) -> str:
        return "cmpl" if self is Endpoint.COMPLETIONS else "chatcmpl"


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """The parts of a completions or chat request the simulator acts on."""

    endpoint: Endpoint
    model: str
    prompt: PromptTokens
    max_tokens: int
    stream: bool
    include_usage: bool

    @property
    def prompt_tokens(self) -> int:
        return self.prompt.num_tokens


def _decode_object(body: bytes) -> dict[str, Any]:
    try:
        payload = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ApiError(f"Invalid JSON in request body: {exc}") from exc
    if not isinstance(payload, dict):
        raise ApiError("Request body must be a JSON object")
    return payload


def _require_model(payload: dict[str, Any]) -> str:
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError("Field 'model' is required and must be a non-empty string")
    return model


def _positive_int(payload: dict[str, Any], key: str) -> int | None:
    value = payload.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ApiError(f"Field '{key}' must be a positive integer, got {value!r}")
    return value


def _bool(payload: dict[str, Any], key: str) -> bool:
    value = payload.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(f"Field '{key}' must be a boolean, got {value!r}")
    return value


def _include_usage(payload: dict[str, Any]) -> bool:
    options = payload.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise ApiError("Field 'stream_options' must be an object")
    return _bool(options, "include_usage")


def _is_token_ids(value: list[Any]) -> bool:
    return all(isinstance(item, int) and not isinstance(item, bool) for item in value)


def _completion_prompt(prompt: Any) -> PromptTokens:
    """The prompt's tokens (lists of prompts are concatenated)."""
    if isinstance(prompt, str):
        return PromptTokens.from_text(prompt)
    if isinstance(prompt, list) and prompt:
        if all(isinstance(item, str) for item in prompt):
            return PromptTokens.from_text("".join(prompt))
        if _is_token_ids(prompt):
            return PromptTokens.from_ids(tuple(prompt))
        if all(isinstance(item, list) and item and _is_token_ids(item) for item in prompt):
            return PromptTokens.from_ids(tuple(token for item in prompt for token in item))
    raise ApiError("Field 'prompt' must be a string, a list of strings or token ids")


def _message_text(message: Any) -> str:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ApiError("Each message must be an object with a string 'role'")
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part["text"]
            for part in content
            if isinstance(part, dict)
            and part.get("type") == "text"
            and isinstance(part.get("text"), str)
        )
    raise ApiError("Message 'content' must be a string or a list of content parts")


def _chat_prompt(payload: dict[str, Any]) -> PromptTokens:
    """The text of the messages, one per line (and the messages, for a chat template)."""
    messages = payload.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("Field 'messages' must be a non-empty list")
    text = "\n".join(_message_text(message) for message in messages)
    kwargs = payload.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise ApiError("Field 'chat_template_kwargs' must be an object")
    chat = ChatInput(
        messages=messages,
        add_generation_prompt=payload.get("add_generation_prompt", True) is not False,
        kwargs=kwargs,
    )
    return PromptTokens(text=text, chat=chat)


def parse_request(endpoint: Endpoint, body: bytes, default_max_tokens: int) -> GenerationRequest:
    """Validate a request body; raises :class:`ApiError` on anything unusable."""
    payload = _decode_object(body)
    model = _require_model(payload)
    if endpoint is Endpoint.COMPLETIONS:
        if "prompt" not in payload:
            raise ApiError("Field 'prompt' is required")
        prompt = _completion_prompt(payload["prompt"])
        max_tokens = _positive_int(payload, "max_tokens")
    else:
        prompt = _chat_prompt(payload)
        max_tokens = _positive_int(payload, "max_completion_tokens") or _positive_int(
            payload, "max_tokens"
        )
    return GenerationRequest(
        endpoint=endpoint,
        model=model,
        prompt=prompt,
        max_tokens=max_tokens or default_max_tokens,
        stream=_bool(payload, "stream"),
        include_usage=_include_usage(payload),
    )


def usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None
) -> dict[str, Any]:
    """The ``usage`` object; ``cached_tokens`` adds ``prompt_tokens_details``."""
    body: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        body["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return body


class ResponseBuilder:
    """Builds the bodies and stream chunks of one response (shared id and timestamp)."""

    def __init__(self, request: GenerationRequest, request_id: str) -> None:
        self._request = request
        self.response_id = f"{request.endpoint.id_prefix}-{request_id}"
        self._created = int(time.time())

    def _envelope(self, obj: str) -> dict[str, Any]:
        return {
            "id": self.response_id,
            "object": obj,
            "created": self._created,
            "model": self._request.model,
        }

    def _choice(self, text: str, finish_reason: str | None, *, delta: bool) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if self._request.endpoint is Endpoint.COMPLETIONS:
            choice["text"] = text
        elif delta:
            choice["delta"] = {"content": text}
        else:
            choice["message"] = {"role": "assistant", "content": text, "tool_calls": []}
        choice.update({"logprobs": None, "finish_reason": finish_reason, "stop_reason": None})
        return choice

    def full_response(
        self, text: str, completion_tokens: int, cached_tokens: int | None = None
    ) -> dict[str, Any]:
        body = self._envelope(self._request.endpoint.response_object)
        body["choices"] = [self._choice(text, "length", delta=False)]
        body["usage"] = usage(self._request.prompt_tokens, completion_tokens, cached_tokens)
        return body

    def role_chunk(self) -> dict[str, Any] | None:
        """The opening chat chunk announcing the assistant role (``None`` for completions)."""
        if self._request.endpoint is Endpoint.COMPLETIONS:
            return None
        chunk = self._envelope(self._request.endpoint.chunk_object)
        chunk["choices"] = [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ]
        return chunk

    def token_chunk(self, text: str, *, last: bool) -> dict[str, Any]:
        chunk = self._envelope(self._request.endpoint.chunk_object)
        chunk["choices"] = [self._choice(text, "length" if last else None, delta=True)]
        return chunk

    def usage_chunk(
        self, completion_tokens: int, cached_tokens: int | None = None
    ) -> dict[str, Any]:
        chunk = self._envelope(self._request.endpoint.chunk_object)
        chunk["choices"] = []
        chunk["usage"] = usage(self._request.prompt_tokens, completion_tokens, cached_tokens)
        return chunk


def encode_json(payload: Any) -> bytes:
    return json.dumps(payload, separators=(",", ":")).encode()


def sse_event(payload: Any) -> bytes:
    """One server-sent event carrying ``payload`` as JSON."""
    return b"data: " + encode_json(payload) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
