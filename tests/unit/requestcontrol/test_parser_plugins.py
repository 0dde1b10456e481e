"""openai-parser and passthrough-parser plugins."""

from __future__ import annotations

import pytest

from domain.errors import BadRequestError
from domain.plugins.base import Plugin, PluginRegistry
from domain.requestcontrol.interfaces import Parser
from domain.requestcontrol.plugins import openai_parser, passthrough_parser
from domain.requesthandling.jsoncodec import StdlibJsonCodec
from domain.requesthandling.openai import ApiKind
from tests.unit.requestcontrol import make_handle


def _create(type_name: str) -> Plugin:
    registry = PluginRegistry()
    openai_parser.register(registry)
    passthrough_parser.register(registry)
    return registry.create(type_name, f"my-{type_name}", None, make_handle())


def _parser(type_name: str) -> Parser:
    plugin = _create(type_name)
    assert isinstance(plugin, Parser)
    return plugin


def test_openai_parser_plugin_is_named_and_a_parser() -> None:
    plugin = _create("openai-parser")
    assert isinstance(plugin, Parser)
    assert plugin.typed_name.type == "openai-parser"
    assert plugin.typed_name.name == "my-openai-parser"


def test_openai_parser_parses_chat_by_path() -> None:
    parser = _parser("openai-parser")
    parsed = parser.parse(
        b'{"model":"llama","stream":true,"messages":[{"role":"user","content":"hi"}]}',
        {":path": "/v1/chat/completions"},
    )
    assert parsed.api is ApiKind.CHAT_COMPLETIONS
    assert parsed.model == "llama"
    assert parsed.stream is True
    assert parsed.opaque is False
    assert parsed.payload["messages"] == [{"role": "user", "content": "hi"}]


def test_openai_parser_rejects_invalid_bodies() -> None:
    parser = _parser("openai-parser")
    with pytest.raises(BadRequestError):
        parser.parse(b"not json", {":path": "/v1/completions"})
    with pytest.raises(BadRequestError):
        parser.parse(b'{"model":"m","messages":[]}', {":path": "/v1/chat/completions"})


def test_openai_parser_app_protocols() -> None:
    plugin = _create("openai-parser")
    assert isinstance(plugin, openai_parser.OpenAIParserPlugin)
    assert tuple(plugin.supported_app_protocols()) == ("http", "kubernetes.io/h2c")


def test_passthrough_keeps_any_body_raw() -> None:
    parser = _parser("passthrough-parser")
    body = b"\x00\x01 not json at all \xff"
    parsed = parser.parse(body, {":path": "/v1/chat/completions"})
    assert parsed.opaque is True
    assert parsed.raw == body
    assert parsed.model == ""
    assert parsed.payload == {}
    assert parsed.stream is False
    assert parsed.api is ApiKind.COMPLETIONS
    assert parsed.prefix_input(StdlibJsonCodec()) == body


def test_passthrough_does_not_interpret_json() -> None:
    parser = _parser("passthrough-parser")
    body = b'{"model":"llama","stream":true,"prompt":"hi"}'
    parsed = parser.parse(body, {})
    assert parsed.model == ""
    assert parsed.stream is False
    assert parsed.raw == body


def test_passthrough_accepts_any_app_protocol() -> None:
    plugin = _create("passthrough-parser")
    assert isinstance(plugin, passthrough_parser.PassthroughParser)
    assert tuple(plugin.supported_app_protocols()) == ("*",)
