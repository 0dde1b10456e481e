"""Usage extraction from responses and SSE streams, and the reverse model rewrite."""

from __future__ import annotations

import json
from typing import Any

import pytest

from domain.requesthandling.jsoncodec import StdlibJsonCodec
from domain.requesthandling.usage import (
    SseUsageScanner,
    Usage,
    rewrite_model_back,
    usage_from_body,
    usage_from_payload,
)

CODEC = StdlibJsonCodec()


# --- usage_from_payload ---------------------------------------------------------------------


@pytest.mark.parametrize("obj", ["chat.completion", "chat.completion.chunk", "text_completion"])
def test_chat_and_text_objects_use_prompt_completion_names(obj: str) -> None:
    payload = {
        "object": obj,
        "usage": {
            "prompt_tokens": 10,
            "completion_tokens": 5,
            "total_tokens": 15,
            "input_tokens": 99,
            "output_tokens": 99,
            "prompt_tokens_details": {"cached_tokens": 4},
        },
    }
    assert usage_from_payload(payload) == Usage(
        prompt_tokens=10, completion_tokens=5, total_tokens=15, cached_tokens=4
    )


def test_chat_object_ignores_input_output_names() -> None:
    payload = {"object": "chat.completion", "usage": {"input_tokens": 3, "output_tokens": 2}}
    assert usage_from_payload(payload) == Usage()


@pytest.mark.parametrize("obj", ["response", "response.compaction", "conversation"])
def test_response_and_conversation_objects_use_input_output_names(obj: str) -> None:
    payload = {
        "object": obj,
        "usage": {
            "input_tokens": 7,
            "output_tokens": 3,
            "total_tokens": 10,
            "prompt_tokens": 99,
            "completion_tokens": 99,
            "input_tokens_details": {"cached_tokens": 2},
        },
    }
    assert usage_from_payload(payload) == Usage(
        prompt_tokens=7, completion_tokens=3, total_tokens=10, cached_tokens=2
    )


@pytest.mark.parametrize(
    ("usage", "expected"),
    [
        (
            {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5},
            Usage(prompt_tokens=4, completion_tokens=1, total_tokens=5),
        ),
        (
            {"input_tokens": 4, "output_tokens": 1, "total_tokens": 5},
            Usage(prompt_tokens=4, completion_tokens=1, total_tokens=5),
        ),
        ({"prompt_tokens": 8, "total_tokens": 8}, Usage(prompt_tokens=8, total_tokens=8)),
    ],
)
def test_other_objects_accept_either_naming(usage: dict[str, Any], expected: Usage) -> None:
    assert usage_from_payload({"object": "list", "usage": usage}) == expected
    assert usage_from_payload({"usage": usage}) == expected


def test_embeddings_list_usage() -> None:
    payload = {
        "object": "list",
        "data": [{"object": "embedding", "embedding": [0.1], "index": 0}],
        "usage": {"prompt_tokens": 6, "total_tokens": 6},
    }
    assert usage_from_payload(payload) == Usage(prompt_tokens=6, total_tokens=6)


@pytest.mark.parametrize(
    "details_key", ["prompt_tokens_details", "prompt_token_details", "input_tokens_details"]
)
def test_cached_tokens_detail_spellings(details_key: str) -> None:
    payload = {"usage": {"prompt_tokens": 9, details_key: {"cached_tokens": 8}}}
    usage = usage_from_payload(payload)
    assert usage is not None
    assert usage.cached_tokens == 8


def test_total_defaults_to_sum_when_absent() -> None:
    payload = {"object": "text_completion", "usage": {"prompt_tokens": 2, "completion_tokens": 3}}
    assert usage_from_payload(payload) == Usage(
        prompt_tokens=2, completion_tokens=3, total_tokens=5
    )


def test_response_completed_event_reads_nested_usage() -> None:
    event = {
        "type": "response.completed",
        "sequence_number": 12,
        "response": {
            "id": "resp_1",
            "object": "response",
            "status": "completed",
            "usage": {
                "input_tokens": 11,
                "output_tokens": 22,
                "total_tokens": 33,
                "input_tokens_details": {"cached_tokens": 5},
            },
        },
    }
    assert usage_from_payload(event) == Usage(
        prompt_tokens=11, completion_tokens=22, total_tokens=33, cached_tokens=5
    )


