"""``decode-filter``, ``prefill-filter``, ``encode-filter``: endpoints by disaggregation role.

A model server's role is its pod's ``llm-d.ai/role`` label, as the llm-d router reads it:
``decode``, ``prefill``, ``encode``, or a combination (``prefill-decode``,
``encode-prefill``, ``encode-prefill-decode``; ``both`` is the deprecated
``prefill-decode``). Each filter keeps the candidates whose role includes its stage; the
decode filter also keeps those without the label (a pool without roles decodes anywhere).
"""

from __future__ import annotations

from collections.abc import Sequence

from domain.plugins.base import (
    EmptyParameters,
    Plugin,
    PluginFactory,
    PluginRegistry,
    TypedName,
)
from domain.plugins.handle import Handle
from domain.scheduling.interfaces import CycleState
from domain.scheduling.types import Candidate, InferenceRequest

__all__ = ["DECODE", "ENCODE", "PREFILL", "ROLE_LABEL", "RoleFilter", "register"]

ROLE_LABEL = "llm-d.ai/role"
DECODE = "decode-filter"
PREFILL = "prefill-filter"
ENCODE = "encode-filter"

#: Per filter type: the role values it keeps, and whether it keeps unlabelled endpoints.
_ROLES: dict[str, tuple[frozenset[str], bool]] = {
    DECODE: (frozenset({"decode", "prefill-decode", "both", "encode-prefill-decode"}), True),
    PREFILL: (
        frozenset({"prefill", "encode-prefill", "prefill-decode", "both", "encode-prefill-decode"}),
        False,
    ),
    ENCODE: (frozenset({"encode", "encode-prefill", "encode-prefill-decode"}), False),
}


class RoleFilter:
    """Keeps the candidates whose ``llm-d.ai/role`` is one of ``roles`` (and, when
    ``unlabelled`` is true, those without the label), in order."""

    __slots__ = ("_roles", "_unlabelled", "typed_name")

    def __init__(self, typed_name: TypedName, roles: frozenset[str], *, unlabelled: bool) -> None:
        self.typed_name = typed_name
        self._roles = roles
        self._unlabelled = unlabelled

    def filter(
        self, cycle: CycleState, request: InferenceRequest, candidates: Sequence[Candidate]
    ) -> Sequence[Candidate]:
        roles, unlabelled = self._roles, self._unlabelled
        kept: list[Candidate] = []
        for candidate in candidates:
            role = candidate.info.labels.get(ROLE_LABEL)
            if role in roles if role is not None else unlabelled:
                kept.append(candidate)
        return kept


def _factory(type_name: str) -> PluginFactory:
    roles, unlabelled = _ROLES[type_name]

    def factory(name: str, parameters: EmptyParameters, handle: Handle) -> Plugin:
        return RoleFilter(TypedName(type_name, name), roles, unlabelled=unlabelled)

    return factory


def register(registry: PluginRegistry) -> None:
    for type_name, stage in ((DECODE, "decode"), (PREFILL, "prefill"), (ENCODE, "encode")):
        registry.register(
            type_name,
            _factory(type_name),
            description=f"keeps endpoints whose {ROLE_LABEL} label includes {stage}",
        )
