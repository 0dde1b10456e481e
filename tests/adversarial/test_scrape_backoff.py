"""Finding 9: a failing scrape is retried with exponential backoff and jitter, not every
50 ms; one successful poll brings the endpoint back to the normal interval.

Counted on the wire: the requests a failing loopback server receives while a healthy
endpoint beside it is scraped 40 times (about 2 s at the 50 ms interval).
"""

from __future__ import annotations

import asyncio
import random

from adapters.prometheus.scrape import MetricsDataSource, MetricsSourceParameters
from domain.datalayer.collector import Collectors, SourceBinding
from domain.datalayer.plugins.core_metrics_extractor import (
    CoreMetricsExtractor,
    CoreMetricsExtractorParameters,
)
from domain.datastore import Datastore
from ports.endpoints import EndpointAddress, EndpointEvent, EndpointEventKind, EndpointInfo
from ports.plugins import TypedName
from tests.adversarial.support import RawServer, raw_server, wait_for

INTERVAL = 0.05
BODY = b"vllm:num_requests_waiting 1\nvllm:num_requests_running 2\nvllm:kv_cache_usage_perc 0.25\n"
OK = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(BODY) + BODY
FAILING = b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 4\r\n\r\nboom"


def _endpoint(port: int) -> EndpointInfo:
    return EndpointInfo(name=f"e-{port}", address=EndpointAddress(ip="127.0.0.1", port=port))


def _collectors(datastore: Datastore, **kw: object) -> Collectors:
    source = MetricsDataSource(
        TypedName("metrics-data-source", "metrics-data-source"), MetricsSourceParameters()
    )
    extractor = CoreMetricsExtractor(
        TypedName("core-metrics-extractor", "core-metrics-extractor"),
        CoreMetricsExtractorParameters(),
    )
    return Collectors(
        datastore=datastore,
        bindings=[SourceBinding(source, (extractor,))],
        interval=INTERVAL,
        **kw,  # type: ignore[arg-type]
    )


async def test_a_failing_endpoint_is_polled_with_backoff_and_recovers_at_once() -> None:
    failing = True

    async def flaky(
        server: RawServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        while await server.read_request(reader):
            await server.send(writer, FAILING if failing else OK)

    async def healthy(
        server: RawServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        while await server.read_request(reader):
            await server.send(writer, OK)

    async with raw_server(flaky) as bad, raw_server(healthy) as good:
        datastore = Datastore()
        for port in (bad.port, good.port):
            datastore.apply(
                EndpointEvent(kind=EndpointEventKind.ADD_OR_UPDATE, endpoint=_endpoint(port))
            )
        collectors = _collectors(datastore)
        collectors.start()
        try:
            await wait_for(lambda: good.requests >= 40, within=10.0, what="40 healthy polls")
            # 40 polls of the healthy one: without backoff the failing one gets as many
            assert bad.requests <= 10, f"a failing endpoint was polled {bad.requests} times"
            assert "status 500" in (collectors.error_of(f"e-{bad.port}") or "")

            failing = False  # it recovers: the next retry succeeds (at most 1 s away)...
            await wait_for(
                lambda: collectors.error_of(f"e-{bad.port}") is None,
                within=10.0,
                what="the recovered endpoint polled again",
            )
            # ...and from then on it is polled every interval again
            recovered_at = bad.requests
            good_at = good.requests
            await wait_for(
                lambda: good.requests >= good_at + 20, within=10.0, what="20 more healthy polls"
            )
            assert bad.requests >= recovered_at + 15
        finally:
            await collectors.stop()


def test_backoff_doubles_from_the_interval_with_jitter_up_to_the_cap() -> None:
    collectors = Collectors(
        datastore=Datastore(),
        bindings=[],
        interval=INTERVAL,
        max_backoff=5.0,
        rng=random.Random(7),
    )
    for failures in range(1, 40):
        ceiling = min(5.0, INTERVAL * 2**failures)
        for _ in range(20):
            delay = collectors.backoff_delay(failures)
            assert ceiling / 2 <= delay <= ceiling
    # by default the cap is 1 s (the 50 ms interval doubled 4-5 times): a twentieth of
    # the polls, and a recovered endpoint is seen within a second
    default = Collectors(datastore=Datastore(), bindings=[], interval=INTERVAL)
    assert 0.5 <= default.backoff_delay(30) <= 1.0
    # jitter: failing endpoints do not retry in lockstep
    assert len({round(collectors.backoff_delay(10), 6) for _ in range(20)}) > 10
