"""Finding: the body's ``model`` became a Prometheus label without a bound.

One request with a 1 MB model name made ``/metrics`` 337 MB, 20,000 distinct names made
620k series that never expire, and ``/metrics`` was rendered on the event loop, so routing
stalled while it was (up to 11.8 s). Now request-derived label values are bounded in the
exporter (longer than 256 characters, or beyond 1,000 distinct values: ``other``) and
``/metrics`` is rendered in a worker thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import grpc
import pytest
from prometheus_client.metrics_core import GaugeMetricFamily
from prometheus_client.registry import Collector

from adapters.prometheus.exporter import (
    OTHER_LABEL,
    MetricsServer,
    PrometheusObserver,
)
from domain.requestcontrol.metrics import RequestMetrics
from ports.errors import ErrorCode
from tests.adversarial.extproc_support import (
    CountingProcessor,
    director_over,
    extproc_channel,
    open_stream,
    read_all,
)
from tests.support.extproc import envoy_headers, request_body_chunks, request_headers

_MODEL_LABEL = re.compile(rb'model_name="((?:[^"\\]|\\.)*)"')


@contextlib.asynccontextmanager
async def _metrics_server(observer: PrometheusObserver) -> AsyncIterator[str]:
    server = MetricsServer(observer.registry, host="127.0.0.1", port=0)
    await server.start()
    try:
        yield f"http://127.0.0.1:{server.bound_port}/metrics"
    finally:
        await server.stop()


async def _scrape(url: str) -> bytes:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        assert response.status == 200
        return await response.read()


async def _route(channel: grpc.aio.Channel, model: str) -> str:
    """One completion through the ext_proc stream; the kind of the first reply."""
    body = json.dumps({"model": model, "prompt": "hello", "max_tokens": 4}).encode()
    call = open_stream(channel)
    await call.write(request_headers(envoy_headers()))
    for message in request_body_chunks(body):
        await call.write(message)
    await call.done_writing()
    replies, code, details = await read_all(call)
    assert code == grpc.StatusCode.OK, details
    return str(replies[0].WhichOneof("response"))


@pytest.mark.usefixtures("each_transport")
async def test_a_1mb_model_name_does_not_reach_metrics() -> None:
    observer = PrometheusObserver()
    director, _ = director_over(None, observer=observer)
    processor = CountingProcessor(director)
    huge = "m" * (1 << 20)
    async with extproc_channel(processor) as channel, _metrics_server(observer) as url:
        assert await _route(channel, huge) == "request_headers"
        assert await _route(channel, "llama") == "request_headers"
        await processor.wait_all_closed()
        text = await _scrape(url)
    # before: the name in every per-request series, tens of MB; after: a few KB
    assert len(text) < 64 * 1024, len(text)
    assert b"m" * 300 not in text
    models = set(_MODEL_LABEL.findall(text))
    assert models == {b"llama", OTHER_LABEL.encode()}, models
    assert re.search(
        rb'inference_objective_request_total\{model_name="other",priority="0",'
        rb'target_model_name="other"\} 1\.0',
        text,
    ), text.decode()[:2000]


def _labels(model: str) -> dict[str, str]:
    return {
        "model_name": model,
        "target_model_name": model,
        "fairness_id": "default-flow",
        "priority": "0",
    }


def _requests(metrics: RequestMetrics, models: Iterator[str]) -> None:
    """What the Director records for each request: routed, completed, closed, and an error."""
    for model in models:
        labels = _labels(model)
        metrics.routed(labels, 100)
        metrics.completed(labels, 0.1, 200, None)
        metrics.failed(labels, ErrorCode.BAD_REQUEST)
        metrics.closed(labels)


async def test_five_times_the_cap_of_model_names_stays_within_it() -> None:
    # A cap of 100 rather than the default 1,000: the same folding, a tenth of the render.
    cap, names = 100, 500
    observer = PrometheusObserver(max_label_values=cap)
    metrics = RequestMetrics(observer)
    async with _metrics_server(observer) as url:
        _requests(metrics, (f"model-{i}" for i in range(cap)))
        at_cap = await _scrape(url)
        _requests(metrics, (f"model-{i}" for i in range(cap, names)))
        after = await _scrape(url)
    models = set(_MODEL_LABEL.findall(after))
    assert len(models) == cap + 1, len(models)
    assert OTHER_LABEL.encode() in models
    # before: 5x the series (and the text) of the capped names; after: one "other" more
    assert len(after) < len(at_cap) * 1.02, (len(at_cap), len(after))
    total = re.search(
        rb'inference_objective_request_total\{model_name="other",priority="0",'
        rb'target_model_name="other"\} (\S+)',
        after,
    )
    assert total is not None
    assert float(total.group(1)) == names - cap


async def test_a_gauge_beyond_the_cap_shows_the_sum_of_the_folded_series() -> None:
    observer = PrometheusObserver(max_label_values=1)
    metrics = RequestMetrics(observer)
    for model in ("a", "b", "c", "c"):
        metrics.routed(_labels(model), 10)
    async with _metrics_server(observer) as url:
        text = await _scrape(url)
        assert b'inference_objective_running_requests{model_name="a"} 1.0' in text
        assert b'inference_objective_running_requests{model_name="other"} 3.0' in text
        for model in ("b", "c", "c"):
            metrics.closed(_labels(model))
        text = await _scrape(url)
        assert b'inference_objective_running_requests{model_name="other"} 0.0' in text


class _SlowCollector(Collector):
    """A collector that takes until released (at most ``limit`` s): a slow render."""

    def __init__(self, limit: float) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.limit = limit

    def describe(self) -> Iterator[Any]:
        return iter(())

    def collect(self) -> Iterator[Any]:
        self.entered.set()
        self.release.wait(self.limit)
        yield GaugeMetricFamily("slow_render", "a render that takes a while", value=1.0)


@pytest.mark.usefixtures("each_transport")
async def test_routing_goes_on_while_metrics_render() -> None:
    observer = PrometheusObserver()
    slow = _SlowCollector(limit=3.0)
    observer.registry.register(slow)
    director, _ = director_over(None, observer=observer)
    processor = CountingProcessor(director)
    async with extproc_channel(processor) as channel, _metrics_server(observer) as url:
        scrape = asyncio.create_task(_scrape(url))
        started = time.monotonic()
        while not slow.entered.is_set():
            assert time.monotonic() - started < 5, "the scrape never reached the collector"
            await asyncio.sleep(0.005)
        latencies = []
        for _ in range(20):
            before = time.monotonic()
            assert await _route(channel, "llama") == "request_headers"
            latencies.append(time.monotonic() - before)
        render_was_running = not slow.release.is_set() and not scrape.done()
        slow.release.set()
        text = await scrape
        await processor.wait_all_closed()
    assert b"slow_render 1.0" in text
    assert render_was_running
    # before: the first request waited for the whole render (the 3 s limit); after: routed
    # while the render runs in its thread
    assert max(latencies) < 1.0, latencies
