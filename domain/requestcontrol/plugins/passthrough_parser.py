"""``passthrough-parser``: forwards request bodies without interpreting them.

``parse`` never fails: it returns an opaque ``ParsedRequest`` (API ``completions``, empty
model and payload, not streaming) whose ``raw`` is the body as received. An opaque request
gets no model rewrite and its responses no usage parsing; prefix-cache hashing works on
the raw bytes. ``supported_app_protocols`` returns ``("*",)``, meaning any pool
``appProtocol`` is accepted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from domain.plugins.base import PluginRegistry, TypedName, class_factory
from domain.requesthandling.openai import ApiKind, ParsedRequest

__all__ = ["ANY_APP_PROTOCOL", "TYPE", "PassthroughParser", "register"]

TYPE = "passthrough-parser"
#: The ``supported_app_protocols`` entry that matches every ``appProtocol``.
ANY_APP_PROTOCOL = "*"


class PassthroughParser:
    """Parser plugin keeping the body as raw bytes."""

    def __init__(self, typed_name: TypedName, parameters: object) -> None:
        self._typed_name = typed_name

    @property
    def typed_name(self) -> TypedName:
        return self._typed_name

    def parse(self, body: bytes, headers: Mapping[str, str]) -> ParsedRequest:
        return ParsedRequest(
            api=ApiKind.COMPLETIONS, model="", payload={}, stream=False, opaque=True, raw=body
        )

    def supported_app_protocols(self) -> Sequence[str]:
        """``("*",)``: any pool ``appProtocol``."""
        return (ANY_APP_PROTOCOL,)


def register(registry: PluginRegistry) -> None:
    registry.register(
        TYPE,
        class_factory(TYPE, PassthroughParser),
        description="keeps request bodies as raw bytes; no model rewrite, no usage parsing",
    )
