"""Reading token usage from model-server responses, and the reverse model rewrite.

Non-streaming responses carry a ``usage`` object in the body. Streaming
responses (server-sent events) carry it in one of the ``data:`` events, usually
the last one before ``[DONE]``; ``SseUsageScanner`` finds it while the stream
passes through, holding at most one incomplete line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ports.codec import JsonCodec, JsonDecodeError

__all__ = [
    "SseUsageScanner",
    "Usage",
    "rewrite_model_back",
    "usage_from_body",
    "usage_from_payload",
]

_CHAT_OR_TEXT_OBJECTS = frozenset({"chat.completion", "chat.completion.chunk", "text_completion"})
_CACHED_DETAILS_KEYS = ("prompt_tokens_details", "prompt_token_details", "input_tokens_details")


@dataclass(frozen=True, slots=True, kw_only=True)
class Usage:
    """Token counts reported by the model server."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    cached_tokens: int = 0


def _count(value: Any) -> int | None:
    """A non-negative integer token count, or None for anything else."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value >= 0 else None
    if isinstance(value, float) and value.is_integer() and value >= 0:
        return int(value)
    return None


def _first_count(usage: dict[Any, Any], *keys: str) -> int | None:
    for key in keys:
        count = _count(usage.get(key))
        if count is not None:
            return count
    return None


def usage_from_payload(payload: Any) -> Usage | None:
    """Token usage from a decoded response object, or None when it has none.

    The field names depend on ``object``: Responses and Conversations objects
    use ``input_tokens``/``output_tokens``; chat and text completions use
    ``prompt_tokens``/``completion_tokens``; any other object may use either.
    A Responses API ``response.completed`` event carries the usage under
    ``response.usage``. Fields of the wrong type are ignored; a missing
    ``total_tokens`` is the sum of the prompt and completion counts.

    Anthropic usage (an object with ``cache_read_input_tokens`` or
    ``cache_creation_input_tokens``, or a ``message``/``message_start``/
    ``message_delta`` payload): the prompt is ``input_tokens`` plus both cache counts
    (``input_tokens`` excludes them), and the cached tokens are
    ``cache_read_input_tokens``; ``message_start`` carries its usage under ``message``.
    """
    if not isinstance(payload, dict):
        return None
    source: dict[Any, Any] = payload
    kind = payload.get("type")
    if kind == "response.completed":
        response = payload.get("response")
        if isinstance(response, dict):
            source = response
    elif kind == "message_start":
        message = payload.get("message")
        if isinstance(message, dict):
            source = message
    usage = source.get("usage")
    if not isinstance(usage, dict):
        return None
    if kind in _ANTHROPIC_TYPES or any(key in usage for key in _ANTHROPIC_CACHE_KEYS):
        return _anthropic_usage(usage)

    obj = source.get("object")
    obj = obj if isinstance(obj, str) else ""
    if obj.startswith(("response", "conversation")):
        prompt = _first_count(usage, "input_tokens")
        completion = _first_count(usage, "output_tokens")
    elif obj in _CHAT_OR_TEXT_OBJECTS:
        prompt = _first_count(usage, "prompt_tokens")
        completion = _first_count(usage, "completion_tokens")
    else:
        prompt = _first_count(usage, "prompt_tokens", "input_tokens")
        completion = _first_count(usage, "completion_tokens", "output_tokens")
    prompt = prompt or 0
    completion = completion or 0

    total = _count(usage.get("total_tokens"))
    if total is None:
        total = prompt + completion

    cached = 0
    for key in _CACHED_DETAILS_KEYS:
        details = usage.get(key)
        if isinstance(details, dict):
            count = _count(details.get("cached_tokens"))
            if count is not None:
                cached = count
                break

    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=total,
        cached_tokens=cached,
    )


_ANTHROPIC_TYPES = frozenset({"message", "message_start", "message_delta"})
_ANTHROPIC_CACHE_KEYS = ("cache_read_input_tokens", "cache_creation_input_tokens")


def _anthropic_usage(usage: dict[Any, Any]) -> Usage:
    cached = _count(usage.get("cache_read_input_tokens")) or 0
    created = _count(usage.get("cache_creation_input_tokens")) or 0
    prompt = (_count(usage.get("input_tokens")) or 0) + cached + created
    completion = _count(usage.get("output_tokens")) or 0
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        cached_tokens=cached,
    )


def usage_from_body(body: bytes, codec: JsonCodec) -> Usage | None:
    """Token usage from a complete (non-streaming) response body; None if absent or invalid."""
    try:
        payload = codec.loads(body)
    except JsonDecodeError:
        return None
    return usage_from_payload(payload)


_DATA = b"data:"
_DONE = b"[DONE]"
_USAGE_KEY = b'"usage"'
#: A ``"usage"`` key whose value is not ``null`` (OpenAI sends ``"usage":null`` in every
#: chunk of a stream that asked for usage).
_USAGE_VALUE = re.compile(rb'"usage"\s*+:\s*+(?!null)')
_LINE_ENDS = frozenset(b"\r\n")
DEFAULT_MAX_LINE_BYTES = 8 * 1024 * 1024


class SseUsageScanner:
    """Finds token usage in a server-sent-event stream fed chunk by chunk.

    Chunks may split lines at any byte. Only an incomplete ``data:`` line is
    buffered; other lines are dropped as they arrive, and a ``data:`` line
    longer than ``max_line_bytes`` is dropped too. The first event whose JSON
    carries usage wins; after that the scanner ignores further input. Anthropic streams
    report the prompt in ``message_start`` and the output in ``message_delta``: the
    first is kept aside and the second completes it (the first alone is the usage when
    the stream ends before a delta).
    """

    __slots__ = ("_buf", "_codec", "_max_line_bytes", "_skipping", "_started", "_usage")

    def __init__(self, codec: JsonCodec, *, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> None:
        self._codec = codec
        self._max_line_bytes = max_line_bytes
        self._buf = bytearray()
        self._skipping = False  # the current incomplete line is not needed
        self._usage: Usage | None = None
        self._started: Usage | None = None  # an Anthropic message_start's usage

    @property
    def usage(self) -> Usage | None:
        return self._usage if self._usage is not None else self._started

    def feed(self, chunk: bytes) -> None:
        if self._usage is not None or not chunk:
            return
        if (
            not self._buf
            and not self._skipping
            and chunk[-1] in _LINE_ENDS
            and _USAGE_VALUE.search(chunk) is None
        ):
            # Whole lines, none with a usage other than null: nothing to keep or read.
            # Most SSE chunks of a stream end here (the usage is in the last one).
            return
        # SSE lines end in LF, CR or CRLF; empty lines carry nothing we need, so
        # treating CR and LF alike is safe even when CRLF is split across chunks.
        lines = chunk.replace(b"\r", b"\n").split(b"\n")
        tail = lines.pop()
        for index, line in enumerate(lines):
            if index == 0:
                line = self._complete_line(line)
            self._scan_line(line)
            if self._usage is not None:
                self._buf.clear()
                return
        self._append_partial(tail)

    def flush(self) -> None:
        """Scan a final line that was not terminated (call at end of stream)."""
        if self._usage is None and not self._skipping and self._buf:
            self._scan_line(bytes(self._buf))
        self._buf.clear()
        self._skipping = False

    def _complete_line(self, fragment: bytes) -> bytes:
        """Join the buffered start of a line with the fragment that ends it."""
        if self._skipping:
            line = b""
        elif self._buf:
            self._buf += fragment
            line = bytes(self._buf)
        else:
            line = fragment
        self._buf.clear()
        self._skipping = False
        return line

    def _append_partial(self, fragment: bytes) -> None:
        if self._skipping or not fragment:
            return
        self._buf += fragment
        head = bytes(self._buf[: len(_DATA)])
        if not _DATA.startswith(head) or len(self._buf) > self._max_line_bytes:
            self._buf.clear()
            self._skipping = True

    def _scan_line(self, line: bytes) -> None:
        if len(line) > self._max_line_bytes or not line.startswith(_DATA) or _USAGE_KEY not in line:
            return
        data = line[len(_DATA) :]
        if data.startswith(b" "):
            data = data[1:]
        if data.strip() == _DONE:
            return
        try:
            payload = self._codec.loads(data)
        except JsonDecodeError:
            return
        usage = usage_from_payload(payload)
        if usage is None or not isinstance(payload, dict):
            return
        kind = payload.get("type")
        if kind == "message_start":
            self._started = usage
            return
        started = self._started
        if kind == "message_delta" and started is not None:
            prompt = usage.prompt_tokens or started.prompt_tokens
            completion = usage.completion_tokens
            usage = Usage(
                prompt_tokens=prompt,
                completion_tokens=completion,
                total_tokens=prompt + completion,
                cached_tokens=usage.cached_tokens or started.cached_tokens,
            )
        self._usage = usage


def rewrite_model_back(chunk: bytes, target: str, incoming: str, codec: JsonCodec) -> bytes:
    """Replace the target model name by the incoming one in a response chunk.

    Rewrites ``"model":"<target>"``; only when that form is absent, rewrites
    ``"model": "<target>"``. Names are JSON-encoded with the codec, so escaping
    matches what a JSON encoder writes. Returns ``chunk`` itself when the names
    are equal.
    """
    if target == incoming:
        return chunk
    old_name = codec.dumps(target)
    new_name = codec.dumps(incoming)
    compact = b'"model":' + old_name
    if compact in chunk:
        return chunk.replace(compact, b'"model":' + new_name)
    spaced = b'"model": ' + old_name
    if spaced in chunk:
        return chunk.replace(spaced, b'"model": ' + new_name)
    return chunk
