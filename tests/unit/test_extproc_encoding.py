"""The ext_proc body replies encoded by hand are the bytes protobuf would write."""

from __future__ import annotations

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from hypothesis import given
from hypothesis import strategies as st

from adapters.envoy.messages import (
    request_body_response,
    response_body_response,
    serialize_reply,
)


def _by_protobuf(kind: str, chunk: bytes, end_of_stream: bool) -> bytes:
    reply = pb.ProcessingResponse()
    mutation = getattr(reply, kind).response.body_mutation
    mutation.streamed_response.SetInParent()
    mutation.streamed_response.body = chunk
    mutation.streamed_response.end_of_stream = end_of_stream
    return bytes(reply.SerializeToString())


@pytest.mark.parametrize("size", [0, 1, 127, 128, 16_383, 16_384, 62_000, 2_097_152])
@pytest.mark.parametrize("end_of_stream", [False, True])
def test_body_replies_at_varint_boundaries(size: int, end_of_stream: bool) -> None:
    chunk = bytes(range(256)) * (size // 256) + bytes(size % 256)
    request = serialize_reply(request_body_response(chunk, end_of_stream))
    response = serialize_reply(response_body_response(chunk, end_of_stream))
    assert request == _by_protobuf("request_body", chunk, end_of_stream)
    assert response == _by_protobuf("response_body", chunk, end_of_stream)


@given(st.binary(max_size=3000), st.booleans())
def test_body_replies_parse_back(chunk: bytes, end_of_stream: bool) -> None:
    for kind, build in (
        ("request_body", request_body_response),
        ("response_body", response_body_response),
    ):
        raw = serialize_reply(build(chunk, end_of_stream))
        assert raw == _by_protobuf(kind, chunk, end_of_stream)
        parsed = pb.ProcessingResponse.FromString(raw)
        streamed = getattr(parsed, kind).response.body_mutation.streamed_response
        assert (streamed.body, streamed.end_of_stream) == (chunk, end_of_stream)


def test_a_response_body_reply_with_metadata_is_a_message() -> None:
    reply = response_body_response(b"{}", True, {"envoy.lb": {"k": "v"}})
    parsed = pb.ProcessingResponse.FromString(serialize_reply(reply))
    assert parsed.response_body.response.body_mutation.streamed_response.body == b"{}"
    assert parsed.dynamic_metadata.fields["envoy.lb"].struct_value.fields["k"].string_value == "v"


def test_an_empty_reply_with_metadata_still_carries_a_streamed_body() -> None:
    reply = response_body_response(b"", False, {"envoy.lb": {"k": "v"}})
    parsed = pb.ProcessingResponse.FromString(serialize_reply(reply))
    mutation = parsed.response_body.response.body_mutation
    assert mutation.WhichOneof("mutation") == "streamed_response"
