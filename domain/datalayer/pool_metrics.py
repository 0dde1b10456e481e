"""Periodic gauges: the pool's averages over its endpoints, and the prefix index's size.

``PoolMetricsReporter`` runs every ``--refresh-prometheus-metrics-interval`` (5 s) over the
endpoints whose metrics are fresher than ``--metrics-staleness-threshold`` (2 s), as the
reference: ``POOL_AVERAGE_KV_CACHE``, ``POOL_AVERAGE_QUEUE_SIZE``,
``POOL_AVERAGE_RUNNING_REQUESTS`` and ``POOL_READY_PODS`` (the number of fresh endpoints),
all labelled ``{name=<pool>}``, with the spread (population standard deviation) of the
three averaged values over the same endpoints, under the llm-d router's names; and
``POOL_PER_POD_QUEUE_SIZE{name, model_server_pod}`` for every endpoint with metrics
(entries of ``ports.metric_catalogue``). When no endpoint is fresh, ``ready_pods`` is 0 and
the averages keep their last values. The queue size of an endpoint that is gone is removed
(reported as NaN, which the exporter takes as "gone").

``PrefixIndexSizeReporter`` reports ``PREFIX_INDEXER_SIZE`` every second (when the index
knows its size).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable

from domain.datastore.store import Datastore
from ports.metric_catalogue import (
    POOL_AVERAGE_KV_CACHE,
    POOL_AVERAGE_QUEUE_SIZE,
    POOL_AVERAGE_RUNNING_REQUESTS,
    POOL_PER_POD_QUEUE_SIZE,
    POOL_READY_PODS,
    POOL_STD_DEV_KV_CACHE,
    POOL_STD_DEV_QUEUE_SIZE,
    POOL_STD_DEV_RUNNING_REQUESTS,
    PREFIX_INDEXER_SIZE,
)
from ports.observer import Observer
from ports.prefix_index import PrefixIndex

__all__ = ["PoolMetricsReporter", "PrefixIndexSizeReporter"]

logger = logging.getLogger(__name__)


class PoolMetricsReporter:
    """Reports the pool gauges; ``report`` once, ``run`` every ``interval`` until cancelled."""

    def __init__(
        self,
        *,
        datastore: Datastore,
        observer: Observer,
        pool_name: str,
        interval: float,
        staleness_threshold: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._datastore = datastore
        self._observer = observer
        self._pool = {"name": pool_name}
        self._interval = interval
        self._staleness = staleness_threshold
        self._clock = clock
        self._pods: set[str] = set()

    def report(self) -> None:
        observer = self._observer
        now = self._clock()
        kv_cache: list[float] = []
        queued: list[float] = []
        running: list[float] = []
        pods: set[str] = set()
        pool_name = self._pool["name"]
        for endpoint in self._datastore.endpoints():
            metrics = endpoint.metrics
            if metrics is None:
                continue
            pods.add(endpoint.name)
            observer.gauge(
                POOL_PER_POD_QUEUE_SIZE,
                {"name": pool_name, "model_server_pod": endpoint.name},
                metrics.waiting_queue_size,
            )
            if now - metrics.update_time > self._staleness:
                continue
            kv_cache.append(metrics.kv_cache_usage_percent)
            queued.append(metrics.waiting_queue_size)
            running.append(metrics.running_requests_size)
        for gone in self._pods - pods:
            observer.gauge(
                POOL_PER_POD_QUEUE_SIZE, {"name": pool_name, "model_server_pod": gone}, math.nan
            )
        self._pods = pods
        observer.gauge(POOL_READY_PODS, self._pool, len(kv_cache))
        if kv_cache:
            for values, average, spread in (
                (kv_cache, POOL_AVERAGE_KV_CACHE, POOL_STD_DEV_KV_CACHE),
                (queued, POOL_AVERAGE_QUEUE_SIZE, POOL_STD_DEV_QUEUE_SIZE),
                (running, POOL_AVERAGE_RUNNING_REQUESTS, POOL_STD_DEV_RUNNING_REQUESTS),
            ):
                mean = sum(values) / len(values)
                observer.gauge(average, self._pool, mean)
                variance = sum((v - mean) ** 2 for v in values) / len(values)
                observer.gauge(spread, self._pool, math.sqrt(variance))

    async def run(self) -> None:
        while True:
            try:
                self.report()
            except Exception:  # a reporting bug must not stop the loop
                logger.exception("reporting the pool metrics failed")
            await asyncio.sleep(self._interval)


class PrefixIndexSizeReporter:
    """Reports the prefix index's entry count every ``interval`` seconds (default 1 s)."""

    def __init__(self, *, index: PrefixIndex, observer: Observer, interval: float = 1.0) -> None:
        self._index = index
        self._observer = observer
        self._interval = interval

    def report(self) -> None:
        size = self._index.size()
        if size >= 0:
            self._observer.gauge(PREFIX_INDEXER_SIZE, {}, size)

    async def run(self) -> None:
        while True:
            try:
                self.report()
            except Exception:
                logger.exception("reporting the prefix index size failed")
            await asyncio.sleep(self._interval)
