"""An ``EndpointSource`` whose endpoint set the test changes at will."""

from __future__ import annotations

import asyncio

from ports.endpoints import (
    EndpointAddress,
    EndpointEvent,
    EndpointEventKind,
    EndpointInfo,
    EndpointSink,
)

__all__ = ["FakeEndpointSource"]


def _endpoint(host_port: str) -> EndpointInfo:
    ip, _, port = host_port.rpartition(":")
    address = EndpointAddress(ip=ip, port=int(port))
    return EndpointInfo(name=host_port, address=address, metrics_host=host_port)


class FakeEndpointSource:
    """Delivers ``initial`` once ``sync()`` is called; ``add``/``remove`` push events later."""

    def __init__(self, initial: list[str]) -> None:
        self._initial = initial
        self._sink: EndpointSink | None = None
        self._synced = asyncio.Event()
        self.running = asyncio.Event()

    def sync(self) -> None:
        self._synced.set()

    def add(self, host_port: str) -> None:
        assert self._sink is not None
        self._sink.apply(
            EndpointEvent(kind=EndpointEventKind.ADD_OR_UPDATE, endpoint=_endpoint(host_port))
        )

    def remove(self, host_port: str) -> None:
        assert self._sink is not None
        self._sink.apply(
            EndpointEvent(kind=EndpointEventKind.DELETE, endpoint=_endpoint(host_port))
        )

    async def run(self, sink: EndpointSink) -> None:
        self._sink = sink
        self.running.set()
        await self._synced.wait()
        for host_port in self._initial:
            self.add(host_port)
        sink.mark_synced()
        await asyncio.Event().wait()