@pytest.mark.parametrize(
    "payload",
    [
        None,
        [],
        "usage",
        1,
        {},
        {"object": "chat.completion"},
        {"object": "chat.completion", "usage": None},
        {"object": "chat.completion", "usage": [1, 2]},
        {"object": "chat.completion", "usage": "10"},
        {"type": "response.created", "response": {"object": "response", "usage": None}},
        {"type": "response.completed", "response": {"object": "response"}},
        {"type": "response.output_text.delta", "delta": "hi"},
    ],
)
def test_no_usage_gives_none(payload: Any) -> None:
    assert usage_from_payload(payload) is None


def test_odd_field_types_are_ignored() -> None:
    payload = {
        "object": {"not": "a string"},
        "usage": {
            "prompt_tokens": "10",
            "completion_tokens": True,
            "total_tokens": [3],
            "prompt_tokens_details": {"cached_tokens": None},
            "prompt_token_details": "x",
            "input_tokens_details": {"cached_tokens": 1.5},
        },
    }
    assert usage_from_payload(payload) == Usage()


def test_integral_floats_are_counts_negative_are_not() -> None:
    payload = {"usage": {"prompt_tokens": 3.0, "completion_tokens": -1, "total_tokens": 3}}
    assert usage_from_payload(payload) == Usage(prompt_tokens=3, total_tokens=3)


def test_wrong_cached_spelling_falls_through_to_next() -> None:
    payload = {
        "usage": {
            "prompt_tokens": 5,
            "prompt_tokens_details": {"cached_tokens": "many"},
            "prompt_token_details": {"cached_tokens": 3},
        }
    }
    usage = usage_from_payload(payload)
    assert usage is not None
    assert usage.cached_tokens == 3


# --- usage_from_body ------------------------------------------------------------------------


def test_usage_from_body_chat_completion() -> None:
    body = json.dumps(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}],
            "usage": {"prompt_tokens": 12, "completion_tokens": 2, "total_tokens": 14},
        }
    ).encode()
    assert usage_from_body(body, CODEC) == Usage(
        prompt_tokens=12, completion_tokens=2, total_tokens=14
    )


@pytest.mark.parametrize("body", [b"", b"{", b"\xff", b"data: {}", b"[]", b'{"object":"x"}'])
def test_usage_from_body_invalid_or_missing(body: bytes) -> None:
    assert usage_from_body(body, CODEC) is None


# --- SseUsageScanner ------------------------------------------------------------------------


def _chunk_event(content: str, *, finish: str | None = None) -> dict[str, Any]:
    return {
        "id": "chatcmpl-abc",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": "lora-7",
        "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": finish}],
    }


FINAL_USAGE = Usage(prompt_tokens=17, completion_tokens=3, total_tokens=20, cached_tokens=16)


def _chat_stream() -> bytes:
    events: list[dict[str, Any]] = [
        {**_chunk_event(""), "choices": [{"index": 0, "delta": {"role": "assistant"}}]},
        _chunk_event("Hello"),
        _chunk_event(' wörld, "usage" is a word'),
        _chunk_event("!", finish="stop"),
        {
            "id": "chatcmpl-abc",
            "object": "chat.completion.chunk",
            "created": 1700000000,
            "model": "lora-7",
            "choices": [],
            "usage": {
                "prompt_tokens": 17,
                "completion_tokens": 3,
                "total_tokens": 20,
                "prompt_tokens_details": {"cached_tokens": 16},
            },
        },
    ]
    lines = [b"data: " + json.dumps(e, ensure_ascii=False).encode() + b"\n\n" for e in events]
    return b"".join(lines) + b"data: [DONE]\n\n"


def _scan(chunks: list[bytes]) -> Usage | None:
    scanner = SseUsageScanner(CODEC)
    for chunk in chunks:
        scanner.feed(chunk)
    return scanner.usage


def test_sse_whole_stream_in_one_chunk() -> None:
    assert _scan([_chat_stream()]) == FINAL_USAGE


def test_sse_split_in_two_at_every_byte_offset() -> None:
    stream = _chat_stream()
    for offset in range(len(stream) + 1):
        assert _scan([stream[:offset], stream[offset:]]) == FINAL_USAGE, offset


def test_sse_fed_one_byte_at_a_time() -> None:
    stream = _chat_stream()
    assert _scan([stream[i : i + 1] for i in range(len(stream))]) == FINAL_USAGE


