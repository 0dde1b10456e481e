"""Candidate endpoints for a request, after the gateway's subset hint."""

from __future__ import annotations

from collections.abc import Sequence

from domain.datastore.endpoint import Endpoint
from ports.requests import Metadata

__all__ = ["SUBSET_HINT_KEY", "SUBSET_HINT_NAMESPACE", "locate"]

SUBSET_HINT_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_HINT_KEY = "x-gateway-destination-endpoint-subset"


def _ip_of(item: str) -> str:
    item = item.strip()
    if item.startswith("["):
        return item[1 : item.find("]")] if "]" in item else item[1:]
    if item.count(":") == 1:
        return item.rsplit(":", 1)[0]
    return item  # a bare IPv4, or a bare IPv6 address without a port


def locate(
    endpoints: Sequence[Endpoint], metadata: Metadata, *, subset_filter: bool = True
) -> Sequence[Endpoint]:
    """The endpoints the request may go to.

    Without a hint (namespace or key absent) every endpoint is a candidate. With a hint,
    a list of strings or one comma-separated string of ``ip:port`` items, only endpoints
    whose IP is listed remain (ports are ignored, non-string items skipped); an empty
    hint leaves none.
    """
    if not subset_filter:
        return endpoints
    namespace = metadata.get(SUBSET_HINT_NAMESPACE)
    if namespace is None or SUBSET_HINT_KEY not in namespace:
        return endpoints
    hint = namespace[SUBSET_HINT_KEY]
    items: list[str]
    if isinstance(hint, str):
        items = [part for part in hint.split(",") if part.strip()]
    elif isinstance(hint, list | tuple):
        items = [part for part in hint if isinstance(part, str)]
    else:
        items = []
    wanted = {_ip_of(item) for item in items}
    if not wanted:
        return ()
    return tuple(e for e in endpoints if e.info.address.ip in wanted)
