"""OpenAI request parsing: API detection, validation, prefix input and model rewrite."""

from __future__ import annotations

import json
from typing import Any

import pytest

from domain.errors import BadRequestError
from domain.requesthandling.jsoncodec import StdlibJsonCodec
from domain.requesthandling.openai import (
    ApiKind,
    OpenAIParser,
    ParsedRequest,
    detect_api,
    rewrite_model,
)
from ports.errors import ErrorCode

CODEC = StdlibJsonCodec()
PARSER = OpenAIParser(CODEC)

PATHS = {
    ApiKind.COMPLETIONS: "/v1/completions",
    ApiKind.CHAT_COMPLETIONS: "/v1/chat/completions",
    ApiKind.RESPONSES: "/v1/responses",
    ApiKind.CONVERSATIONS: "/v1/conversations",
    ApiKind.EMBEDDINGS: "/v1/embeddings",
}

MINIMAL: dict[ApiKind, dict[str, Any]] = {
    ApiKind.COMPLETIONS: {"model": "m", "prompt": "hello"},
    ApiKind.CHAT_COMPLETIONS: {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    ApiKind.RESPONSES: {"model": "m", "input": "hi"},
    ApiKind.CONVERSATIONS: {"model": "m", "items": []},
    ApiKind.EMBEDDINGS: {"model": "m", "input": "hi"},
}


def parse(api: ApiKind, body: dict[str, Any] | bytes) -> ParsedRequest:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return PARSER.parse(raw, {":path": PATHS[api]})


def parse_error(api: ApiKind, body: dict[str, Any] | bytes) -> BadRequestError:
    with pytest.raises(BadRequestError) as info:
        parse(api, body)
    assert info.value.code is ErrorCode.BAD_REQUEST
    return info.value


# --- API detection -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/v1/completions", ApiKind.COMPLETIONS),
        ("/v1/chat/completions", ApiKind.CHAT_COMPLETIONS),
        ("/v1/responses", ApiKind.RESPONSES),
        ("/v1/conversations", ApiKind.CONVERSATIONS),
        ("/v1/embeddings", ApiKind.EMBEDDINGS),
        ("/openai/v1/chat/completions", ApiKind.CHAT_COMPLETIONS),
        ("/v1/chat/completions?api-version=2024", ApiKind.CHAT_COMPLETIONS),
        ("/v1/embeddings?x=/v1/responses", ApiKind.EMBEDDINGS),
        ("/v1/responses?", ApiKind.RESPONSES),
        ("/v1/models", ApiKind.COMPLETIONS),
        ("/", ApiKind.COMPLETIONS),
        ("/v1/chat/completions/", ApiKind.COMPLETIONS),
    ],
)
def test_detect_api_by_path_suffix(path: str, expected: ApiKind) -> None:
    assert detect_api({":path": path}) is expected


def test_detect_api_defaults_to_completions_without_path() -> None:
    assert detect_api({}) is ApiKind.COMPLETIONS
    assert detect_api({"content-type": "application/json"}) is ApiKind.COMPLETIONS


def test_detect_api_falls_back_to_x_original_path() -> None:
    assert detect_api({"x-original-path": "/v1/embeddings"}) is ApiKind.EMBEDDINGS


def test_detect_api_falls_back_to_x_forwarded_path() -> None:
    assert detect_api({"x-forwarded-path": "/v1/responses?a=b"}) is ApiKind.RESPONSES


def test_detect_api_prefers_path_then_original_then_forwarded() -> None:
    headers = {
        ":path": "/v1/chat/completions",
        "x-original-path": "/v1/embeddings",
        "x-forwarded-path": "/v1/responses",
    }
    assert detect_api(headers) is ApiKind.CHAT_COMPLETIONS
    del headers[":path"]
    assert detect_api(headers) is ApiKind.EMBEDDINGS
    del headers["x-original-path"]
    assert detect_api(headers) is ApiKind.RESPONSES


def test_api_kind_values() -> None:
    assert [k.value for k in ApiKind] == [
        "completions",
        "chat_completions",
        "responses",
        "conversations",
        "embeddings",
        "messages",  # the Anthropic API, parsed by anthropic-parser
    ]


#: The APIs the OpenAI parser serves (``messages`` is anthropic-parser's).
OPENAI_APIS = [k for k in ApiKind if k is not ApiKind.MESSAGES]


# --- Body and model ------------------------------------------------------------------------


