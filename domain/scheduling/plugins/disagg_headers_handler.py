"""``disagg-headers-handler`` (and its older name ``prefill-header-handler``): accepted, no
effect.

In the llm-d router this PreRequest plugin sets the header that tells the decode endpoint's
sidecar where to prefill. Here the Director always sends ``disagg-profile-handler``'s
prefill endpoint in ``x-prefiller-host-port``, so the plugin has nothing left to do; it is
accepted so that the llm-d router's P/D configurations load, and start-up says it is
ignored (``app.config.compatibility.NOOP_TYPES``).
"""

from __future__ import annotations

from dataclasses import dataclass

from domain.plugins.base import PluginRegistry, TypedName, class_factory

__all__ = ["LEGACY_TYPE", "TYPE", "DisaggHeadersHandler", "DisaggHeadersParameters", "register"]

TYPE = "disagg-headers-handler"
LEGACY_TYPE = "prefill-header-handler"


@dataclass(frozen=True, slots=True, kw_only=True)
class DisaggHeadersParameters:
    """``prefillProfile`` and ``encodeProfile``: accepted (the handler's profiles decide
    here)."""

    prefill_profile: str = "prefill"
    encode_profile: str = "encode"


class DisaggHeadersHandler:
    """No extension point: nothing to do here (see the module docstring)."""

    __slots__ = ("typed_name",)

    def __init__(self, typed_name: TypedName, parameters: DisaggHeadersParameters) -> None:
        self.typed_name = typed_name


def register(registry: PluginRegistry) -> None:
    for type_name in (TYPE, LEGACY_TYPE):
        registry.register(
            type_name,
            class_factory(type_name, DisaggHeadersHandler),
            parameters=DisaggHeadersParameters,
            description="accepted for the llm-d router's P/D configs; no effect here",
        )
