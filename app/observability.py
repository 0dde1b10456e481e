"""Observability wired together: Prometheus metrics, OpenTelemetry traces, periodic gauges.

``EppObserver`` is the one ``Observer`` the process hands to the domain and the adapters:
metrics go to the ``PrometheusObserver`` (always on, as the reference), spans to
``OtelTracing`` when ``--tracing`` is on, else nowhere. ``Observability`` owns the
lifecycle: the ``/metrics`` server on ``--metrics-port``, the pool gauges every
``--refresh-prometheus-metrics-interval``, the prefix index size every second, the build
info gauge, and flushing traces at shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import logging
import os
import ssl
from collections.abc import Mapping

from adapters.otel.tracing import OtelTracing
from adapters.prometheus.exporter import MetricsServer, PrometheusObserver, TextPage
from app.settings import Settings
from domain.datalayer.pool_metrics import PoolMetricsReporter, PrefixIndexSizeReporter
from domain.datastore.store import Datastore
from ports.access import RequestAuthorizer
from ports.metric_catalogue import EXTENSION_INFO
from ports.observer import NoopObserver
from ports.prefix_index import PrefixIndex

__all__ = ["EppObserver", "Observability", "build_tracing", "metrics_ssl_context"]

logger = logging.getLogger(__name__)

#: How long shutdown waits for the last spans to be exported.
TRACE_FLUSH_TIMEOUT = 5.0

_NOOP = NoopObserver()


class EppObserver:
    """Metrics to ``metrics``; spans to ``tracing`` (``None``: spans are no-ops)."""

    __slots__ = ("counter", "gauge", "histogram", "metrics", "start_span", "tracing")

    def __init__(self, metrics: PrometheusObserver, tracing: OtelTracing | None = None) -> None:
        self.metrics = metrics
        self.tracing = tracing
        # The backends' bound methods themselves, so a report costs one call.
        self.counter = metrics.counter
        self.histogram = metrics.histogram
        self.gauge = metrics.gauge
        self.start_span = tracing.start_span if tracing is not None else _NOOP.start_span


def build_tracing(
    settings: Settings, environ: Mapping[str, str] | None = None
) -> OtelTracing | None:
    """``OtelTracing`` from the ``OTEL_*`` environment when ``--tracing`` is on."""
    if not settings.tracing:
        return None
    tracing = OtelTracing(os.environ if environ is None else environ)
    described = tracing.describe()
    logger.info("tracing on: sampler %s, exporter %s", described["sampler"], described["exporter"])
    return tracing


def metrics_ssl_context(settings: Settings) -> ssl.SSLContext | None:
    """HTTPS on the metrics port with ``--metrics-cert-dir``; client certificates signed by
    ``--metrics-client-ca-file`` required when it is set (mTLS); else ``None`` (HTTP)."""
    if settings.metrics_cert_dir is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(
        settings.metrics_cert_dir / "tls.crt", settings.metrics_cert_dir / "tls.key"
    )
    if settings.metrics_client_ca_file is not None:
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(cafile=settings.metrics_client_ca_file)
    return context


def _build_info() -> dict[str, str]:
    try:
        version = importlib.metadata.version("epp")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return {
        "commit": os.environ.get("EPP_COMMIT", "unknown"),
        "build_ref": os.environ.get("EPP_BUILD_REF", version),
    }


class Observability:
    """Starts and stops everything observability runs beside the request path."""

    def __init__(
        self,
        *,
        settings: Settings,
        metrics: PrometheusObserver,
        tracing: OtelTracing | None,
        datastore: Datastore,
        prefix_index: PrefixIndex,
        authorizer: RequestAuthorizer | None = None,
        pages: Mapping[str, TextPage] | None = None,
        loopback_metrics: bool = False,
    ) -> None:
        self.metrics = metrics
        self.tracing = tracing
        # A worker serves its own /metrics on a loopback port for its supervisor to merge.
        self.server = MetricsServer(
            metrics,
            host="127.0.0.1" if loopback_metrics else settings.bind_address,
            port=0 if loopback_metrics else settings.metrics_port,
            # A worker's own /metrics is on loopback, read by its supervisor only.
            authorizer=None if loopback_metrics else authorizer,
            pages=pages,
            ssl_context=None if loopback_metrics else metrics_ssl_context(settings),
        )
        self.pool = PoolMetricsReporter(
            datastore=datastore,
            observer=metrics,
            pool_name=settings.pool_name,
            interval=settings.refresh_prometheus_metrics_interval,
            staleness_threshold=settings.metrics_staleness_threshold,
        )
        self.prefix = PrefixIndexSizeReporter(index=prefix_index, observer=metrics)
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        """Serve ``/metrics`` (raises ``OSError`` naming ``--metrics-port``) and start the
        periodic gauges."""
        self.metrics.gauge(EXTENSION_INFO, _build_info(), 1.0)
        await self.server.start()
        self._tasks = [
            asyncio.create_task(self.pool.run(), name="pool-metrics"),
            asyncio.create_task(self.prefix.run(), name="prefix-index-size"),
        ]

    async def stop(self) -> None:
        """Stop the gauges and the server, then flush the traces (bounded); idempotent."""
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.server.stop()
        if self.tracing is not None:
            try:
                await asyncio.wait_for(
                    asyncio.to_thread(self.tracing.shutdown, TRACE_FLUSH_TIMEOUT),
                    TRACE_FLUSH_TIMEOUT + 1,
                )
            except TimeoutError:
                logger.warning("traces not flushed within %.0fs", TRACE_FLUSH_TIMEOUT)
