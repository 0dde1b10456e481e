"""Who may read the operational HTTP endpoints (``/metrics``, ``/debug/pprof/``).

The metrics server asks a ``RequestAuthorizer`` before answering; the Kubernetes adapter
implements it with a TokenReview and a SubjectAccessReview (``--metrics-endpoint-auth``).
"""

from __future__ import annotations

import enum
from typing import Protocol

__all__ = ["AccessVerdict", "RequestAuthorizer"]


class AccessVerdict(enum.Enum):
    """The answer for one request, and the HTTP status the server sends for it."""

    ALLOWED = 200
    #: no bearer token, or a token the API server does not accept
    UNAUTHENTICATED = 401
    #: an authenticated user that may not ``get`` this path
    FORBIDDEN = 403
    #: the reviews could not be made (API server down, refusing, slow)
    UNAVAILABLE = 503


class RequestAuthorizer(Protocol):
    """Decides whether a request may read a path.

    ``authorization`` is the request's ``Authorization`` header (``None`` when absent) and
    ``path`` the URL path. Runs on the event loop and never blocks it; never raises: a
    failure to decide is ``UNAVAILABLE``.
    """

    async def authorize(self, authorization: str | None, path: str) -> AccessVerdict: ...
