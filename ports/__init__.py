"""Ports: the Protocols and plain value types where the domain meets the adapters.

Standard library only.
"""

from ports.codec import JsonCodec, JsonDecodeError
from ports.datalayer import MetricsText, PollingDataSource
from ports.endpoints import (
    EndpointAddress,
    EndpointEvent,
    EndpointEventKind,
    EndpointInfo,
    EndpointSink,
    EndpointSource,
)
from ports.errors import ErrorCode, RequestError
from ports.objectives import ModelRewriteRule, ModelRewriteTarget, ObjectiveSink
from ports.observer import NoopObserver, NoopSpan, Observer, Span
from ports.plugins import TypedName
from ports.prefix_index import BlockHasher, PrefixIndex
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
    "BlockHasher",
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
    "MetricsText",
    "ModelRewriteRule",
    "ModelRewriteTarget",
    "NoopObserver",
    "NoopSpan",
    "ObjectiveSink",
    "Observer",
    "PollingDataSource",
    "PrefixIndex",
    "RequestError",
    "RequestExchange",
    "RequestProcessor",
    "ResponseBodyReply",
    "ResponseHeadersReply",
    "RoutingDecision",
    "Span",
    "TypedName",
]
