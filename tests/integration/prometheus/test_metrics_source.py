"""``metrics-data-source`` against real HTTP servers on loopback: framing, reuse, faults."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web

from adapters.prometheus.http_client import HttpProtocolError
from adapters.prometheus.scrape import MetricsDataSource, MetricsSourceParameters
from ports.endpoints import EndpointAddress, EndpointInfo
from ports.plugins import TypedName

BODY = b'# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name="m"} 3\n'

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def _source(**parameters: object) -> MetricsDataSource:
    return MetricsDataSource(
        TypedName("metrics-data-source", "metrics-data-source"),
        MetricsSourceParameters(**parameters),  # type: ignore[arg-type]
    )


def _endpoint(port: int, path_host: str = "127.0.0.1") -> EndpointInfo:
    address = EndpointAddress(ip=path_host, port=port)
    return EndpointInfo(name=f"e-{port}", address=address, metrics_host=address.host_port())


@contextlib.asynccontextmanager
async def _raw_server(handler: Handler) -> AsyncIterator[tuple[int, list[int]]]:
    """A TCP server answering with ``handler``; yields its port and a connection counter."""
    connections: list[int] = []

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        try:
            await handler(reader, writer)
        finally:
            writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1], connections
    finally:
        server.close()
        await server.wait_closed()


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    return await reader.readuntil(b"\r\n\r\n")


async def test_keep_alive_reuses_one_connection_per_endpoint() -> None:
    hits = 0

    async def metrics(request: web.Request) -> web.Response:
        nonlocal hits
        hits += 1
        return web.Response(body=BODY, content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    source = _source()
    try:
        for _ in range(20):
            result = await source.poll(_endpoint(port))
            assert result.body == BODY
        assert hits == 20
        assert len(source._connections) == 1
    finally:
        await source.close()
        await runner.cleanup()


@pytest.mark.parametrize(
    "response",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(BODY) + BODY,
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b"%x\r\n" % 10
        + BODY[:10]
        + b"\r\n"
        + b"%x;ext=1\r\n" % (len(BODY) - 10)
        + BODY[10:]
        + b"\r\n0\r\nX-Trailer: t\r\n\r\n",
        b"HTTP/1.0 200 OK\r\n\r\n" + BODY,  # delimited by the end of the connection
        b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" % len(BODY) + BODY,
    ],
    ids=["content-length", "chunked", "http-1.0", "connection-close"],
)
async def test_response_framings(response: bytes) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                await _read_request(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            # Dribble the answer byte ranges to exercise partial reads.
            for i in range(0, len(response), 7):
                writer.write(response[i : i + 7])
                await writer.drain()
            if b"Connection: close" in response or response.startswith(b"HTTP/1.0"):
                return

    async with _raw_server(handler) as (port, connections):
        source = _source()
        try:
            for _ in range(3):
                assert (await source.poll(_endpoint(port))).body == BODY
        finally:
            await source.close()
    reused = b"Connection: close" not in response and not response.startswith(b"HTTP/1.0")
    assert len(connections) == (1 if reused else 3)


async def test_non_200_is_an_error_naming_the_status() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 4\r\n\r\nbusy")
        await writer.drain()
        await reader.read()

    async with _raw_server(handler) as (port, _):
        source = _source()
        with pytest.raises(ValueError, match="status 503"):
            await source.poll(_endpoint(port))
        await source.close()


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        (b"garbage\r\n\r\n", HttpProtocolError),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort", ConnectionError),
        (b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n", HttpProtocolError),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", HttpProtocolError),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 999999999999\r\n\r\n", HttpProtocolError),
    ],
    ids=["not-http", "truncated", "bad-length", "bad-chunk", "too-large"],
)
async def test_malformed_answers_fail_and_the_next_poll_reconnects(
    answer: bytes, error: type[Exception]
) -> None:
    answers = [answer, b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(BODY) + BODY]

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(answers.pop(0))
        await writer.drain()
        if answers:  # the faulty one: hang up (the truncated case) or wait to be dropped
            return
        await reader.read()

    async with _raw_server(handler) as (port, connections):
        source = _source()
        with pytest.raises(error):
            await source.poll(_endpoint(port))
        assert (await source.poll(_endpoint(port))).body == BODY
        await source.close()
    assert len(connections) == 2


async def test_a_hanging_server_times_out_and_the_connection_is_replaced() -> None:
    answered = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        if not answered.is_set():
            answered.set()
            await reader.read()  # never answer this connection
            return
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(BODY) + BODY)
        await writer.drain()
        await reader.read()

    async with _raw_server(handler) as (port, connections):
        source = _source()
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                await source.poll(_endpoint(port))
        assert (await source.poll(_endpoint(port))).body == BODY
        await source.close()
    assert len(connections) == 2


async def test_nothing_listening_is_an_os_error() -> None:
    async with _raw_server(lambda r, w: asyncio.sleep(0)) as (port, _):
        pass  # the port is closed again now
    source = _source()
    with pytest.raises(ConnectionRefusedError):
        await source.poll(_endpoint(port))
    await source.close()


def test_parameters_are_validated() -> None:
    with pytest.raises(ValueError, match="scheme"):
        MetricsSourceParameters(scheme="ftp")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="path"):
        MetricsSourceParameters(path="metrics")


def test_it_runs_on_uvloop() -> None:
    uvloop = pytest.importorskip("uvloop")

    async def scenario() -> bytes:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await _read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(BODY) + BODY)
            await writer.drain()
            await reader.read()

        async with _raw_server(handler) as (port, _):
            source = _source()
            try:
                return (await source.poll(_endpoint(port))).body
            finally:
                await source.close()

    assert uvloop.run(scenario()) == BODY
