"""Build ext_proc messages the way Envoy sends them, and read the replies it gets."""

from __future__ import annotations

import json
import ssl
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import json_format

from adapters.envoy.extproc import serialize_reply

ENVOY_CHUNK = 16_384

Headers = Sequence[tuple[str, str]]


# --- ProcessingRequest builders (what Envoy sends) ---------------------------------------------


def header_map(headers: Headers) -> Any:
    """Headers as Envoy sends them: the value in ``raw_value`` bytes, ``value`` empty."""
    return base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers]
    )


def metadata_context(metadata: Mapping[str, Mapping[str, object]]) -> Any:
    """``metadata_context.filter_metadata``: one Struct per namespace."""
    context = base_pb2.Metadata()
    for namespace, fields in metadata.items():
        context.filter_metadata[namespace].update(dict(fields))
    return context


def request_headers(
    headers: Headers,
    *,
    end_of_stream: bool = False,
    metadata: Mapping[str, Mapping[str, object]] | None = None,
) -> Any:
    message = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=header_map(headers), end_of_stream=end_of_stream)
    )
    if metadata is not None:
        message.metadata_context.CopyFrom(metadata_context(metadata))
    return message


def request_body(chunk: bytes, *, end_of_stream: bool) -> Any:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=chunk, end_of_stream=end_of_stream))


def request_body_chunks(body: bytes, size: int = ENVOY_CHUNK) -> list[Any]:
    """The body as Envoy streams it: ``size``-byte chunks, end of stream on the last."""
    parts = [body[i : i + size] for i in range(0, len(body), size)] or [b""]
    return [request_body(p, end_of_stream=i == len(parts) - 1) for i, p in enumerate(parts)]


def request_trailers(trailers: Headers) -> Any:
    return pb.ProcessingRequest(request_trailers=pb.HttpTrailers(trailers=header_map(trailers)))


def response_headers(headers: Headers, *, end_of_stream: bool = False) -> Any:
    return pb.ProcessingRequest(
        response_headers=pb.HttpHeaders(headers=header_map(headers), end_of_stream=end_of_stream)
    )


def response_body(chunk: bytes, *, end_of_stream: bool) -> Any:
    return pb.ProcessingRequest(response_body=pb.HttpBody(body=chunk, end_of_stream=end_of_stream))


def response_trailers(trailers: Headers) -> Any:
    return pb.ProcessingRequest(response_trailers=pb.HttpTrailers(trailers=header_map(trailers)))


def envoy_headers(
    *extra: tuple[str, str], path: str = "/v1/completions", method: str = "POST"
) -> list[tuple[str, str]]:
    """The request headers Envoy forwards for a client request (HTTP/2 pseudo-headers)."""
    return [
        (":authority", "gateway.example"),
        (":path", path),
        (":method", method),
        (":scheme", "http"),
        ("content-type", "application/json"),
        ("x-forwarded-proto", "http"),
        *extra,
    ]


def completion(model: str = "llama", prompt: str = "hello", **fields: object) -> bytes:
    return json.dumps({"model": model, "prompt": prompt, **fields}).encode()


# --- reading ProcessingResponses (what Envoy receives) -----------------------------------------


def set_headers(common: Any) -> list[tuple[str, str]]:
    """``header_mutation.set_headers`` of a CommonResponse as (key, value) pairs, in order."""
    return [
        (o.header.key, (o.header.raw_value or o.header.value.encode()).decode())
        for o in common.header_mutation.set_headers
    ]


def values_of(pairs: Iterable[tuple[str, str]], name: str) -> list[str]:
    return [v for k, v in pairs if k.lower() == name.lower()]


def dynamic_metadata(reply: Any) -> dict[str, Any]:
    result: dict[str, Any] = json_format.MessageToDict(reply.dynamic_metadata)
    return result


def streamed(reply: Any, kind: str) -> tuple[bytes, bool]:
    """(body, end_of_stream) of a ``request_body`` or ``response_body`` streamed reply."""
    assert reply.WhichOneof("response") == kind, reply
    mutation = getattr(reply, kind).response.body_mutation
    assert mutation.WhichOneof("mutation") == "streamed_response", reply
    return mutation.streamed_response.body, mutation.streamed_response.end_of_stream


# --- driving the servicer in process (no gRPC) -------------------------------------------------


class StreamAbortedByServicerError(Exception):
    """The servicer aborted the stream: ``code`` and ``details`` as the gRPC status."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code}: {details}")
        self.code = code
        self.details = details


class ReplayContext:
    """A grpc.aio servicer context that replays ``messages`` to
    ``ExtProcServicer.Process`` (then end of stream) and keeps what it writes: each reply
    serialized as on the wire, and parsed back unless ``parse`` is false."""

    def __init__(self, messages: Iterable[Any], *, parse: bool = True) -> None:
        self._messages = iter(messages)
        self._parse = parse
        self.replies: list[Any] = []

    async def read(self) -> Any:
        return next(self._messages, grpc.aio.EOF)

    async def write(self, reply: Any) -> None:
        raw = serialize_reply(reply)
        self.replies.append(pb.ProcessingResponse.FromString(raw) if self._parse else raw)

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise StreamAbortedByServicerError(code, details)


async def replay(servicer: Any, messages: Iterable[Any], *, parse: bool = True) -> list[Any]:
    """The replies ``servicer`` writes to one stream carrying ``messages``."""
    context = ReplayContext(messages, parse=parse)
    await servicer.Process(None, context)
    return context.replies


# --- A client of a running EPP (benchmarks) ----------------------------------------------------

#: A non-streamed completion's response body, as a model server sends it.
COMPLETION_RESPONSE = b'{"object":"text_completion","model":"llama","choices":[{"text":"hi"}]}'


def epp_tls_channel(
    port: int,
    tag: str = "",
    *,
    server_pem: bytes | None = None,
    client: tuple[Path, Path] | None = None,
) -> grpc.aio.Channel:
    """A TLS channel to an EPP on loopback ``port``, trusting ``server_pem`` (by default
    the certificate it presents). A ``tag`` gives the channel its own connection (not a
    shared subchannel). ``client`` (a certificate and key file) is presented to the EPP."""
    pem = server_pem or ssl.get_server_certificate(("127.0.0.1", port)).encode()
    options: list[tuple[str, str]] = [("grpc.ssl_target_name_override", "epp")]
    if tag:
        options.append(("bench.channel", tag))
    credentials = grpc.ssl_channel_credentials(
        pem,
        private_key=client[1].read_bytes() if client else None,
        certificate_chain=client[0].read_bytes() if client else None,
    )
    return grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials, options=options)


async def non_streamed_exchange(stub: Any, *headers: tuple[str, str]) -> Any:
    """One request as Envoy streams it (headers, body, response headers, response body),
    each reply read; returns the call, still open, for the caller to end."""
    call = stub.Process(timeout=30)
    await call.write(request_headers(envoy_headers(*headers)))
    await call.write(request_body(completion(), end_of_stream=True))
    await call.read()  # the header reply
    await call.read()  # the body reply
    await call.write(response_headers([(":status", "200"), ("content-type", "application/json")]))
    await call.read()
    await call.write(response_body(COMPLETION_RESPONSE, end_of_stream=True))
    await call.read()
    return call
