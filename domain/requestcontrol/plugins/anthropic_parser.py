"""``anthropic-parser``: parses Anthropic Messages API requests (``/v1/messages``,
``/v1/messages/count_tokens``).

Wraps ``domain.requesthandling.anthropic.AnthropicParser``. It claims those path suffixes
(``paths``), so beside ``openai-parser`` in ``requestHandler.parsers`` (or by default, with
no parser configured) it serves them and the OpenAI parser the rest. Token usage of its
responses (JSON or SSE) is read as the Director reads any usage
(``domain.requesthandling.usage``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from domain.plugins.base import Plugin, PluginRegistry, TypedName
from domain.plugins.handle import Handle
from domain.requesthandling.anthropic import MESSAGES_PATHS, AnthropicParser
from domain.requesthandling.openai import ParsedRequest
from ports.codec import JsonCodec

__all__ = ["TYPE", "AnthropicParserPlugin", "register"]

TYPE = "anthropic-parser"


class AnthropicParserPlugin:
    """Parser plugin for the Anthropic Messages API."""

    def __init__(self, typed_name: TypedName, codec: JsonCodec) -> None:
        self._typed_name = typed_name
        self._parser = AnthropicParser(codec)

    @property
    def typed_name(self) -> TypedName:
        return self._typed_name

    def parse(self, body: bytes, headers: Mapping[str, str]) -> ParsedRequest:
        return self._parser.parse(body, headers)

    def paths(self) -> Sequence[str]:
        """The request path suffixes this parser claims."""
        return MESSAGES_PATHS

    def supported_app_protocols(self) -> Sequence[str]:
        return ("http", "kubernetes.io/h2c")


def _factory(name: str, parameters: Any, handle: Handle) -> Plugin:
    return AnthropicParserPlugin(TypedName(TYPE, name), handle.codec)


def register(registry: PluginRegistry) -> None:
    registry.register(TYPE, _factory, description="parses Anthropic Messages API request bodies")
