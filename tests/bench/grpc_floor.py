"""Benchmark (not a test): what the gRPC server alone costs per ext_proc message pair.

A server in a second process with the EPP's handler shape (a coroutine on the reader/writer
API, uvloop, ``serialize_reply``) that reads each ``ProcessingRequest`` and writes back a
response-body reply echoing its chunk, and nothing else. A client here (grpc.aio) sends an
SSE-sized ``response_body`` message and waits for the reply, over ``--streams`` concurrent
streams. Prints the server's CPU per message pair: the floor under the EPP's cost per SSE
chunk, for each ``--transports``: ``grpcio`` (grpc.aio, docs/decisions/0013), ``native``
(``adapters.envoy.h2``, docs/decisions/0020), ``inline`` (the same, each message
answered in the transport's read without waking the handler, docs/decisions/0021), ``h2``
(the same echo on the ``h2`` library's HTTP/2 state machine, when it is installed: what a
kept library would cost), ``ngh2`` (the same on ``ngh2``, the binding of libnghttp2, the C
HTTP/2 library Envoy's and curl's codecs grew from, when it is installed: what a kept native
library would cost) and ``socket`` (no HTTP/2, no gRPC, no protobuf: the same bytes
echoed in a uvloop protocol's ``data_received``, each message a stream id and a length
before the chunk, streams multiplexed on one connection as gRPC's are; what a Python
process pays per message pair for the socket and the event loop alone).

    .venv/bin/python -m tests.bench.grpc_floor [--pairs 4000] [--streams 1,16]
        [--tree before=/path/to/other/checkout]

``--tree LABEL=PATH`` (repeatable) adds a column per transport of ``--tree-transports``
(``native,inline``) served by the checkout at PATH (its own ``tests.bench.grpc_floor``):
the same transport before and after a change, measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import statistics
import struct
import subprocess
import sys
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from adapters.envoy.h2 import H2GrpcServer, MethodHandler
from adapters.envoy.messages import response_body_response as _response_body_response
from adapters.envoy.messages import serialize_reply
from tests.bench.load import cpu_seconds

SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
CHUNK = (
    b'data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"m",'
    b'"choices":[{"index":0,"text":" tok","logprobs":null,"finish_reason":null}]}\n\n'
)


def _echo_reply(request: Any) -> list[Any]:
    return [_response_body_response(request.response_body.body, False)]


async def _echo(request_iterator: Any, context: Any) -> None:
    while True:
        request = await context.read()
        if request is grpc.aio.EOF:
            return
        for reply in _echo_reply(request):
            await context.write(reply)


async def _inline_echo(request_iterator: Any, context: Any) -> None:
    # the same echo answered in the transport's read (RpcContext.inline), as the EPP
    # answers SSE chunks
    context.inline = _echo_reply
    await _echo(request_iterator, context)


async def _serve(transport: str) -> None:
    if transport in ("native", "inline"):
        native = H2GrpcServer(
            {
                f"/{SERVICE}/Process": MethodHandler(
                    _echo if transport == "native" else _inline_echo,
                    pb.ProcessingRequest.FromString,
                    serialize_reply,
                    streaming=True,
                )
            }
        )
        print(await native.start("127.0.0.1", 0), flush=True)
        await asyncio.Event().wait()
        return
    if transport == "h2":
        await _serve_h2()
        return
    if transport == "ngh2":
        await _serve_ngh2()
        return
    if transport == "socket":
        await _serve_socket()
        return
    server = grpc.aio.server()
    handlers = {
        "Process": grpc.stream_stream_rpc_method_handler(
            _echo,
            request_deserializer=pb.ProcessingRequest.FromString,
            response_serializer=serialize_reply,
        )
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()


async def _load(port: int, streams: int, pairs: int) -> None:
    request = pb.ProcessingRequest(response_body=pb.HttpBody(body=CHUNK))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.ExternalProcessorStub(channel)

        async def one(count: int) -> None:
            call = stub.Process()
            for _ in range(count):
                await call.write(request)
                await call.read()
            await call.done_writing()
            await call.read()

        await asyncio.gather(*(one(pairs // streams) for _ in range(streams)))


_SOCKET_HEADER = struct.Struct(">II")  # stream id, length


async def _serve_socket() -> None:
    class Echo(asyncio.Protocol):
        def connection_made(self, transport: Any) -> None:
            self.transport = transport
            self.buffer = b""

        def data_received(self, data: bytes) -> None:
            buffer = self.buffer + data if self.buffer else data
            out = []
            offset = 0
            while len(buffer) - offset >= 8:
                _, size = _SOCKET_HEADER.unpack_from(buffer, offset)
                end = offset + 8 + size
                if end > len(buffer):
                    break
                out.append(buffer[offset:end])
                offset = end
            self.buffer = buffer[offset:]
            if out:
                self.transport.write(b"".join(out))

    server = await asyncio.get_running_loop().create_server(Echo, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    await server.serve_forever()


async def _load_socket(port: int, streams: int, pairs: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    waiting: dict[int, asyncio.Future[None]] = {}

    async def demux() -> None:
        while True:
            header = await reader.readexactly(8)
            stream, size = _SOCKET_HEADER.unpack(header)
            await reader.readexactly(size)
            waiting.pop(stream).set_result(None)

    async def one(stream: int, count: int) -> None:
        message = _SOCKET_HEADER.pack(stream, len(CHUNK)) + CHUNK
        for _ in range(count):
            waiting[stream] = asyncio.get_running_loop().create_future()
            writer.write(message)
            await waiting[stream]

    reading = asyncio.create_task(demux())
    await asyncio.gather(*(one(i, pairs // streams) for i in range(streams)))
    reading.cancel()
    writer.close()


async def _serve_h2() -> None:
    # The same echo on the h2 library: its state machine does the framing, flow control
    # and header coding; we only cut gRPC messages.
    # the bench extra's; imported by name, so type checks do without it
    config_module = importlib.import_module("h2.config")
    connection_module = importlib.import_module("h2.connection")
    events = importlib.import_module("h2.events")

    class Echo(asyncio.Protocol):
        def connection_made(self, transport: Any) -> None:
            self.transport = transport
            config = config_module.H2Configuration(client_side=False, header_encoding=None)
            self.h2 = connection_module.H2Connection(config)
            self.h2.initiate_connection()
            self.partial: dict[int, bytes] = {}
            transport.write(self.h2.data_to_send())

        def data_received(self, data: bytes) -> None:
            for event in self.h2.receive_data(data):
                if isinstance(event, events.RequestReceived):
                    self.partial[event.stream_id] = b""
                    headers = [(b":status", b"200"), (b"content-type", b"application/grpc")]
                    self.h2.send_headers(event.stream_id, headers)
                elif isinstance(event, events.DataReceived):
                    stream = event.stream_id
                    self.h2.acknowledge_received_data(event.flow_controlled_length, stream)
                    buffer = self.partial[stream] + event.data
                    while len(buffer) >= 5 and len(buffer) >= 5 + int.from_bytes(buffer[1:5]):
                        size = 5 + int.from_bytes(buffer[1:5])
                        request = pb.ProcessingRequest.FromString(buffer[5:size])
                        buffer = buffer[size:]
                        reply = serialize_reply(
                            _response_body_response(request.response_body.body, False)
                        )
                        self.h2.send_data(stream, b"\0" + len(reply).to_bytes(4) + reply)
                    self.partial[stream] = buffer
                elif isinstance(event, events.StreamEnded):
                    self.h2.send_headers(event.stream_id, [(b"grpc-status", b"0")], end_stream=True)
            self.transport.write(self.h2.data_to_send())

    server = await asyncio.get_running_loop().create_server(Echo, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    await server.serve_forever()


async def _serve_ngh2() -> None:
    # The same echo on ngh2 (libnghttp2): framing, HPACK, flow control and window updates
    # in C; we only cut gRPC messages. Imported by name, as h2 is (the bench extra's).
    ngh2: Any = importlib.import_module("ngh2")
    response = [(b":status", b"200"), (b"content-type", b"application/grpc")]
    trailers = [(b"grpc-status", b"0")]

    class Echo(asyncio.Protocol):
        def connection_made(self, transport: Any) -> None:
            self.transport = transport
            self.h2 = ngh2.Connection(ngh2.Role.SERVER)
            self.h2.initiate_connection()
            self.partial: dict[int, bytes] = {}
            transport.write(self.h2.data_to_send())

        def data_received(self, data: bytes) -> None:
            h2 = self.h2
            h2.receive_data(data)
            for event in h2.events():
                kind = type(event)
                if kind is ngh2.RequestReceived:
                    self.partial[event.stream_id] = b""
                    h2.send_response(event.stream_id, response)
                elif kind is ngh2.DataReceived:
                    stream = event.stream_id
                    buffer = self.partial[stream] + event.data
                    while len(buffer) >= 5 and len(buffer) >= 5 + int.from_bytes(buffer[1:5]):
                        size = 5 + int.from_bytes(buffer[1:5])
                        request = pb.ProcessingRequest.FromString(buffer[5:size])
                        buffer = buffer[size:]
                        reply = serialize_reply(
                            _response_body_response(request.response_body.body, False)
                        )
                        h2.send_data(stream, b"\0" + len(reply).to_bytes(4) + reply)
                    self.partial[stream] = buffer
                    if event.end_stream:
                        h2.send_trailers(stream, trailers)
                elif kind is ngh2.StreamClosed:
                    self.partial.pop(event.stream_id, None)
            out = h2.data_to_send()
            if out:
                self.transport.write(out)

    server = await asyncio.get_running_loop().create_server(Echo, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--pairs", type=int, default=4000, help="message pairs per row")
    parser.add_argument("--streams", default="1,16", help="concurrent streams, one row each")
    parser.add_argument(
        "--transports",
        default="grpcio,native,inline,h2,ngh2,socket",
        help="servers to compare, one column each",
    )
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds; medians")
    parser.add_argument("--tree", action="append", default=[], help="LABEL=PATH (see above)")
    parser.add_argument("--tree-transports", default="native,inline")
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        import uvloop

        uvloop.install()
        asyncio.run(_serve(args.serve))
        return
    transports = args.transports.split(",")
    for library in ("h2", "ngh2"):
        if library in transports and importlib.util.find_spec(library) is None:
            print(f"{library}: not installed (pip install -e '.[bench]'), column skipped")
            transports.remove(library)
    columns = [(t, t, None) for t in transports]
    for tree in args.tree:
        label, _, path = tree.partition("=")
        columns += [(f"{t}@{label}", t, path) for t in args.tree_transports.split(",")]
    servers: dict[str, tuple[subprocess.Popen[str], int]] = {}
    try:
        for column, transport, path in columns:
            server = subprocess.Popen(
                [sys.executable, "-m", "tests.bench.grpc_floor", "--serve", transport],
                stdout=subprocess.PIPE,
                text=True,
                cwd=path,
                env=None if path is None else {**os.environ, "PYTHONPATH": path},
            )
            assert server.stdout is not None
            servers[column] = (server, int(server.stdout.readline()))
            load = _load_socket if transport == "socket" else _load
            asyncio.run(load(servers[column][1], 8, 400))  # warm up
        streams_rows = [int(s) for s in args.streams.split(",")]
        costs: dict[tuple[int, str], list[float]] = {}
        for _ in range(args.rounds):
            for streams in streams_rows:
                for transport, (server, port) in servers.items():
                    load = _load_socket if transport == "socket" else _load
                    before = cpu_seconds(server.pid)
                    asyncio.run(load(port, streams, args.pairs))
                    spent = (cpu_seconds(server.pid) - before) / args.pairs
                    costs.setdefault((streams, transport), []).append(spent)
        print(f"server CPU per message pair, us (median of {args.rounds} alternating rounds)")
        width = max(10, *(len(t) + 2 for t in servers))
        print("streams " + "".join(f"{t:>{width}}" for t in servers))
        for streams in streams_rows:
            cells = (statistics.median(costs[streams, t]) * 1e6 for t in servers)
            print(f"{streams:>7} " + "".join(f"{cell:>{width}.1f}" for cell in cells))
    finally:
        for server, _ in servers.values():
            server.kill()
            server.wait()


if __name__ == "__main__":
    main()
