"""The ext_proc messages: Envoy's header maps and metadata read into ours, and the replies
written back (the routing headers and metadata, immediate responses with the HTTP status of
an error, and the streamed body chunks, encoded by hand: decision 0013)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any, cast

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2

from ports.errors import ErrorCode, RequestError
from ports.requests import Metadata

__all__ = [
    "DESTINATION_ENDPOINT_HEADER",
    "DESTINATION_METADATA_NAMESPACE",
    "HTTP_STATUS_BY_CODE",
    "MAX_BODY_CHUNK_BYTES",
    "StreamAbortedError",
    "StreamProtocolError",
    "body_chunks",
    "fill_struct",
    "headers_of",
    "immediate_response",
    "metadata_of",
    "out_of_order",
    "payload_too_large",
    "request_body_response",
    "response_body_response",
    "serialize_reply",
    "set_headers",
]

DESTINATION_ENDPOINT_HEADER = "x-gateway-destination-endpoint"
DESTINATION_METADATA_NAMESPACE = "envoy.lb"
#: Some Envoy builds cap a streamed body chunk at 64 KiB; stay below it.
MAX_BODY_CHUNK_BYTES = 62_000

HTTP_STATUS_BY_CODE: Mapping[ErrorCode, int] = {
    ErrorCode.BAD_REQUEST: 400,
    ErrorCode.UNAUTHORIZED: 401,
    ErrorCode.FORBIDDEN: 403,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.RESOURCE_EXHAUSTED: 429,
    ErrorCode.INTERNAL: 500,
    ErrorCode.SERVICE_UNAVAILABLE: 503,
}

_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def payload_too_large(limit: int) -> Any:
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=413),
            body=(
                f"inference error: PayloadTooLarge - the request body exceeds {limit} bytes"
            ).encode(),
        )
    )


class StreamAbortedError(Exception):
    """An error with no HTTP mapping: the stream is aborted with a gRPC error."""


class StreamProtocolError(Exception):
    """The gateway broke the ext_proc protocol: the stream ends with ``code``."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def out_of_order(message: str) -> StreamProtocolError:
    return StreamProtocolError(grpc.StatusCode.FAILED_PRECONDITION, message)


#: Characters that would split or truncate a header on the way upstream.
_FORBIDDEN_IN_NAME = re.compile(r"[\r\n\x00]")
_FORBIDDEN_IN_VALUE = re.compile(rb"[\r\n\x00]")


def set_headers(mutation: Any, headers: Iterable[tuple[str, str | bytes]]) -> None:
    """Adds ``headers`` to ``mutation.set_headers`` (overwrite or add), filling the
    repeated field in place: a third of the cost of building each option apart. A bytes
    value (a client's value that is not UTF-8) is set as it is."""
    add = mutation.set_headers.add
    for key, value in headers:
        header = add(append_action=_OVERWRITE).header
        header.key = key
        header.raw_value = value if isinstance(value, bytes) else value.encode()


def headers_of(header_map: Any, raw_values: dict[str, bytes] | None = None) -> dict[str, str]:
    """Lower-case name → value; ``StreamProtocolError`` (INVALID_ARGUMENT) for a name or
    value holding CR, LF or NUL. A value that is not UTF-8 is given to the domain with
    U+FFFD for the bad bytes, and its original bytes are put in ``raw_values``, so that it
    is forwarded unchanged."""
    headers: dict[str, str] = {}
    for h in header_map.headers:
        key = h.key
        if _FORBIDDEN_IN_NAME.search(key) is not None:
            raise StreamProtocolError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"header name {key[:64]!r} contains CR, LF or NUL",
            )
        raw = h.raw_value
        if raw:
            if _FORBIDDEN_IN_VALUE.search(raw) is not None:
                raise StreamProtocolError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"value of header {key[:64]!r} contains CR, LF or NUL",
                )
            try:
                value = raw.decode()
            except UnicodeDecodeError:
                value = raw.decode("utf-8", "replace")
                if raw_values is not None:
                    raw_values[key.lower()] = raw
        else:
            value = h.value
            if _FORBIDDEN_IN_NAME.search(value) is not None:
                raise StreamProtocolError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"value of header {key[:64]!r} contains CR, LF or NUL",
                )
        headers[key.lower()] = value
    return headers


def _plain(value: Any) -> object:
    """A ``google.protobuf.Value`` as a plain Python value."""
    kind = value.WhichOneof("kind")
    if kind == "string_value":
        return value.string_value
    if kind == "number_value":
        return value.number_value
    if kind == "bool_value":
        return value.bool_value
    if kind == "struct_value":
        return {k: _plain(v) for k, v in value.struct_value.fields.items()}
    if kind == "list_value":
        return [_plain(v) for v in value.list_value.values]
    return None


