"""Finding 2: a model server's hostile ``/metrics`` framing must not stall or bloat the EPP.

The scrape client decodes chunked bodies in linear time, caps the chunk-size line, the
declared chunk size, the whole body (``max_body_bytes``) and the number of chunks (past the
first 1,024, chunks must average 128 bytes: each costs the event loop about a microsecond
however small), and fails that scrape with a clear error, while other endpoints keep being
scraped on time.
"""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest

from adapters.prometheus.http_client import HttpGetConnection, HttpProtocolError
from adapters.prometheus.scrape import MetricsDataSource, MetricsSourceParameters
from domain.datalayer.collector import Collectors, SourceBinding
from domain.datalayer.plugins.core_metrics_extractor import (
    CoreMetricsExtractor,
    CoreMetricsExtractorParameters,
)
from domain.datastore import Datastore
from ports.endpoints import EndpointAddress, EndpointEvent, EndpointEventKind, EndpointInfo
from ports.plugins import TypedName
from tests.adversarial.support import RawServer, loop_lag, peak_memory, raw_server, wait_for

MiB = 1024 * 1024
#: a bounded time for a hostile scrape to fail (the collector's poll timeout is 1 s)
FAIL_WITHIN = 2.0
#: the longest the event loop may be blocked while hostile scrapes run (measured at about
#: 10-120 ms on shared cores; before the fix, 4 s to minutes)
MAX_LAG = 0.5
HEALTHY_BODY = (
    b"vllm:num_requests_waiting 2\nvllm:num_requests_running 3\nvllm:kv_cache_usage_perc 0.5\n"
)
CHUNKED_HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
BLOCK = b"f" * 65_536


def _source(**kw: int) -> MetricsDataSource:
    return MetricsDataSource(
        TypedName("metrics-data-source", "metrics-data-source"), MetricsSourceParameters(), **kw
    )


def _endpoint(port: int) -> EndpointInfo:
    address = EndpointAddress(ip="127.0.0.1", port=port)
    return EndpointInfo(name=f"e-{port}", address=address)


def one_byte_chunks(body: bytes) -> bytes:
    return b"".join(b"1\r\n%c\r\n" % b for b in body) + b"0\r\n\r\n"


