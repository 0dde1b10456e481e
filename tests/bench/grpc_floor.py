"""Benchmark (not a test): what grpc.aio alone costs per ext_proc message pair.

A server in a second process with the EPP's handler shape (a coroutine on the reader/writer
API, uvloop, ``serialize_reply``) that reads each ``ProcessingRequest`` and writes back a
response-body reply echoing its chunk, and nothing else. A client here sends an SSE-sized
``response_body`` message and waits for the reply, over ``--streams`` concurrent streams.
Prints the server's CPU per message pair: the floor under the EPP's cost per SSE chunk
(docs/decisions/0013).

    .venv/bin/python -m tests.bench.grpc_floor [--pairs 4000] [--streams 1,16]
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from adapters.envoy.extproc import _response_body_response, serialize_reply
from tests.bench.load import cpu_seconds

SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
CHUNK = (
    b'data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"m",'
    b'"choices":[{"index":0,"text":" tok","logprobs":null,"finish_reason":null}]}\n\n'
)


async def _echo(request_iterator: Any, context: Any) -> None:
    while True:
        request = await context.read()
        if request is grpc.aio.EOF:
            return
        await context.write(_response_body_response(request.response_body.body, False))


async def _serve() -> None:
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


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--pairs", type=int, default=4000, help="message pairs per row")
    parser.add_argument("--streams", default="1,16", help="concurrent streams, one row each")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        import uvloop

        uvloop.install()
        asyncio.run(_serve())
        return
    server = subprocess.Popen(
        [sys.executable, "-m", "tests.bench.grpc_floor", "--serve"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        asyncio.run(_load(port, 8, 400))  # warm up
        for streams in (int(s) for s in args.streams.split(",")):
            before = cpu_seconds(server.pid)
            asyncio.run(_load(port, streams, args.pairs))
            per_pair = (cpu_seconds(server.pid) - before) / args.pairs
            print(f"{streams:>3} streams: server CPU per message pair {per_pair * 1e6:.1f} us")
    finally:
        server.kill()
        server.wait()


if __name__ == "__main__":
    main()
