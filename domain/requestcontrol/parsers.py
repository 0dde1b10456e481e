"""``ParserRouter``: several parsers on one route, chosen by the request path.

The parsers come in configuration order (``requestHandler.parsers``). A parser may claim
path suffixes (a ``paths()`` method); the request goes to the first parser claiming a
suffix of its path (``:path``, else ``x-original-path``, else ``x-forwarded-path``; the
query string ignored), else to the first parser that claims none (the fallback). With no
fallback, an unclaimed path is a bad request.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from domain.errors import BadRequestError
from domain.plugins.base import TypedName
from domain.requestcontrol.interfaces import Parser
from domain.requesthandling.openai import ParsedRequest

__all__ = ["ROUTER_TYPE", "ParserRouter", "claimed_paths"]

ROUTER_TYPE = "parser-router"
_PATH_HEADERS = (":path", "x-original-path", "x-forwarded-path")


def claimed_paths(parser: Parser) -> tuple[str, ...]:
    paths = getattr(parser, "paths", None)
    return tuple(paths()) if callable(paths) else ()


class ParserRouter:
    """A ``Parser`` that hands each request to one of ``parsers``."""

    def __init__(self, parsers: Sequence[Parser]) -> None:
        self._typed_name = TypedName(ROUTER_TYPE, ",".join(p.typed_name.name for p in parsers))
        self.parsers = tuple(parsers)
        self._claims = tuple(
            (suffix, parser) for parser in parsers for suffix in claimed_paths(parser)
        )
        self._fallback = next((p for p in parsers if not claimed_paths(p)), None)

    @property
    def typed_name(self) -> TypedName:
        return self._typed_name

    def choose(self, headers: Mapping[str, str]) -> Parser | None:
        path = ""
        for name in _PATH_HEADERS:
            value = headers.get(name)
            if value:
                path = value.split("?", 1)[0].rstrip("/")
                break
        for suffix, parser in self._claims:
            if path.endswith(suffix):
                return parser
        return self._fallback

    def parse(self, body: bytes, headers: Mapping[str, str]) -> ParsedRequest:
        parser = self.choose(headers)
        if parser is None:
            raise BadRequestError("no parser is configured for this request path")
        return parser.parse(body, headers)
