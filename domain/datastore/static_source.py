"""An endpoint source for model servers outside Kubernetes: a fixed list."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from ports.endpoints import (
    EndpointAddress,
    EndpointEvent,
    EndpointEventKind,
    EndpointInfo,
    EndpointSink,
)

__all__ = ["StaticEndpointSource", "parse_endpoint_list"]


def parse_endpoint_list(text: str) -> tuple[EndpointAddress, ...]:
    """Parse ``"ip:port,ip:port"`` (IPv6 as ``[::1]:8000``). Raises ``ValueError``."""
    addresses: list[EndpointAddress] = []
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            continue
        if item.startswith("["):
            host, sep, port_text = item[1:].partition("]:")
        else:
            host, sep, port_text = item.rpartition(":")
        if not sep or not host or (":" in host and not item.startswith("[")):
            raise ValueError(f"{item!r} is not ip:port")
        if not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise ValueError(f"{item!r} has no valid port")
        address = EndpointAddress(ip=host, port=int(port_text))
        if address in addresses:
            raise ValueError(f"{item!r} is listed twice")
        addresses.append(address)
    if not addresses:
        raise ValueError("no endpoints given")
    return tuple(addresses)


class StaticEndpointSource:
    """Announces a fixed list of endpoints once, then idles until cancelled."""

    def __init__(self, addresses: Sequence[EndpointAddress]) -> None:
        self._endpoints = tuple(
            EndpointInfo(
                name=a.host_port(),
                pod_name=a.host_port(),
                address=a,
                metrics_host=a.host_port(),
            )
            for a in addresses
        )

    async def run(self, sink: EndpointSink) -> None:
        for endpoint in self._endpoints:
            sink.apply(EndpointEvent(kind=EndpointEventKind.ADD_OR_UPDATE, endpoint=endpoint))
        sink.mark_synced()
        await asyncio.Event().wait()