@pytest.mark.parametrize("api", OPENAI_APIS)
def test_minimal_valid_body_for_each_api(api: ApiKind) -> None:
    parsed = parse(api, MINIMAL[api])
    assert parsed.api is api
    assert parsed.model == "m"
    assert parsed.payload == MINIMAL[api]
    assert parsed.stream is False
    assert parsed.cache_salt == ""
    assert parsed.include_usage is False


@pytest.mark.parametrize("body", [b"", b"{", b"not json", b'{"model": "m",}', b"\xff\xfe"])
def test_invalid_json_is_rejected(body: bytes) -> None:
    assert "JSON" in parse_error(ApiKind.COMPLETIONS, body).message


@pytest.mark.parametrize("body", [b"[]", b'"text"', b"1", b"null", b'[{"model": "m"}]'])
def test_non_object_body_is_rejected(body: bytes) -> None:
    assert parse_error(ApiKind.COMPLETIONS, body).message == "request body must be a JSON object"


@pytest.mark.parametrize("api", OPENAI_APIS)
@pytest.mark.parametrize("model", ["<absent>", None, "", 1, ["m"], {"name": "m"}, True])
def test_missing_or_invalid_model_is_rejected(api: ApiKind, model: Any) -> None:
    body = dict(MINIMAL[api])
    if model == "<absent>":
        del body["model"]
    else:
        body["model"] = model
    assert parse_error(api, body).message == "model not found in request body"


def test_extra_fields_are_kept_in_payload() -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "documents": [{"title": "t", "text": "x"}],
        "chat_template": "{{ messages }}",
        "chat_template_kwargs": {"enable_thinking": False},
        "add_generation_prompt": True,
        "continue_final_message": False,
        "return_assistant_tokens_mask": False,
        "temperature": 0.2,
    }
    assert parse(ApiKind.CHAT_COMPLETIONS, body).payload == body


# --- Completions -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prompt",
    [
        "hello",
        " ",
        ["a", "b"],
        [""],
        [1, 2, 3],
        [0],
        [3.0, 4],
        [[1, 2], [3]],
        [[1.0, 2]],
    ],
)
def test_valid_prompts(prompt: Any) -> None:
    parsed = parse(ApiKind.COMPLETIONS, {"model": "m", "prompt": prompt})
    assert parsed.payload["prompt"] == prompt


@pytest.mark.parametrize(
    "prompt",
    [
        "<absent>",
        None,
        "",
        [],
        [1.5],
        [1, 2.5],
        [True],
        [1, True],
        [[1], [True]],
        [[1.5]],
        [[]],
        [[1], []],
        ["a", 1],
        [1, "a"],
        [["a"]],
        [[1], 2],
        [None],
        [{"text": "a"}],
        {"text": "a"},
        7,
        1.0,
        True,
    ],
)
def test_invalid_prompts(prompt: Any) -> None:
    body: dict[str, Any] = {"model": "m"}
    if prompt != "<absent>":
        body["prompt"] = prompt
    assert "prompt" in parse_error(ApiKind.COMPLETIONS, body).message


# --- Chat completions ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "hi"}],
        [{"role": "system", "content": "be nice"}, {"role": "user", "content": "hi"}],
        [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}],
        [{"role": "assistant"}],
        [{"role": "user", "content": []}],
        [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "what is this?"},
                    {"type": "image_url", "image_url": {"url": "http://x/y.png"}},
                    {"type": "input_audio", "input_audio": {"data": "...", "format": "wav"}},
                    {"type": "video_url", "video_url": {"url": "http://x/y.mp4"}},
                ],
            }
        ],
    ],
)
def test_valid_messages(messages: list[Any]) -> None:
    parsed = parse(ApiKind.CHAT_COMPLETIONS, {"model": "m", "messages": messages})
    assert parsed.payload["messages"] == messages


@pytest.mark.parametrize(
    "messages",
    [
        "<absent>",
        None,
        [],
        "hi",
        {"role": "user", "content": "hi"},
        ["hi"],
        [None],
        [{"content": "hi"}],
        [{"role": None, "content": "hi"}],
        [{"role": 1, "content": "hi"}],
        [{"role": "user", "content": 5}],
        [{"role": "user", "content": {"type": "text"}}],
        [{"role": "user", "content": ["hi"]}],
        [{"role": "user", "content": [{"text": "hi"}]}],
        [{"role": "user", "content": [{"type": 1}]}],
        [{"role": "user", "content": "ok"}, {"role": "user", "content": [None]}],
    ],
)
def test_invalid_messages(messages: Any) -> None:
    body: dict[str, Any] = {"model": "m"}
    if messages != "<absent>":
        body["messages"] = messages
    assert "messages" in parse_error(ApiKind.CHAT_COMPLETIONS, body).message


