"""``openai-parser``: the default request parser, for OpenAI-compatible HTTP APIs.

Wraps ``OpenAIParser``: the API is chosen from the request path, the body decoded with
the shared JSON codec and validated per API; any failure raises ``BadRequestError``.
It serves pools whose ``appProtocol`` is ``http`` or ``kubernetes.io/h2c``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from domain.plugins.base import Plugin, PluginRegistry, TypedName
from domain.plugins.handle import Handle
from domain.requesthandling.openai import OpenAIParser, ParsedRequest
from ports.codec import JsonCodec

__all__ = ["SUPPORTED_APP_PROTOCOLS", "TYPE", "OpenAIParserPlugin", "register"]

TYPE = "openai-parser"
SUPPORTED_APP_PROTOCOLS = ("http", "kubernetes.io/h2c")


class OpenAIParserPlugin:
    """Parser plugin parsing OpenAI-style JSON bodies."""

    def __init__(self, typed_name: TypedName, codec: JsonCodec) -> None:
        self._typed_name = typed_name
        self._parser = OpenAIParser(codec)

    @property
    def typed_name(self) -> TypedName:
        return self._typed_name

    def parse(self, body: bytes, headers: Mapping[str, str]) -> ParsedRequest:
        return self._parser.parse(body, headers)

    def supported_app_protocols(self) -> Sequence[str]:
        """The pool ``appProtocol`` values this parser can serve."""
        return SUPPORTED_APP_PROTOCOLS


def _factory(name: str, parameters: Any, handle: Handle) -> Plugin:
    return OpenAIParserPlugin(TypedName(TYPE, name), handle.codec)


def register(registry: PluginRegistry) -> None:
    registry.register(TYPE, _factory, description="parses OpenAI-compatible request bodies")
