"""Finding 11: what a client sends is judged and forwarded faithfully.

- ``chat_template_kwargs`` that is not an object is a 400 (the reference decodes it into
  an object), and so are the other typed chat fields with the wrong type;
- a header value that is not UTF-8 reaches the model server with its original bytes, not
  with U+FFFD in their place (ext_proc's ``raw_value``);
- the 400 text of a body that is not UTF-8, or that holds a number too large for a
  double, names that cause.
"""

from __future__ import annotations

import json
from typing import Any

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from tests.adversarial.extproc_support import (
    CountingProcessor,
    director_over,
    extproc_channel,
    open_stream,
    read_all,
)
from tests.support.extproc import (
    envoy_headers,
    request_body,
    request_headers,
)

pytestmark = pytest.mark.usefixtures("each_transport")

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


async def _send(*messages: Any) -> list[Any]:
    director, _ = director_over(None)
    processor = CountingProcessor(director)
    async with extproc_channel(processor) as channel:
        call = open_stream(channel)
        for message in messages:
            await call.write(message)
        await call.done_writing()
        replies, code, details = await read_all(call)
    assert code == grpc.StatusCode.OK, details
    await processor.wait_all_closed()
    return replies


def _immediate(replies: list[Any]) -> tuple[int, str]:
    assert replies[0].WhichOneof("response") == "immediate_response", replies[0]
    reply = replies[0].immediate_response
    return reply.status.code, reply.body.decode()


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("chat_template_kwargs", "enable_thinking", "chat_template_kwargs must be an object"),
        ("chat_template_kwargs", [1, 2], "chat_template_kwargs must be an object"),
        ("chat_template", 7, "chat_template must be a string"),
        ("tools", {"a": 1}, "tools must be a list"),
        ("add_generation_prompt", "yes", "add_generation_prompt must be a boolean"),
    ],
)
async def test_chat_fields_of_the_wrong_type_are_a_400(
    field: str, value: object, message: str
) -> None:
    body = json.dumps({"model": "llama", "messages": MESSAGES, field: value}).encode()
    replies = await _send(
        request_headers(envoy_headers(path=CHAT)), request_body(body, end_of_stream=True)
    )
    status, text = _immediate(replies)
    assert status == 400
    assert message in text


async def test_chat_fields_of_the_right_type_or_null_are_routed() -> None:
    body = json.dumps(
        {
            "model": "llama",
            "messages": MESSAGES,
            "chat_template_kwargs": {"enable_thinking": False},
            "tools": None,
        }
    ).encode()
    replies = await _send(
        request_headers(envoy_headers(path=CHAT)), request_body(body, end_of_stream=True)
    )
    assert replies[0].WhichOneof("response") == "request_headers"


@pytest.mark.parametrize(
    ("body", "cause", "wrong"),
    [
        (
            b'{"model": "llama", "prompt": "caf\xe9"}',
            "request body is not valid JSON: it is not UTF-8 (byte 0xe9 at offset 33)",
            "surrogates",
        ),
        (
            b'{"model": "llama", "prompt": "x", "n": ' + b"9" * 400 + b"}",
            "request body is not valid JSON: number too large",
            "infinity",
        ),
    ],
    ids=["latin-1-body", "400-digit-integer"],
)
async def test_a_400_names_the_real_cause(body: bytes, cause: str, wrong: str) -> None:
    replies = await _send(request_headers(envoy_headers()), request_body(body, end_of_stream=True))
    status, text = _immediate(replies)
    assert status == 400
    assert cause in text
    assert wrong not in text


async def test_header_values_that_are_not_utf8_are_forwarded_byte_for_byte() -> None:
    latin = b"caf\xe9"
    headers = base_pb2.HeaderMap(
        headers=[
            *(base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in envoy_headers()),
            base_pb2.HeaderValue(key="x-latin", raw_value=latin),
        ]
    )
    upstream = base_pb2.HeaderMap(
        headers=[
            base_pb2.HeaderValue(key=":status", raw_value=b"200"),
            base_pb2.HeaderValue(key="content-type", raw_value=b"application/json"),
            base_pb2.HeaderValue(key="x-upstream-latin", raw_value=b"na\xefve"),
        ]
    )
    replies = await _send(
        pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=headers)),
        request_body(b'{"model": "llama", "prompt": "hi"}', end_of_stream=True),
        pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=upstream)),
    )
    request_reply = replies[0].request_headers.response
    raw = {o.header.key: o.header.raw_value for o in request_reply.header_mutation.set_headers}
    assert raw["x-latin"] == latin
    response_reply = next(r for r in replies if r.WhichOneof("response") == "response_headers")
    raw = {
        o.header.key: o.header.raw_value
        for o in response_reply.response_headers.response.header_mutation.set_headers
    }
    # the response's headers are not set again: Envoy keeps them as the server sent them
    assert "x-upstream-latin" not in raw
    assert "content-type" not in raw