# --- Responses, conversations, embeddings ---------------------------------------------------


@pytest.mark.parametrize("value", ["hi", "", [], [{"role": "user", "content": "hi"}], {}])
def test_responses_input_accepts_any_non_null(value: Any) -> None:
    assert parse(ApiKind.RESPONSES, {"model": "m", "input": value}).payload["input"] == value


@pytest.mark.parametrize("body", [{"model": "m"}, {"model": "m", "input": None}])
def test_responses_input_is_required(body: dict[str, Any]) -> None:
    assert "input" in parse_error(ApiKind.RESPONSES, body).message


@pytest.mark.parametrize("value", [[], [{"type": "message"}], "x", {}])
def test_conversations_items_accepts_any_non_null(value: Any) -> None:
    assert parse(ApiKind.CONVERSATIONS, {"model": "m", "items": value}).payload["items"] == value


@pytest.mark.parametrize("body", [{"model": "m"}, {"model": "m", "items": None}])
def test_conversations_items_is_required(body: dict[str, Any]) -> None:
    assert "items" in parse_error(ApiKind.CONVERSATIONS, body).message


@pytest.mark.parametrize("value", ["hi", ["a", "b"], [1, 2], [[1, 2]]])
def test_embeddings_input_valid(value: Any) -> None:
    assert parse(ApiKind.EMBEDDINGS, {"model": "m", "input": value}).payload["input"] == value


@pytest.mark.parametrize("value", ["<absent>", None, "", []])
def test_embeddings_input_required_and_non_empty(value: Any) -> None:
    body: dict[str, Any] = {"model": "m"}
    if value != "<absent>":
        body["input"] = value
    assert "input" in parse_error(ApiKind.EMBEDDINGS, body).message


# --- stream, stream_options, cache_salt ------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (True, True),
        ("true", True),
        ("TRUE", True),
        ("True", True),
        (False, False),
        ("false", False),
        ("yes", False),
        ("1", False),
        (1, False),
        (None, False),
        ("", False),
        ([True], False),
    ],
)
def test_stream_flag(value: Any, expected: bool) -> None:
    body = {**MINIMAL[ApiKind.CHAT_COMPLETIONS], "stream": value}
    assert parse(ApiKind.CHAT_COMPLETIONS, body).stream is expected


def test_stream_absent_is_false() -> None:
    assert parse(ApiKind.COMPLETIONS, MINIMAL[ApiKind.COMPLETIONS]).stream is False


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"include_usage": True}, True),
        ({"include_usage": False}, False),
        ({"include_usage": "true"}, False),
        ({}, False),
        (None, False),
        ("include_usage", False),
    ],
)
def test_include_usage(options: Any, expected: bool) -> None:
    body = {**MINIMAL[ApiKind.COMPLETIONS], "stream": True, "stream_options": options}
    assert parse(ApiKind.COMPLETIONS, body).include_usage is expected


@pytest.mark.parametrize("api", OPENAI_APIS)
def test_cache_salt_is_read_on_every_api(api: ApiKind) -> None:
    parsed = parse(api, {**MINIMAL[api], "cache_salt": "tenant-a"})
    assert parsed.cache_salt == "tenant-a"


@pytest.mark.parametrize("salt", [None, ""])
def test_cache_salt_null_or_empty_is_empty(salt: Any) -> None:
    parsed = parse(ApiKind.COMPLETIONS, {**MINIMAL[ApiKind.COMPLETIONS], "cache_salt": salt})
    assert parsed.cache_salt == ""


@pytest.mark.parametrize("salt", [1, True, ["a"], {"a": 1}])
def test_cache_salt_must_be_a_string(salt: Any) -> None:
    body = {**MINIMAL[ApiKind.COMPLETIONS], "cache_salt": salt}
    assert "cache_salt" in parse_error(ApiKind.COMPLETIONS, body).message


def test_parsed_request_is_frozen() -> None:
    parsed = parse(ApiKind.COMPLETIONS, MINIMAL[ApiKind.COMPLETIONS])
    with pytest.raises(AttributeError):
        parsed.model = "other"  # type: ignore[misc]


