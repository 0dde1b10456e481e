"""Benchmark (not a test): ``/metrics`` latency with ``--metrics-endpoint-auth`` on vs off.

One process serves the same registry twice on loopback: once without auth, once behind the
TokenReview/SubjectAccessReview authorizer talking to the loopback Kubernetes API server.
After one warm-up request (which makes the reviews), requests alternate between the two
servers over keep-alive connections, so both see the same machine load; the auth figures are
therefore those of a cached verdict, the steady state of a Prometheus scraping with one token.
The first (uncached) request's latency is printed too.

    .venv/bin/python -m tests.bench.metrics_auth --requests 2000
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import aiohttp

from adapters.kubernetes.metrics_auth import TokenReviewAuthorizer
from adapters.prometheus.exporter import MetricsServer, PrometheusObserver
from ports import metric_catalogue as catalogue
from tests.support.kube_api import KubeApiServer, kube_client


def _observer() -> PrometheusObserver:
    """The catalogue's families, with one counter series for each of 50 endpoints."""
    observer = PrometheusObserver()
    for n in range(50):
        observer.counter(catalogue.SCRAPE_ERRORS, {"endpoint": f"10.0.0.{n}:8000"})
    return observer


async def _time(session: aiohttp.ClientSession, url: str, headers: dict[str, str]) -> float:
    started = time.perf_counter()
    async with session.get(url, headers=headers) as response:
        await response.read()
        assert response.status == 200, response.status
    return time.perf_counter() - started


def _summary(name: str, samples: list[float]) -> str:
    ordered = sorted(samples)
    p99 = ordered[int(len(ordered) * 0.99) - 1]
    return (
        f"{name}: mean {statistics.fmean(ordered) * 1e3:.3f} ms, "
        f"p50 {statistics.median(ordered) * 1e3:.3f} ms, p99 {p99 * 1e3:.3f} ms "
        f"({len(ordered)} requests)"
    )


async def main(requests: int) -> None:
    observer = _observer()
    with KubeApiServer() as api, kube_client(api) as client:
        api.add_token("scraper", username="system:serviceaccount:monitoring:prometheus")
        api.grant("system:serviceaccount:monitoring:prometheus", "/metrics")
        authorizer = TokenReviewAuthorizer(client)
        open_server = MetricsServer(observer.registry, host="127.0.0.1", port=0)
        auth_server = MetricsServer(
            observer.registry, host="127.0.0.1", port=0, authorizer=authorizer
        )
        await open_server.start()
        await auth_server.start()
        try:
            open_url = f"http://127.0.0.1:{open_server.bound_port}/metrics"
            auth_url = f"http://127.0.0.1:{auth_server.bound_port}/metrics"
            token = {"Authorization": "Bearer scraper"}
            async with aiohttp.ClientSession() as session:
                first = await _time(session, auth_url, token)
                await _time(session, open_url, {})
                off: list[float] = []
                on: list[float] = []
                for _ in range(requests):
                    off.append(await _time(session, open_url, {}))
                    on.append(await _time(session, auth_url, token))
            print(
                f"first request with auth (TokenReview + SubjectAccessReview): {first * 1e3:.2f} ms"
            )
            print(_summary("auth off", off))
            print(_summary("auth on, cached", on))
            print(
                f"added by auth (cached), median: "
                f"{(statistics.median(on) - statistics.median(off)) * 1e6:.0f} us; "
                f"reviews made: {authorizer.reviews}"
            )
        finally:
            await auth_server.stop()
            await open_server.stop()
            authorizer.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    asyncio.run(main(parser.parse_args().requests))