def metadata_of(request: Any) -> dict[str, dict[str, object]]:
    filter_metadata = request.metadata_context.filter_metadata
    return {
        namespace: {k: _plain(v) for k, v in struct.fields.items()}
        for namespace, struct in filter_metadata.items()
    }


def fill_struct(struct: Any, metadata: Metadata) -> None:
    """Sets ``metadata`` (namespace → fields) into the ``google.protobuf.Struct``
    ``struct`` in place: a string value directly (half the cost of ``Struct.update``,
    and no copy of a finished Struct), anything else through ``update``."""
    for namespace, fields in metadata.items():
        target = struct.fields[namespace].struct_value
        target.SetInParent()
        others: dict[str, Any] = {}
        for key, value in fields.items():
            if type(value) is str:
                target.fields[key].string_value = value
            else:
                others[key] = value
        if others:
            target.update(others)


def body_chunks(body: bytes) -> Iterable[bytes]:
    if not body:
        yield b""
        return
    view = memoryview(body)
    for start in range(0, len(body), MAX_BODY_CHUNK_BYTES):
        yield bytes(view[start : start + MAX_BODY_CHUNK_BYTES])


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


#: ``ProcessingResponse.request_body`` / ``.response_body`` (fields 3 and 4), each a
#: ``BodyResponse{response: CommonResponse{body_mutation: BodyMutation{streamed_response:
#: StreamedBodyResponse{body, end_of_stream}}}}``.
_REQUEST_BODY_TAG = b"\x1a"
_RESPONSE_BODY_TAG = b"\x22"
_END_OF_STREAM = b"\x10\x01"


def _streamed_body_prefix(tag: bytes, size: int, end_of_stream: bool) -> bytes:
    """Everything of a body reply before its chunk of ``size`` bytes."""
    streamed = (1 + len(_varint(size)) + size if size else 0) + (2 if end_of_stream else 0)
    mutation = 1 + len(_varint(streamed)) + streamed
    common = 1 + len(_varint(mutation)) + mutation
    return b"".join(
        (
            tag,
            _varint(1 + len(_varint(common)) + common),
            b"\x0a",
            _varint(common),
            b"\x1a",
            _varint(mutation),
            b"\x1a",
            _varint(streamed),
            b"\x0a" + _varint(size) if size else b"",
        )
    )


_PREFIXES: dict[tuple[bytes, int, bool], bytes] = {}
_MAX_PREFIXES = 4096


def _streamed_body(tag: bytes, chunk: bytes, end_of_stream: bool) -> bytes:
    """A body reply encoded by hand: the same bytes ``SerializeToString`` gives for the
    message, without building four nested messages and copying the chunk into them and
    out again (docs/decisions/0013). The bytes before the chunk depend only on its size,
    and are kept for the sizes seen (SSE chunks of a stream are much alike)."""
    key = (tag, len(chunk), end_of_stream)
    prefix = _PREFIXES.get(key)
    if prefix is None:
        if len(_PREFIXES) >= _MAX_PREFIXES:
            _PREFIXES.clear()
        prefix = _PREFIXES[key] = _streamed_body_prefix(tag, len(chunk), end_of_stream)
    if end_of_stream:
        return b"".join((prefix, chunk, _END_OF_STREAM))
    return prefix + chunk


def serialize_reply(reply: Any) -> bytes:
    """The ext_proc servicer's response serializer: a reply is a ``ProcessingResponse`` or
    its bytes already encoded (``_streamed_body``)."""
    if type(reply) is bytes:
        return reply
    return cast(bytes, reply.SerializeToString())


def request_body_response(chunk: bytes, end_of_stream: bool) -> bytes:
    return _streamed_body(_REQUEST_BODY_TAG, chunk, end_of_stream)


def response_body_response(
    chunk: bytes, end_of_stream: bool, metadata: Metadata | None = None
) -> Any:
    if not metadata:
        return _streamed_body(_RESPONSE_BODY_TAG, chunk, end_of_stream)
    response = pb.ProcessingResponse()
    streamed = response.response_body.response.body_mutation.streamed_response
    streamed.SetInParent()  # set even for an empty chunk without end of stream
    streamed.body = chunk
    streamed.end_of_stream = end_of_stream
    fill_struct(response.dynamic_metadata, metadata)
    return response


def immediate_response(error: RequestError) -> Any:
    status = HTTP_STATUS_BY_CODE.get(error.code)
    if status is None:
        raise StreamAbortedError(f"{error.code.value}: {error.message}")
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            body=f"inference error: {error.code.value} - {error.message}".encode(),
        )
    )
