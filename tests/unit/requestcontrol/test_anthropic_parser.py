"""anthropic-parser, the parser router and requestHandler.parsers, Anthropic token usage."""

from __future__ import annotations

import json
from typing import Any

import pytest

from app.config import ConfigError, load_config
from app.plugins import build_registry
from domain.errors import BadRequestError
from domain.requestcontrol.parsers import ParserRouter
from domain.requesthandling.jsoncodec import StdlibJsonCodec
from domain.requesthandling.openai import ApiKind
from domain.requesthandling.usage import SseUsageScanner, Usage, usage_from_body
from tests.support.scheduling import plugin_handle

CODEC = StdlibJsonCodec()
MESSAGES = {"model": "claude", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}


def _default_parser() -> ParserRouter:
    loaded = load_config(None, registry=build_registry(), handle=plugin_handle())
    assert isinstance(loaded.parser, ParserRouter)
    return loaded.parser


def _headers(path: str) -> dict[str, str]:
    return {":path": path, "x-request-id": "r"}


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens", "/v1/messages?x=1"])
def test_messages_paths_go_to_the_anthropic_parser(path: str) -> None:
    parsed = _default_parser().parse(json.dumps(MESSAGES).encode(), _headers(path))
    assert parsed.api is ApiKind.MESSAGES
    assert parsed.model == "claude"
    assert parsed.stream is False


def test_other_paths_stay_with_the_openai_parser() -> None:
    body = json.dumps({"model": "m", "prompt": "hi"}).encode()
    assert _default_parser().parse(body, _headers("/v1/completions")).api is ApiKind.COMPLETIONS


def test_prefix_input_is_system_tools_then_messages() -> None:
    body = {**MESSAGES, "system": "be brief", "tools": [{"name": "t"}], "stream": True}
    parsed = _default_parser().parse(json.dumps(body).encode(), _headers("/v1/messages"))
    assert parsed.stream is True
    assert json.loads(parsed.prefix_input(CODEC)) == [
        {"system": "be brief"},
        {"tools": [{"name": "t"}]},
        {"messages": MESSAGES["messages"]},
    ]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"[1]", "request body must be a JSON object"),
        (b"{", "request body is not valid JSON"),
        (json.dumps({"messages": []}).encode(), "model not found"),
        (json.dumps({"model": "m"}).encode(), "messages is required"),
        (json.dumps({"model": "m", "messages": []}).encode(), "messages must be a non-empty"),
        (json.dumps({"model": "m", "messages": [{"content": "x"}]}).encode(), "role must be"),
        (
            json.dumps({"model": "m", "messages": [{"role": "user", "content": 5}]}).encode(),
            "messages[0].content must be a string or a list",
        ),
        (json.dumps({**MESSAGES, "system": 3}).encode(), "system must be a string or"),
        (json.dumps({**MESSAGES, "stream": "yes"}).encode(), "stream must be a boolean"),
    ],
)
def test_bad_bodies_are_400s(body: bytes, message: str) -> None:
    with pytest.raises(BadRequestError, match=message.replace("[", r"\[").replace("]", r"\]")):
        _default_parser().parse(body, _headers("/v1/messages"))


def _load(config: dict[str, Any]) -> Any:
    return load_config(json.dumps(config), registry=build_registry(), handle=plugin_handle())


def test_request_handler_parsers_in_order() -> None:
    loaded = _load(
        {
            "apiVersion": "llm-d.ai/v1alpha1",
            "plugins": [{"type": "anthropic-parser", "name": "a"}, {"type": "passthrough-parser"}],
            "requestHandler": {
                "parsers": [{"pluginRef": "a"}, {"pluginRef": "passthrough-parser"}]
            },
        }
    )
    router = loaded.parser
    assert isinstance(router, ParserRouter)
    assert router.choose(_headers("/v1/messages")) is loaded.plugins["a"]
    assert router.choose(_headers("/v1/chat/completions")) is loaded.plugins["passthrough-parser"]


def test_only_claimed_parsers_refuse_other_paths() -> None:
    loaded = _load(
        {
            "plugins": [{"type": "anthropic-parser"}, {"type": "anthropic-parser", "name": "b"}],
            "requestHandler": {"parsers": [{"pluginRef": "anthropic-parser"}, {"pluginRef": "b"}]},
        }
    )
    with pytest.raises(BadRequestError, match="no parser"):
        loaded.parser.parse(b"{}", _headers("/v1/completions"))


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {"requestHandler": {"parsers": [{"pluginRef": "nope"}]}},
            'requestHandler.parsers[0].pluginRef: no plugin named "nope"',
        ),
        (
            {
                "plugins": [{"type": "queue-scorer"}],
                "requestHandler": {"parsers": [{"pluginRef": "queue-scorer"}]},
            },
            "requestHandler.parsers[0].pluginRef: plugin",
        ),
        (
            {
                "plugins": [{"type": "anthropic-parser"}],
                "parser": {"pluginRef": "anthropic-parser"},
                "requestHandler": {"parsers": [{"pluginRef": "anthropic-parser"}]},
            },
            "parser: give either",
        ),
        ({"requestHandler": {"parser": []}}, "requestHandler.parser: unknown field"),
    ],
)
def test_bad_request_handler_config(config: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        _load(config)
    assert message in str(caught.value)


# --- usage ----------------------------------------------------------------------------------


def test_usage_of_a_messages_response() -> None:
    body = {
        "type": "message",
        "usage": {
            "input_tokens": 10,
            "cache_read_input_tokens": 90,
            "cache_creation_input_tokens": 5,
            "output_tokens": 7,
        },
    }
    assert usage_from_body(json.dumps(body).encode(), CODEC) == Usage(
        prompt_tokens=105, completion_tokens=7, total_tokens=112, cached_tokens=90
    )


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode()


def test_usage_of_a_messages_stream() -> None:
    scanner = SseUsageScanner(CODEC)
    start = {
        "type": "message_start",
        "message": {
            "usage": {"input_tokens": 12, "cache_read_input_tokens": 30, "output_tokens": 1}
        },
    }
    stream = (
        _event("message_start", start)
        + _event("content_block_delta", {"type": "content_block_delta", "delta": {"text": "x"}})
        + _event("message_delta", {"type": "message_delta", "usage": {"output_tokens": 25}})
        + _event("message_stop", {"type": "message_stop"})
    )
    for i in range(0, len(stream), 7):  # split anywhere
        scanner.feed(stream[i : i + 7])
    scanner.flush()
    assert scanner.usage == Usage(
        prompt_tokens=42, completion_tokens=25, total_tokens=67, cached_tokens=30
    )


def test_a_stream_cut_after_message_start_still_reports_the_prompt() -> None:
    scanner = SseUsageScanner(CODEC)
    scanner.feed(
        _event(
            "message_start", {"type": "message_start", "message": {"usage": {"input_tokens": 8}}}
        )
    )
    assert scanner.usage is not None
    assert scanner.usage.prompt_tokens == 8
