"""``header-based-testing-filter``: the conformance tests choose the endpoints (test only)."""

from __future__ import annotations

from collections.abc import Sequence

from domain.plugins.base import EmptyParameters, PluginRegistry, TypedName, class_factory
from domain.scheduling.interfaces import CycleState
from domain.scheduling.types import Candidate, InferenceRequest

__all__ = ["HEADER", "TYPE", "HeaderBasedTestingFilter", "register"]

TYPE = "header-based-testing-filter"
#: Request header listing the wanted endpoints: comma-separated ``ip`` or ``ip:port``.
HEADER = "test-epp-endpoint-selection"


def _parse(item: str) -> tuple[str, int | None]:
    """``(ip, port)`` of one header item; ``port`` is ``None`` when the item has none.

    IPv6 may be bracketed (``[fd00::1]:8000``, ``[fd00::1]``); an unbracketed item with
    more than one colon is a bare IPv6 address.
    """
    if item.startswith("["):
        end = item.find("]")
        if end < 0:
            return item[1:], None
        rest = item[end + 1 :]
        port = rest[1:] if rest.startswith(":") else ""
        return item[1:end], int(port) if port.isdigit() else None
    if item.count(":") == 1:
        ip, port = item.split(":", 1)
        return ip, int(port) if port.isdigit() else None
    return item, None


class HeaderBasedTestingFilter:
    """Keeps the candidates listed in the ``test-epp-endpoint-selection`` request header.

    Each item is an IP (every port of it matches) or ``ip:port``. The result follows the
    header's order; a candidate listed twice is kept once. Without the header (or with an
    empty value) every candidate is kept; if nothing listed is a candidate, none is.
    For conformance tests only.
    """

    __slots__ = ("typed_name",)

    def __init__(self, typed_name: TypedName, parameters: EmptyParameters) -> None:
        self.typed_name = typed_name

    def filter(
        self, cycle: CycleState, request: InferenceRequest, candidates: Sequence[Candidate]
    ) -> Sequence[Candidate]:
        value = request.headers.get(HEADER, "").strip()
        if not value:
            return candidates
        kept: list[Candidate] = []
        seen: set[int] = set()
        for raw in value.split(","):
            item = raw.strip()
            if not item:
                continue
            ip, port = _parse(item)
            for c in candidates:
                address = c.info.address
                if (
                    address.ip == ip
                    and (port is None or address.port == port)
                    and id(c) not in seen
                ):
                    seen.add(id(c))
                    kept.append(c)
        return kept


def register(registry: PluginRegistry) -> None:
    registry.register(
        TYPE,
        class_factory(TYPE, HeaderBasedTestingFilter),
        description="test only: keeps the endpoints listed in a request header",
    )
