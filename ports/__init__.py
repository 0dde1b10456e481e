"""Ports: the Protocols and plain value types where the domain meets the adapters.

Standard library only.
"""

from ports.codec import JsonCodec, JsonDecodeError
from ports.endpoints import (
    EndpointAddress,
    EndpointEvent,
    EndpointEventKind,
    EndpointInfo,
    EndpointSink,
    EndpointSource,
)
from ports.errors import ErrorCode, RequestError
from ports.requests import (
    SYSTEM_REQUEST_HEADERS,
    InboundRequest,
    Metadata,
    RequestExchange,
    RequestProcessor,
    ResponseBodyReply,
    ResponseHeadersReply,
    RoutingDecision,
)

__all__ = [
    "SYSTEM_REQUEST_HEADERS",
    "EndpointAddress",
    "EndpointEvent",
    "EndpointEventKind",
    "EndpointInfo",
    "EndpointSink",
    "EndpointSource",
    "ErrorCode",
    "InboundRequest",
    "JsonCodec",
    "JsonDecodeError",
    "Metadata",
    "RequestError",
    "RequestExchange",
    "RequestProcessor",
    "ResponseBodyReply",
    "ResponseHeadersReply",
    "RoutingDecision",
]
