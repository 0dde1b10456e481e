"""Data-layer metrics: scrape errors per endpoint, pool gauges, the prefix index size."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from domain.datalayer.collector import Collectors, SourceBinding
from domain.datalayer.pool_metrics import PoolMetricsReporter, PrefixIndexSizeReporter
from domain.datastore.endpoint import EndpointMetrics
from domain.datastore.store import Datastore
from domain.prefixcache.index import InMemoryPrefixIndex
from ports import metric_catalogue as catalogue
from ports.endpoints import EndpointEvent, EndpointEventKind, EndpointInfo
from ports.plugins import TypedName
from tests.fakes.observer import RecordingObserver
from tests.unit.observability.support import populated_datastore


class _Source:
    """Fails for the endpoints named in ``failing``; answers the others."""

    typed_name = TypedName("fake-source", "fake-source")

    def __init__(self, failing: set[str]) -> None:
        self.failing = failing
        self.polls: dict[str, int] = {}

    def output_type(self) -> type:
        return bytes

    async def poll(self, endpoint: EndpointInfo) -> object:
        self.polls[endpoint.name] = self.polls.get(endpoint.name, 0) + 1
        if endpoint.name in self.failing:
            raise OSError("connection refused")
        return b""

    async def close(self) -> None:
        return None


async def _until(condition: Callable[[], bool]) -> None:
    """Poll ``condition`` until it holds; fail after 5 s."""
    deadline = time.monotonic() + 5
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


async def test_every_failed_poll_counts_for_its_endpoint() -> None:
    store = populated_datastore()
    names = [e.name for e in store.endpoints()]
    source = _Source({names[0]})
    observer = RecordingObserver()
    collectors = Collectors(
        datastore=store,
        bindings=[SourceBinding(source, ())],
        interval=0.005,
        observer=observer,
    )
    collectors.start()
    try:
        await _until(lambda: source.polls.get(names[0], 0) >= 3 and names[1] in source.polls)
    finally:
        await collectors.stop()
    failed = source.polls[names[0]]
    assert observer.total(catalogue.SCRAPE_ERRORS, endpoint=names[0]) in (failed - 1, failed)
    assert observer.total(catalogue.SCRAPE_ERRORS, endpoint=names[0]) >= 3
    assert observer.total(catalogue.SCRAPE_ERRORS, endpoint=names[1]) == 0


def _metrics(queue: int, running: int, kv: float, at: float) -> EndpointMetrics:
    return EndpointMetrics(
        waiting_queue_size=queue,
        running_requests_size=running,
        kv_cache_usage_percent=kv,
        update_time=at,
    )


def test_pool_gauges_average_over_fresh_endpoints_only() -> None:
    now = 100.0
    store = populated_datastore()
    a, b, c = store.endpoints()
    a.metrics = _metrics(2, 4, 0.2, at=now - 1)
    b.metrics = _metrics(4, 8, 0.6, at=now - 0.5)
    c.metrics = _metrics(100, 100, 1.0, at=now - 10)  # stale
    observer = RecordingObserver()
    reporter = PoolMetricsReporter(
        datastore=store,
        observer=observer,
        pool_name="pool",
        interval=5,
        staleness_threshold=2,
        clock=lambda: now,
    )
    reporter.report()
    assert observer.gauge_value(catalogue.POOL_READY_PODS, name="pool") == 2
    assert observer.gauge_value(catalogue.POOL_AVERAGE_QUEUE_SIZE, name="pool") == 3
    assert observer.gauge_value(catalogue.POOL_AVERAGE_RUNNING_REQUESTS, name="pool") == 6
    kv = observer.gauge_value(catalogue.POOL_AVERAGE_KV_CACHE, name="pool")
    assert kv is not None
    assert abs(kv - 0.4) < 1e-9
    per_pod = catalogue.POOL_PER_POD_QUEUE_SIZE
    assert observer.gauge_value(per_pod, name="pool", model_server_pod=c.name) == 100
    assert observer.gauge_value(per_pod, name="pool", model_server_pod=a.name) == 2


def test_a_gone_endpoint_loses_its_queue_gauge_and_no_fresh_endpoint_means_zero_ready() -> None:
    store = populated_datastore(now=0.0)
    gone = store.endpoints()[0]
    observer = RecordingObserver()
    reporter = PoolMetricsReporter(
        datastore=store,
        observer=observer,
        pool_name="pool",
        interval=5,
        staleness_threshold=2,
        clock=lambda: 60.0,  # every endpoint is stale
    )
    reporter.report()
    assert observer.gauge_value(catalogue.POOL_READY_PODS) == 0
    assert observer.gauge_value(catalogue.POOL_AVERAGE_QUEUE_SIZE) is None
    store.apply(EndpointEvent(kind=EndpointEventKind.DELETE, endpoint=gone.info))
    reporter.report()
    value = observer.gauge_value(
        catalogue.POOL_PER_POD_QUEUE_SIZE, name="pool", model_server_pod=gone.name
    )
    assert value is not None
    assert value != value  # NaN: the exporter drops the series


async def test_the_reporters_run_until_cancelled() -> None:
    index = InMemoryPrefixIndex()
    await index.add([1, 2, 3], "10.0.0.1:8000", 100)
    observer = RecordingObserver()
    prefix = PrefixIndexSizeReporter(index=index, observer=observer, interval=0.005)
    pool = PoolMetricsReporter(
        datastore=Datastore(),
        observer=observer,
        pool_name="p",
        interval=0.005,
        staleness_threshold=2,
    )
    tasks = [asyncio.create_task(prefix.run()), asyncio.create_task(pool.run())]
    try:
        await _until(
            lambda: (
                len(observer.gauges) >= 6
                and observer.gauge_value(catalogue.PREFIX_INDEXER_SIZE) == 3
            )
        )
        await index.add([4], "10.0.0.2:8000", 100)
        await _until(lambda: observer.gauge_value(catalogue.PREFIX_INDEXER_SIZE) == 4)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    assert observer.gauge_value(catalogue.POOL_READY_PODS, name="p") == 0