# --- prefix_input ---------------------------------------------------------------------------


def test_prefix_input_chat_is_json_of_messages() -> None:
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "héllo"}]
    parsed = parse(ApiKind.CHAT_COMPLETIONS, {"model": "m", "messages": messages})
    data = parsed.prefix_input(CODEC)
    assert json.loads(data) == messages
    assert "héllo".encode() in data


def test_prefix_input_chat_ignores_client_key_order() -> None:
    a = parse(ApiKind.CHAT_COMPLETIONS, b'{"model":"m","messages":[{"role":"user","content":"x"}]}')
    b = parse(ApiKind.CHAT_COMPLETIONS, b'{"messages":[{"content":"x","role":"user"}],"model":"m"}')
    assert a.prefix_input(CODEC) == b.prefix_input(CODEC)


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("hello wörld", "hello wörld".encode()),
        (["a", "b c", "d"], b"a b c d"),
        (["only"], b"only"),
        ([1, 2, 3], b"[1,2,3]"),
        ([[1, 2], [3]], b"[[1,2],[3]]"),
    ],
)
def test_prefix_input_completions(prompt: Any, expected: bytes) -> None:
    parsed = parse(ApiKind.COMPLETIONS, {"model": "m", "prompt": prompt})
    assert parsed.prefix_input(CODEC) == expected


def test_prefix_input_responses_all_parts_in_order() -> None:
    tools = [{"type": "function", "name": "f"}]
    body = {"model": "m", "input": "question", "tools": tools, "instructions": "be brief"}
    data = parse(ApiKind.RESPONSES, body).prefix_input(CODEC)
    assert json.loads(data) == [
        {"instructions": "be brief"},
        {"tools": tools},
        {"input": "question"},
    ]


def test_prefix_input_responses_skips_absent_parts() -> None:
    body = {"model": "m", "input": [{"role": "user", "content": "q"}], "instructions": None}
    data = parse(ApiKind.RESPONSES, body).prefix_input(CODEC)
    assert json.loads(data) == [{"input": [{"role": "user", "content": "q"}]}]


def test_prefix_input_conversations_is_json_of_items() -> None:
    items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "x"}]}]
    data = parse(ApiKind.CONVERSATIONS, {"model": "m", "items": items}).prefix_input(CODEC)
    assert json.loads(data) == items


@pytest.mark.parametrize("value", ["some text", ["a", "b"], [1, 2]])
def test_prefix_input_embeddings_is_json_of_input(value: Any) -> None:
    data = parse(ApiKind.EMBEDDINGS, {"model": "m", "input": value}).prefix_input(CODEC)
    assert json.loads(data) == value


# --- rewrite_model --------------------------------------------------------------------------


def test_rewrite_model_sets_target_and_sorts_keys() -> None:
    raw = b'{"stream":true,"model":"base","prompt":"hi","max_tokens":5,"z":{"b":1,"a":2}}'
    parsed = parse(ApiKind.COMPLETIONS, raw)
    out = rewrite_model(parsed, "lora-7", CODEC)
    assert out == (
        b'{"max_tokens":5,"model":"lora-7","prompt":"hi","stream":true,"z":{"a":2,"b":1}}'
    )
    assert parsed.payload["model"] == "base"
    assert parsed.model == "base"


def test_rewrite_model_to_same_name_still_sorts() -> None:
    parsed = parse(ApiKind.EMBEDDINGS, b'{"model":"m","input":"x"}')
    assert rewrite_model(parsed, "m", CODEC) == b'{"input":"x","model":"m"}'


def test_rewrite_model_escapes_target() -> None:
    parsed = parse(ApiKind.EMBEDDINGS, b'{"model":"m","input":"x"}')
    out = rewrite_model(parsed, 'we"ird', CODEC)
    assert json.loads(out)["model"] == 'we"ird'


@pytest.mark.parametrize("prompt", ["abcdefgh" * 100, ["abc" * 50, "def" * 50], "é" * 300])
def test_prefix_input_limit_keeps_the_hashed_prefix(prompt: object) -> None:
    parsed = OpenAIParser(CODEC).parse(
        CODEC.dumps({"model": "m", "prompt": prompt}), {":path": "/v1/completions"}
    )
    whole = parsed.prefix_input(CODEC)
    cut = parsed.prefix_input(CODEC, limit=64)
    assert len(cut) < len(whole)
    assert whole.startswith(cut)
    assert len(cut) >= 64  # at least the bytes hashing looks at
