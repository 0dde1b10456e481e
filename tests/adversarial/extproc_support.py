"""The real ext_proc server on loopback, a counting processor around the real Director, and
a client stream driven the way Envoy drives it (or the way a hostile client does)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from adapters.envoy.server import GrpcServers, ServerOptions
from domain.datalayer.attributes import IN_FLIGHT_LOAD, InFlightLoad
from domain.datastore import Datastore
from domain.requestcontrol.director import Director
from ports.endpoints import EndpointAddress, EndpointEvent, EndpointEventKind, EndpointInfo
from ports.observer import Observer
from ports.requests import (
    InboundRequest,
    Metadata,
    RequestExchange,
    ResponseBodyReply,
    ResponseHeadersReply,
    RoutingDecision,
)
from tests.support.director import configured_director

__all__ = [
    "CONCURRENCY_CONFIG",
    "CountingProcessor",
    "director_over",
    "extproc_channel",
    "in_flight",
    "read_all",
]

ENDPOINT_IPS = ("10.0.0.1", "10.0.0.2", "10.0.0.3")

#: At most one request in flight per endpoint: a leaked one locks that endpoint out.
CONCURRENCY_CONFIG = """\
plugins:
- type: concurrency-detector
  parameters: {maxConcurrency: 1}
- type: queue-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: concurrency-detector
  - pluginRef: queue-scorer
  - pluginRef: max-score-picker
saturationDetector:
  pluginRef: concurrency-detector
"""


def director_over(
    config: str | None = CONCURRENCY_CONFIG, *, observer: Observer | None = None
) -> tuple[Director, Datastore]:
    datastore = Datastore()
    for ip in ENDPOINT_IPS:
        datastore.apply(
            EndpointEvent(
                kind=EndpointEventKind.ADD_OR_UPDATE,
                endpoint=EndpointInfo(name=f"{ip}:8000", address=EndpointAddress(ip=ip, port=8000)),
            )
        )
    datastore.mark_synced()
    return configured_director(datastore, config, observer=observer), datastore


def in_flight(datastore: Datastore) -> dict[str, InFlightLoad]:
    """The in-flight load the concurrency detector sees, per endpoint that has any."""
    loads = {}
    for endpoint in datastore.endpoints():
        load = endpoint.attributes.get(IN_FLIGHT_LOAD)
        if isinstance(load, InFlightLoad) and (load.requests or load.tokens):
            loads[endpoint.name] = load
    return loads


@dataclass(slots=True, eq=False)
class _CountedExchange:
    """Delegates to the real exchange and counts how often the adapter closes it."""

    inner: RequestExchange
    processor: CountingProcessor
    close_calls: int = 0

    async def route(self) -> RoutingDecision:
        return await self.inner.route()

    async def response_headers(self, headers: Any, metadata: Metadata) -> ResponseHeadersReply:
        return await self.inner.response_headers(headers, metadata)

    async def response_body(self, chunk: bytes, end_of_stream: bool) -> ResponseBodyReply:
        return await self.inner.response_body(chunk, end_of_stream)

    async def close(self) -> None:
        self.close_calls += 1
        try:
            await self.inner.close()
        finally:
            self.processor.changed.set()


@dataclass(slots=True)
class CountingProcessor:
    """The real Director behind the ``RequestProcessor`` port, remembering every exchange."""

    director: Director
    exchanges: list[_CountedExchange] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def open(self, request: InboundRequest) -> _CountedExchange:
        exchange = _CountedExchange(self.director.open(request), self)
        self.exchanges.append(exchange)
        return exchange

    def ready(self) -> bool:
        return self.director.ready()

    @property
    def unclosed(self) -> int:
        return sum(1 for e in self.exchanges if e.close_calls == 0)

    async def wait_all_closed(self, within: float = 5.0) -> None:
        try:
            async with asyncio.timeout(within):
                while self.unclosed:
                    self.changed.clear()
                    await self.changed.wait()
        except TimeoutError:
            raise AssertionError(
                f"{self.unclosed} of {len(self.exchanges)} exchanges still open after {within}s"
            ) from None


#: The transport ``extproc_channel`` serves with; the ``each_transport`` fixture
#: (tests/adversarial/conftest.py) sets it for the test it runs.
DEFAULT_TRANSPORT = "native"
TRANSPORT = [DEFAULT_TRANSPORT]


@contextlib.asynccontextmanager
async def extproc_server(processor: Any, **options: Any) -> AsyncIterator[str]:
    """The real ``GrpcServers`` on loopback for ``processor`` (``options``: more of its
    keyword arguments, e.g. ``limits``), served by ``TRANSPORT``; yields its address."""
    options.setdefault("transport", TRANSPORT[0])
    servers = GrpcServers(
        processor,
        ServerOptions(
            host="127.0.0.1",
            grpc_port=0,
            health_port=0,
            certificate=None,
            **options,
        ),
    )
    await servers.start()
    try:
        yield f"127.0.0.1:{servers.bound_grpc_port}"
    finally:
        await servers.drain(0)


@contextlib.asynccontextmanager
async def extproc_channel(processor: Any, **options: Any) -> AsyncIterator[grpc.aio.Channel]:
    """``extproc_server``, and a channel to it."""
    async with extproc_server(processor, **options) as target:
        channel = grpc.aio.insecure_channel(target)
        try:
            yield channel
        finally:
            await channel.close()


def open_stream(channel: grpc.aio.Channel) -> Any:
    return pb_grpc.ExternalProcessorStub(channel).Process(timeout=30)


async def read_all(call: Any) -> tuple[list[Any], grpc.StatusCode, str]:
    """Every reply until the stream ends, and its final status and details."""
    replies = []
    try:
        while True:
            reply = await call.read()
            if reply is grpc.aio.EOF:
                break
            replies.append(reply)
    except grpc.aio.AioRpcError:
        pass
    return replies, await call.code(), await call.details() or ""
