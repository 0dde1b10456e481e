"""The domain's exception tree. Every error carries a machine-readable ``ErrorCode``."""

from __future__ import annotations

from typing import ClassVar

from ports.errors import ErrorCode, RequestError

__all__ = [
    "BadRequestError",
    "EppError",
    "InternalError",
    "ResourceExhaustedError",
    "ServiceUnavailableError",
]


class EppError(Exception):
    """Root of all request-level errors raised by the domain."""

    code: ClassVar[ErrorCode] = ErrorCode.UNKNOWN

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def to_request_error(self) -> RequestError:
        return RequestError(code=self.code, message=self.message)


class BadRequestError(EppError):
    code = ErrorCode.BAD_REQUEST


class ResourceExhaustedError(EppError):
    code = ErrorCode.RESOURCE_EXHAUSTED


class ServiceUnavailableError(EppError):
    code = ErrorCode.SERVICE_UNAVAILABLE


class InternalError(EppError):
    code = ErrorCode.INTERNAL
