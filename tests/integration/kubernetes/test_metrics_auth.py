"""``--metrics-endpoint-auth``: /metrics behind a TokenReview and a SubjectAccessReview,
reviewed by the loopback API server through the official ``kubernetes`` client."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import aiohttp
import pytest

from adapters.kubernetes.metrics_auth import TokenReviewAuthorizer
from adapters.prometheus.exporter import MetricsServer, PrometheusObserver
from app.profiling import pprof_pages
from tests.support.kube_api import (
    SUBJECT_ACCESS_REVIEWS,
    TOKEN_REVIEWS,
    KubeApiServer,
    kube_client,
)

PROMETHEUS = "system:serviceaccount:monitoring:prometheus"


@pytest.fixture
def api() -> AsyncIterator[KubeApiServer]:  # type: ignore[misc]
    with KubeApiServer() as server:
        server.add_token("scraper-token", username=PROMETHEUS, groups=["system:serviceaccounts"])
        server.add_token("nobody-token", username="system:serviceaccount:default:nobody")
        server.grant(PROMETHEUS, "/metrics")
        yield server


async def _serve(authorizer: TokenReviewAuthorizer) -> MetricsServer:
    server = MetricsServer(
        PrometheusObserver().registry,
        host="127.0.0.1",
        port=0,
        authorizer=authorizer,
        pages=pprof_pages(),
    )
    await server.start()
    return server


async def _get(port: int, path: str, token: str | None) -> tuple[int, str]:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{port}{path}", headers=headers) as response,
    ):
        return response.status, await response.text()


async def test_only_a_token_allowed_to_get_metrics_reads_them(api: KubeApiServer) -> None:
    with kube_client(api) as client:
        authorizer = TokenReviewAuthorizer(client)
        server = await _serve(authorizer)
        try:
            port = server.bound_port
            assert (await _get(port, "/metrics", None))[0] == 401
            assert (await _get(port, "/metrics", "forged"))[0] == 401
            assert (await _get(port, "/metrics", "nobody-token"))[0] == 403
            status, text = await _get(port, "/metrics", "scraper-token")
            assert status == 200
            assert "inference_extension_info" in text
            # the grant is for /metrics only: the profiling pages need their own
            assert (await _get(port, "/debug/pprof/threads", "scraper-token"))[0] == 403
            api.grant(PROMETHEUS, "/debug/pprof/tasks")
            status, text = await _get(port, "/debug/pprof/tasks", "scraper-token")
            assert status == 200
            assert "asyncio tasks" in text
            sent = [r.path for r in api.requests(SUBJECT_ACCESS_REVIEWS)]
            assert sent.count("/apis/authorization.k8s.io/v1/subjectaccessreviews") == 4
        finally:
            await server.stop()
            authorizer.close()


async def test_verdicts_are_cached_both_ways_and_the_cache_is_bounded(
    api: KubeApiServer,
) -> None:
    with kube_client(api) as client:
        authorizer = TokenReviewAuthorizer(client, max_entries=2)
        server = await _serve(authorizer)
        try:
            port = server.bound_port
            for _ in range(5):
                assert (await _get(port, "/metrics", "scraper-token"))[0] == 200
                assert (await _get(port, "/metrics", "nobody-token"))[0] == 403
            assert len(api.requests(TOKEN_REVIEWS)) == 2  # one review per token
            # a revoked grant takes effect when the cached verdict expires, not before
            api.revoke(PROMETHEUS, "/metrics")
            assert (await _get(port, "/metrics", "scraper-token"))[0] == 200
            # many distinct tokens: each is reviewed, the cache keeps only the latest two
            for n in range(20):
                assert (await _get(port, "/metrics", f"junk-{n}"))[0] == 401
            assert len(api.requests(TOKEN_REVIEWS)) == 22
            assert (await _get(port, "/metrics", "scraper-token"))[0] == 403  # evicted
            assert len(api.requests(TOKEN_REVIEWS)) == 23
        finally:
            await server.stop()
            authorizer.close()


async def test_a_refused_or_slow_review_is_503_and_logged_once(
    api: KubeApiServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="adapters.kubernetes.metrics_auth")
    with kube_client(api) as client:
        authorizer = TokenReviewAuthorizer(client, timeout=0.3)
        server = await _serve(authorizer)
        try:
            port = server.bound_port
            api.fail_requests(500, resource=TOKEN_REVIEWS, count=3)
            for _ in range(3):
                status, text = await _get(port, "/metrics", "scraper-token")
                assert status == 503
                assert "inference_extension" not in text
            api.delay_reviews(2.0)  # past the client's timeout
            assert (await _get(port, "/metrics", "scraper-token"))[0] == 503
            api.delay_reviews(0)
            errors = [r for r in caplog.records if r.levelno == logging.ERROR]
            assert len(errors) == 1, [r.getMessage() for r in errors]
            assert "503" in errors[0].getMessage()
            # the API server answers again: the failure was not cached
            assert (await _get(port, "/metrics", "scraper-token"))[0] == 200
            assert "work again" in caplog.text
        finally:
            await server.stop()
            authorizer.close()
