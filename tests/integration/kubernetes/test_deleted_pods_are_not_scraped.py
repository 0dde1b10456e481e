"""Pods that leave the pool leave nothing behind in the scraper.

The InferencePool source over the loopback API server feeds the real datastore, collectors
and ``metrics-data-source``; each pod's model server is a loopback HTTP server on its own
127.0.0.x address. When a pod is deleted, its keep-alive scrape connection is closed and no
scrape goes to it any more; when a pod's IP changes, the connection to the old address is
closed and scrapes follow the new one. (Before: the source kept one connection, and its
state, per address it had ever scraped.)
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import pytest
from kubernetes.client import ApiClient

from adapters.prometheus.scrape import MetricsDataSource, MetricsSourceParameters
from domain.datalayer.collector import Collectors, SourceBinding
from domain.datalayer.plugins.core_metrics_extractor import (
    CoreMetricsExtractor,
    CoreMetricsExtractorParameters,
)
from domain.datastore import Datastore
from ports.plugins import TypedName
from tests.support.kube_api import (
    INFERENCE_POOLS_V1,
    PODS,
    KubeApiServer,
    inference_pool_v1,
    pod,
    pool_source,
    wait_until,
)
from tests.support.ports import free_port

MODEL = {"app": "model"}
BODY = b"vllm:num_requests_waiting 0\nvllm:num_requests_running 1\nvllm:kv_cache_usage_perc 0.5\n"
ANSWER = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(BODY) + BODY


@pytest.fixture
def server() -> Iterator[KubeApiServer]:
    with KubeApiServer() as api_server:
        yield api_server


@dataclass(slots=True)
class ModelServer:
    """Answers ``/metrics`` on one loopback address; counts scrapes and open connections."""

    ip: str
    scrapes: int = 0
    writers: set[asyncio.StreamWriter] = field(default_factory=set)

    @property
    def open_connections(self) -> int:
        return len(self.writers)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.add(writer)
        try:
            while True:
                await reader.readuntil(b"\r\n\r\n")
                self.scrapes += 1
                writer.write(ANSWER)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.writers.discard(writer)
            writer.close()


@contextlib.asynccontextmanager
async def model_servers(ips: tuple[str, ...]) -> AsyncIterator[tuple[int, dict[str, ModelServer]]]:
    port = free_port(*ips)
    servers = {ip: ModelServer(ip) for ip in ips}
    listening = [await asyncio.start_server(servers[ip].serve, ip, port) for ip in ips]
    try:
        yield port, servers
    finally:
        for listener in listening:
            listener.close()
        for model_server in servers.values():
            for writer in list(model_server.writers):
                writer.close()
        for listener in listening:
            await listener.wait_closed()


async def test_a_deleted_pod_keeps_no_connection_and_gets_no_scrape(
    server: KubeApiServer, api_client: ApiClient
) -> None:
    async with model_servers(("127.0.0.2", "127.0.0.3", "127.0.0.4")) as (port, servers):
        a, b, c = servers["127.0.0.2"], servers["127.0.0.3"], servers["127.0.0.4"]
        server.create(INFERENCE_POOLS_V1, inference_pool_v1("pool", selector=MODEL, ports=[port]))
        server.create(PODS, pod("a", ip=a.ip, labels=MODEL))
        server.create(PODS, pod("b", ip=b.ip, labels=MODEL))
        datastore = Datastore()
        source = MetricsDataSource(
            TypedName("metrics-data-source", "metrics-data-source"), MetricsSourceParameters()
        )
        extractor = CoreMetricsExtractor(
            TypedName("core-metrics-extractor", "core-metrics-extractor"),
            CoreMetricsExtractorParameters(),
        )
        collectors = Collectors(
            datastore=datastore, bindings=[SourceBinding(source, (extractor,))], interval=0.02
        )
        watching = asyncio.create_task(pool_source(api_client).run(datastore))
        collectors.start()
        try:
            await wait_until(lambda: a.scrapes >= 3 and b.scrapes >= 3, what="both scraped")
            assert source.open_connections == 2

            server.delete(PODS, "b")
            await wait_until(lambda: b.open_connections == 0, what="b's connection closed")
            assert source.open_connections == 1
            after_delete = b.scrapes
            scrapes_of_a = a.scrapes
            await wait_until(lambda: a.scrapes >= scrapes_of_a + 10, what="10 more scrapes of a")
            assert b.scrapes == after_delete, "a deleted pod was scraped"

            # a pod's new IP: the old address is let go, the new one scraped
            server.modify(PODS, "a", _set_ip(c.ip))
            await wait_until(lambda: c.scrapes >= 3, what="a scraped at its new address")
            await wait_until(lambda: a.open_connections == 0, what="old address let go")
            assert source.open_connections == 1
        finally:
            await collectors.stop()
            watching.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(watching, timeout=5)
        assert source.open_connections == 0


def _set_ip(ip: str):  # type: ignore[no-untyped-def]
    def change(obj: dict[str, object]) -> None:
        status = obj["status"]
        assert isinstance(status, dict)
        status["podIP"] = ip
        status["podIPs"] = [{"ip": ip}]

    return change
