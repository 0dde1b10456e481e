"""Finding 10: a model server whose ``/metrics`` lacks one of the families the extractor
reads (an older or newer engine version) still has the metrics it does expose applied;
what is missing is logged once per endpoint per change, not on every poll, and is not a
scrape error.
"""

from __future__ import annotations

import asyncio
import logging

import pytest

from adapters.prometheus.scrape import MetricsDataSource, MetricsSourceParameters
from domain.datalayer.collector import Collectors, SourceBinding
from domain.datalayer.plugins.core_metrics_extractor import (
    CoreMetricsExtractor,
    CoreMetricsExtractorParameters,
)
from domain.datastore import Datastore
from ports.endpoints import EndpointAddress, EndpointEvent, EndpointEventKind, EndpointInfo
from ports.metric_catalogue import SCRAPE_ERRORS
from ports.plugins import TypedName
from tests.adversarial.support import RawServer, raw_server, wait_for
from tests.fakes.observer import RecordingObserver

#: a vLLM without ``vllm:num_requests_waiting`` (renamed in some other version)
PARTIAL = b"vllm:num_requests_running 7\nvllm:kv_cache_usage_perc 0.25\n"
COMPLETE = PARTIAL + b"vllm:num_requests_waiting 4\n"
MISSING = 'metric family "vllm:num_requests_waiting" not found'


async def test_partial_metrics_are_applied_and_the_missing_family_is_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    body = PARTIAL

    async def server_handler(
        server: RawServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        while await server.read_request(reader):
            head = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body)
            await server.send(writer, head + body)

    caplog.set_level(logging.INFO, logger="domain.datalayer.collector")
    async with raw_server(server_handler) as server:
        datastore = Datastore()
        info = EndpointInfo(
            name="old-vllm", address=EndpointAddress(ip="127.0.0.1", port=server.port)
        )
        datastore.apply(EndpointEvent(kind=EndpointEventKind.ADD_OR_UPDATE, endpoint=info))
        endpoint = datastore.get("old-vllm")
        assert endpoint is not None
        observer = RecordingObserver()
        collectors = Collectors(
            datastore=datastore,
            bindings=[
                SourceBinding(
                    MetricsDataSource(
                        TypedName("metrics-data-source", "metrics-data-source"),
                        MetricsSourceParameters(),
                    ),
                    (
                        CoreMetricsExtractor(
                            TypedName("core-metrics-extractor", "core-metrics-extractor"),
                            CoreMetricsExtractorParameters(),
                        ),
                    ),
                )
            ],
            interval=0.02,
            observer=observer,
        )
        collectors.start()
        try:
            await wait_for(lambda: server.requests >= 20, within=10.0, what="20 polls")
            metrics = endpoint.metrics
            assert metrics is not None, "the metrics that were there were not applied"
            assert (metrics.running_requests_size, metrics.kv_cache_usage_percent) == (7, 0.25)
            assert metrics.waiting_queue_size == 0  # never seen
            first_update = metrics.update_time
            await wait_for(
                lambda: (
                    endpoint.metrics is not None and endpoint.metrics.update_time > first_update
                ),
                within=5.0,
                what="the next poll to update the endpoint",
            )
            assert MISSING in (collectors.error_of("old-vllm") or "")

            body = COMPLETE  # the server is upgraded
            await wait_for(
                lambda: endpoint.metrics is not None and endpoint.metrics.waiting_queue_size == 4,
                within=5.0,
                what="the complete metrics applied",
            )
            await wait_for(
                lambda: collectors.error_of("old-vllm") is None, within=5.0, what="no error"
            )
        finally:
            await collectors.stop()

    lines = [r.getMessage() for r in caplog.records]
    incomplete = [line for line in lines if MISSING in line]
    assert len(incomplete) == 1, lines  # once, not once per poll (20+ polls)
    assert "metrics incomplete" in incomplete[0]
    assert "endpoint old-vllm: metrics complete again" in lines
    assert not any("metrics collection failing" in line for line in lines)
    assert observer.total(SCRAPE_ERRORS, endpoint="old-vllm") == 0
