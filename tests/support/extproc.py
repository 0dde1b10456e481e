"""Build and read ext_proc messages the way Envoy sends and expects them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

__all__ = [
    "body_message",
    "headers_message",
    "response_body_message",
    "response_headers_message",
    "set_headers_of",
]


def _header_map(headers: Mapping[str, str]) -> Any:
    return base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()]
    )


def headers_message(
    path: str = "/v1/completions",
    *,
    method: str = "POST",
    extra: Mapping[str, str] | None = None,
    end_of_stream: bool = False,
) -> Any:
    headers = {":method": method, ":path": path, ":authority": "gateway", ":scheme": "http"}
    headers.update(extra or {})
    return pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=_header_map(headers), end_of_stream=end_of_stream)
    )


def body_message(body: bytes, *, end_of_stream: bool = True) -> Any:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=end_of_stream))


def response_headers_message(
    headers: Mapping[str, str] | None = None, *, end_of_stream: bool = False
) -> Any:
    values = {":status": "200", "content-type": "application/json"}
    values.update(headers or {})
    return pb.ProcessingRequest(
        response_headers=pb.HttpHeaders(headers=_header_map(values), end_of_stream=end_of_stream)
    )


def response_body_message(body: bytes, *, end_of_stream: bool = True) -> Any:
    return pb.ProcessingRequest(response_body=pb.HttpBody(body=body, end_of_stream=end_of_stream))


def set_headers_of(common_response: Any) -> dict[str, str]:
    """The headers a ``CommonResponse`` sets, as ``name → value``."""
    return {
        option.header.key: option.header.raw_value.decode()
        for option in common_response.header_mutation.set_headers
    }
