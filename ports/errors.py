"""Error vocabulary shared by the domain and the adapters."""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["ErrorCode", "RequestError"]


class ErrorCode(enum.StrEnum):
    """Machine-readable error codes. Only ``adapters/envoy`` maps them to HTTP statuses.

    The string values are the names the reference EPP uses in its error bodies
    (``inference error: <Code> - <Msg>``) and metric labels.
    """

    BAD_REQUEST = "BadRequest"
    UNAUTHORIZED = "Unauthorized"
    FORBIDDEN = "Forbidden"
    NOT_FOUND = "NotFound"
    RESOURCE_EXHAUSTED = "ResourceExhausted"
    INTERNAL = "Internal"
    SERVICE_UNAVAILABLE = "ServiceUnavailable"
    MODEL_SERVER_ERROR = "ModelServerError"
    UNKNOWN = "Unknown"


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestError:
    """Why a request was refused: a code and a human-readable message."""

    code: ErrorCode
    message: str