@pytest.mark.parametrize("size", [2, 3, 7, 64, 100])
def test_sse_fixed_size_chunks(size: int) -> None:
    stream = _chat_stream()
    assert _scan([stream[i : i + size] for i in range(0, len(stream), size)]) == FINAL_USAGE


def test_sse_crlf_line_endings_split_everywhere() -> None:
    stream = _chat_stream().replace(b"\n", b"\r\n")
    for offset in range(len(stream) + 1):
        assert _scan([stream[:offset], stream[offset:]]) == FINAL_USAGE, offset


def test_sse_data_without_space_after_colon() -> None:
    stream = _chat_stream().replace(b"data: ", b"data:")
    assert _scan([stream]) == FINAL_USAGE


def test_sse_without_usage_gives_none() -> None:
    stream = b"".join(
        b"data: " + json.dumps(_chunk_event(t)).encode() + b"\n\n" for t in ["a", "b"]
    )
    assert _scan([stream, b"data: [DONE]\n\n"]) is None


def test_sse_null_usage_chunks_are_skipped() -> None:
    with_null = {**_chunk_event("a"), "usage": None}
    final = {"object": "chat.completion.chunk", "choices": [], "usage": {"prompt_tokens": 1}}
    stream = (
        b"data: " + json.dumps(with_null).encode() + b"\n\n"
        b"data: " + json.dumps(final).encode() + b"\n\n"
        b"data: [DONE]\n\n"
    )
    assert _scan([stream]) == Usage(prompt_tokens=1, total_tokens=1)


def test_sse_one_event_per_chunk_with_null_usage_in_each() -> None:
    """As a stream arrives from a model server: one event per chunk, every event but the
    last with ``"usage": null`` (spaced or not), the last one split after a line end."""
    events = [{**_chunk_event(t), "usage": None} for t in ["a", "b", "c"]]
    chunks = [b"data: " + json.dumps(e).encode() + b"\n\n" for e in events]
    chunks[1] = chunks[1].replace(b'"usage": null', b'"usage" :null')
    final = b"data: " + json.dumps({**_chunk_event(""), "usage": {"prompt_tokens": 2}}).encode()
    chunks += [b"\n", final[:9], final[9:] + b"\n\n", b"data: [DONE]\n\n"]
    assert _scan(chunks) == Usage(prompt_tokens=2, total_tokens=2)


def test_sse_first_usage_wins() -> None:
    first = {"object": "text_completion", "usage": {"prompt_tokens": 1, "completion_tokens": 1}}
    second = {"object": "text_completion", "usage": {"prompt_tokens": 9, "completion_tokens": 9}}
    stream = (
        b"data: " + json.dumps(first).encode() + b"\n\n"
        b"data: " + json.dumps(second).encode() + b"\n\n"
    )
    assert _scan([stream]) == Usage(prompt_tokens=1, completion_tokens=1, total_tokens=2)


def test_sse_stops_parsing_after_usage_found() -> None:
    class CountingCodec(StdlibJsonCodec):
        calls = 0

        def loads(self, data: bytes) -> Any:
            CountingCodec.calls += 1
            return super().loads(data)

    codec = CountingCodec()
    scanner = SseUsageScanner(codec)
    scanner.feed(b'data: {"usage":{"prompt_tokens":2}}\n\n')
    calls = CountingCodec.calls
    scanner.feed(b'data: {"usage":{"prompt_tokens":5}}\n\n')
    assert CountingCodec.calls == calls
    assert scanner.usage == Usage(prompt_tokens=2, total_tokens=2)


def test_sse_responses_api_completed_event() -> None:
    created = {"type": "response.created", "response": {"object": "response", "usage": None}}
    delta = {"type": "response.output_text.delta", "delta": "Hi"}
    completed = {
        "type": "response.completed",
        "response": {
            "object": "response",
            "output": [{"type": "message", "content": [{"type": "output_text", "text": "Hi"}]}],
            "usage": {"input_tokens": 5, "output_tokens": 1, "total_tokens": 6},
        },
    }
    stream = b""
    for name, event in [
        ("response.created", created),
        ("response.output_text.delta", delta),
        ("response.completed", completed),
    ]:
        stream += f"event: {name}\n".encode() + b"data: " + json.dumps(event).encode() + b"\n\n"
    expected = Usage(prompt_tokens=5, completion_tokens=1, total_tokens=6)
    for offset in range(len(stream) + 1):
        assert _scan([stream[:offset], stream[offset:]]) == expected, offset