async def serve_one_byte_chunks(
    server: RawServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    body = HEALTHY_BODY + b"#" * (94_000 - len(HEALTHY_BODY) - 1) + b"\n"
    answer = CHUNKED_HEAD + one_byte_chunks(body)
    while await server.read_request(reader):
        await server.send(writer, answer)


async def serve_endless_size_line(
    server: RawServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    if await server.read_request(reader):
        await server.send(writer, CHUNKED_HEAD)
        while True:  # hex digits, never a CRLF
            await server.send(writer, BLOCK)


async def serve_one_gib_chunk(
    server: RawServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    if await server.read_request(reader):
        await server.send(writer, CHUNKED_HEAD + b"40000000\r\n")
        while True:
            await server.send(writer, BLOCK)


async def serve_endless_small_chunks(
    server: RawServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    if await server.read_request(reader):
        await server.send(writer, CHUNKED_HEAD)
        chunk = b"%x\r\n" % len(BLOCK) + BLOCK + b"\r\n"
        while True:
            await server.send(writer, chunk)


async def test_one_byte_chunks_are_refused_after_the_free_chunks() -> None:
    async with raw_server(serve_one_byte_chunks) as server:
        source = _source()
        try:
            async with loop_lag() as lag:
                with pytest.raises(HttpProtocolError, match="1025 chunks averaging fewer than"):
                    async with asyncio.timeout(FAIL_WITHIN):
                        await source.poll(_endpoint(server.port))
        finally:
            await source.close()
    assert lag.worst < MAX_LAG, f"the event loop was blocked {lag.worst:.3f}s"


@pytest.mark.parametrize("size", [1, 160, 4096])
async def test_chunked_bodies_decode_in_linear_time(size: int) -> None:
    """Many chunks of a real server's sizes (line by line, buffered) decode whole; one-byte
    chunks while they are within the free chunks."""
    line = b"vllm:num_requests_waiting 2 " + b"#" * (size - 29) + b"\n" if size > 29 else b"#"
    count = 1022 if size == 1 else 200_000 // size  # 1,022 + 2: the free chunks

    async def serve(
        server: RawServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        pieces = [HEALTHY_BODY[:-1], *([line] * count)]
        chunks = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces)
        answer = CHUNKED_HEAD + chunks + b"1\r\n\n\r\n0\r\n\r\n"
        while await server.read_request(reader):
            await server.send(writer, answer)

    async with raw_server(serve) as server:
        source = _source()
        try:
            async with loop_lag() as lag:
                # CPU time of this process (the server runs here too): a loaded machine
                # stretches the wall clock, not the work a quadratic decoder would do.
                started = time.process_time()
                result = await source.poll(_endpoint(server.port))
                took = time.process_time() - started
        finally:
            await source.close()
    assert result.body == HEALTHY_BODY[:-1] + line * count + b"\n"
    assert took < FAIL_WITHIN, f"{count} chunks of {size} bytes took {took:.2f}s of CPU"
    assert lag.worst < MAX_LAG, f"the event loop was blocked {lag.worst:.3f}s"


@pytest.mark.parametrize(
    ("handler", "message"),
    [
        (serve_endless_size_line, "chunk-size line longer than"),
        (serve_one_gib_chunk, "chunk of 1073741824 bytes"),
        (serve_endless_small_chunks, "body larger than"),
    ],
    ids=["endless-size-line", "one-gib-chunk", "endless-chunks"],
)
async def test_hostile_chunking_fails_fast_in_bounded_memory(handler: object, message: str) -> None:
    async with raw_server(handler) as server:  # type: ignore[arg-type]
        source = _source(max_body_bytes=4 * MiB)
        try:
            with peak_memory() as peak:
                async with loop_lag() as lag:
                    started = time.perf_counter()
                    with pytest.raises(HttpProtocolError, match=message):
                        async with asyncio.timeout(FAIL_WITHIN):
                            await source.poll(_endpoint(server.port))
                    took = time.perf_counter() - started
        finally:
            await source.close()
    assert took < FAIL_WITHIN
    assert lag.worst < MAX_LAG, f"the event loop was blocked {lag.worst:.3f}s"
    # the body limit (4 MiB) plus a read's worth of buffer, not what the server offered
    assert peak.bytes < 12 * MiB, f"memory grew by {peak.bytes / MiB:.0f} MiB"


def test_the_default_body_limit_is_16_mib() -> None:
    assert HttpGetConnection()._max_body == 16 * MiB


async def test_a_healthy_endpoint_keeps_being_updated_beside_a_hostile_one() -> None:
    attacks = [serve_one_byte_chunks, serve_endless_size_line, serve_one_gib_chunk]

    async def hostile(
        server: RawServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        await attacks[server.connections % len(attacks)](server, reader, writer)

    async def healthy(
        server: RawServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        answer = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(HEALTHY_BODY)
        while await server.read_request(reader):
            await server.send(writer, answer + HEALTHY_BODY)

    async with raw_server(hostile) as bad, raw_server(healthy) as good:
        datastore = Datastore()
        for port in (bad.port, good.port):
            datastore.apply(
                EndpointEvent(kind=EndpointEventKind.ADD_OR_UPDATE, endpoint=_endpoint(port))
            )
        good_endpoint = datastore.get(f"e-{good.port}")
        assert good_endpoint is not None
        updates: list[float] = []

        def on_update() -> None:
            metrics = good_endpoint.metrics
            if metrics is not None and (not updates or updates[-1] != metrics.update_time):
                updates.append(metrics.update_time)

        extractor = CoreMetricsExtractor(
            TypedName("core-metrics-extractor", "core-metrics-extractor"),
            CoreMetricsExtractorParameters(),
        )
        collectors = Collectors(
            datastore=datastore,
            bindings=[SourceBinding(_source(max_body_bytes=4 * MiB), (extractor,))],
            interval=0.05,
            poll_timeout=1.0,
            on_update=on_update,
        )
        async with loop_lag() as lag:
            collectors.start()
            try:
                await wait_for(
                    lambda: bad.connections >= 3 and bad.requests >= 5 and len(updates) >= 20,
                    within=10.0,
                    what="every attack served and twenty healthy updates",
                )
            finally:
                await collectors.stop()
    gaps = [b - a for a, b in itertools.pairwise(updates)]
    # every 50 ms when healthy (measured up to 0.25 s on shared cores); before, seconds
    assert max(gaps) < 1.0, f"the healthy endpoint went {max(gaps):.2f}s without an update"
    assert lag.worst < MAX_LAG, f"the event loop was blocked {lag.worst:.3f}s"
    assert collectors.error_of(f"e-{good.port}") is None
