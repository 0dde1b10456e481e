"""``--metrics-endpoint-auth``: a bearer token checked with the Kubernetes API.

Each request to ``/metrics`` (or ``/debug/pprof/...``) must carry ``Authorization: Bearer
<token>``. The token is authenticated with a TokenReview; the user it names must then be
allowed ``get`` on the request's path as a non-resource URL, which a SubjectAccessReview
answers. A Prometheus that scrapes the EPP thus needs a ClusterRole with
``nonResourceURLs: ["/metrics"], verbs: ["get"]``, and the EPP's own service account needs
``create`` on ``tokenreviews`` and ``subjectaccessreviews``.

Verdicts are cached per (token, path), as the reference does: an allowed request for
``ALLOW_TTL`` seconds, a refused one (bad token or no permission) for ``DENY_TTL``; the
cache holds at most ``max_entries`` (least recently used ones go first), so a peer sending
endless distinct tokens costs API calls at the pace of ``max_reviews`` concurrent reviews,
never memory. Concurrent requests with the same token share one review. A review the API
server refuses (an error status other than a verdict) or that exceeds ``timeout`` is
``UNAVAILABLE`` (HTTP 503) and is not cached; it is logged once until reviews work again.

The reviews block (the ``kubernetes`` client is synchronous): they run in this object's own
worker threads, never on the event loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kubernetes.client import (
    ApiClient,
    AuthenticationV1Api,
    AuthorizationV1Api,
    V1NonResourceAttributes,
    V1SubjectAccessReview,
    V1SubjectAccessReviewSpec,
    V1TokenReview,
    V1TokenReviewSpec,
)

from ports.access import AccessVerdict

__all__ = ["ALLOW_TTL", "DENY_TTL", "TokenReviewAuthorizer"]

logger = logging.getLogger(__name__)

#: How long an allowed (token, path) is remembered, in seconds.
ALLOW_TTL = 60.0
#: How long a refused (token, path) is remembered, in seconds.
DENY_TTL = 30.0
#: Tokens longer than this are refused without asking the API server.
MAX_TOKEN_LENGTH = 16 * 1024


class TokenReviewAuthorizer:
    """A ``RequestAuthorizer`` backed by TokenReview and SubjectAccessReview; see the module
    docstring. ``clock`` is ``time.monotonic`` unless a test passes another."""

    def __init__(
        self,
        api_client: ApiClient,
        *,
        timeout: float = 5.0,
        allow_ttl: float = ALLOW_TTL,
        deny_ttl: float = DENY_TTL,
        max_entries: int = 4096,
        max_reviews: int = 4,
    ) -> None:
        self._authn = AuthenticationV1Api(api_client)
        self._authz = AuthorizationV1Api(api_client)
        self._timeout = timeout
        self._allow_ttl = allow_ttl
        self._deny_ttl = deny_ttl
        self._max_entries = max_entries
        self._cache: OrderedDict[tuple[bytes, str], tuple[AccessVerdict, float]] = OrderedDict()
        self._pending: dict[tuple[bytes, str], asyncio.Future[AccessVerdict]] = {}
        self._workers = ThreadPoolExecutor(
            max_workers=max_reviews, thread_name_prefix="epp-metrics-auth"
        )
        self._failing = False
        self.reviews = 0  # API round trips made (TokenReviews), for tests and benchmarks

    def close(self) -> None:
        self._workers.shutdown(wait=False, cancel_futures=True)

    async def authorize(self, authorization: str | None, path: str) -> AccessVerdict:
        token = _bearer(authorization)
        if token is None:
            return AccessVerdict.UNAUTHENTICATED
        key = (hashlib.sha256(token.encode()).digest(), path)
        now = time.monotonic()
        cached = self._cache.get(key)
        if cached is not None:
            if cached[1] > now:
                self._cache.move_to_end(key)
                return cached[0]
            del self._cache[key]
        pending = self._pending.get(key)
        if pending is None:
            pending = asyncio.ensure_future(self._review(token, path, key))
            self._pending[key] = pending
            pending.add_done_callback(lambda _: self._pending.pop(key, None))
        return await asyncio.shield(pending)

    async def _review(self, token: str, path: str, key: tuple[bytes, str]) -> AccessVerdict:
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + self._timeout
        try:
            verdict = await asyncio.wait_for(
                loop.run_in_executor(self._workers, self._reviews, token, path, deadline),
                self._timeout * 2 + 1,
            )
        except Exception as exc:  # refused, unreachable or slow: no verdict
            if not self._failing:
                self._failing = True
                logger.error(
                    "metrics auth: cannot review a token with the Kubernetes API (%s); "
                    "/metrics answers 503 until it can",
                    _describe(exc),
                )
            return AccessVerdict.UNAVAILABLE
        if self._failing:
            self._failing = False
            logger.info("metrics auth: token reviews work again")
        ttl = self._allow_ttl if verdict is AccessVerdict.ALLOWED else self._deny_ttl
        self._cache[key] = (verdict, time.monotonic() + ttl)
        while len(self._cache) > self._max_entries:
            self._cache.popitem(last=False)
        return verdict

    def _reviews(self, token: str, path: str, deadline: float) -> AccessVerdict:
        """The TokenReview, then the SubjectAccessReview (blocking; a worker thread). A
        review that waited for a worker past ``deadline`` is not made: its request has been
        answered 503 meanwhile."""
        if time.monotonic() > deadline:
            raise TimeoutError("waited too long for a free reviewer")
        self.reviews += 1
        timeout = (self._timeout, self._timeout)
        review: Any = self._authn.create_token_review(
            V1TokenReview(spec=V1TokenReviewSpec(token=token)), _request_timeout=timeout
        )
        status = review.status
        if status is None or not status.authenticated or status.user is None:
            return AccessVerdict.UNAUTHENTICATED
        user = status.user
        access: Any = self._authz.create_subject_access_review(
            V1SubjectAccessReview(
                spec=V1SubjectAccessReviewSpec(
                    user=user.username,
                    groups=user.groups,
                    uid=user.uid,
                    extra=user.extra,
                    non_resource_attributes=V1NonResourceAttributes(path=path, verb="get"),
                )
            ),
            _request_timeout=timeout,
        )
        allowed = access.status is not None and bool(access.status.allowed)
        return AccessVerdict.ALLOWED if allowed else AccessVerdict.FORBIDDEN


def _bearer(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token or len(token) > MAX_TOKEN_LENGTH:
        return None
    return token


def _describe(exc: BaseException) -> str:
    status = getattr(exc, "status", None)
    reason = getattr(exc, "reason", None)
    if status is not None:
        return f"HTTP {status} {reason or ''}".strip()
    if isinstance(exc, TimeoutError):
        return "timed out"
    return f"{type(exc).__name__}: {exc}"