def test_sse_ignores_non_data_lines_and_bad_json() -> None:
    stream = (
        b': keep-alive comment with "usage"\n'
        b'event: {"usage":{"prompt_tokens":50}}\n'
        b'id: {"usage":{"prompt_tokens":51}}\n'
        b'xdata: {"usage":{"prompt_tokens":52}}\n'
        b'data: {"usage": broken\n'
        b'data: {"usage":{"prompt_tokens":4}}\n'
    )
    assert _scan([stream]) == Usage(prompt_tokens=4, total_tokens=4)


def test_sse_flush_scans_unterminated_last_line() -> None:
    scanner = SseUsageScanner(CODEC)
    scanner.feed(b'data: {"usage":{"prompt_tokens":3}}')
    assert scanner.usage is None
    scanner.flush()
    assert scanner.usage == Usage(prompt_tokens=3, total_tokens=3)


def test_sse_buffer_stays_bounded_for_unneeded_lines() -> None:
    scanner = SseUsageScanner(CODEC, max_line_bytes=64)
    scanner.feed(b": " + b"x" * 10_000)
    assert len(scanner._buf) == 0
    scanner.feed(b"y" * 10_000 + b"\n")
    scanner.feed(b"data: " + b"z" * 200)
    assert len(scanner._buf) <= 64
    scanner.feed(b"z" * 10_000 + b"\n")
    scanner.feed(b'data: {"usage":{"prompt_tokens":7}}\n')
    assert scanner.usage == Usage(prompt_tokens=7, total_tokens=7)
    assert len(scanner._buf) == 0


def test_sse_overlong_data_line_is_dropped() -> None:
    scanner = SseUsageScanner(CODEC, max_line_bytes=32)
    scanner.feed(b'data: {"usage":{"prompt_tokens":')
    scanner.feed(b'1}, "pad": "' + b"p" * 100 + b'"}\n')
    assert scanner.usage is None


def test_sse_empty_chunks_are_harmless() -> None:
    stream = _chat_stream()
    assert _scan([b"", stream[:50], b"", stream[50:], b""]) == FINAL_USAGE


# --- rewrite_model_back ---------------------------------------------------------------------


def test_rewrite_back_noop_returns_same_object() -> None:
    chunk = b'{"model":"m","x":1}'
    assert rewrite_model_back(chunk, "m", "m", CODEC) is chunk


def test_rewrite_back_compact_form_all_occurrences() -> None:
    chunk = b'data: {"model":"lora-7","a":1}\n\ndata: {"model":"lora-7","a":2}\n\n'
    out = rewrite_model_back(chunk, "lora-7", "base", CODEC)
    assert out == b'data: {"model":"base","a":1}\n\ndata: {"model":"base","a":2}\n\n'


def test_rewrite_back_spaced_form() -> None:
    chunk = b'{"id": "x", "model": "lora-7", "object": "chat.completion"}'
    out = rewrite_model_back(chunk, "lora-7", "base", CODEC)
    assert out == b'{"id": "x", "model": "base", "object": "chat.completion"}'


def test_rewrite_back_spaced_form_only_when_compact_absent() -> None:
    chunk = b'{"model":"t"} {"model": "t"}'
    assert rewrite_model_back(chunk, "t", "i", CODEC) == b'{"model":"i"} {"model": "t"}'


def test_rewrite_back_does_not_touch_other_names_or_prefixes() -> None:
    chunk = b'{"model":"lora-70","content":"lora-7","model_name":"lora-7"}'
    assert rewrite_model_back(chunk, "lora-7", "base", CODEC) == chunk


def test_rewrite_back_absent_returns_chunk_unchanged() -> None:
    chunk = b'{"choices":[]}'
    assert rewrite_model_back(chunk, "a", "b", CODEC) == chunk


def test_rewrite_back_escapes_names_like_json() -> None:
    target = 'qu"ote/ünï'
    incoming = 'in\\coming "x"'
    chunk = json.dumps({"model": target}, ensure_ascii=False, separators=(",", ":")).encode()
    out = rewrite_model_back(chunk, target, incoming, CODEC)
    assert json.loads(out) == {"model": incoming}
