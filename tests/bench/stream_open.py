"""Benchmark (not a test): what the native transport costs per ext_proc stream opened by a
gateway that sends the same header block for every stream.

Envoy opens one ext_proc stream per request, and after its first its HEADERS are the same
bytes each time: fields indexed in HPACK's dynamic table and a ``:path`` literal that is not
indexed (`adapters.envoy.h2` keeps such blocks decoded, see ``headers.HeaderDecoder``). A
raw HTTP/2 client here sends ``--streams`` streams (HEADERS, one message, END_STREAM) in
batches of 100 to an ``H2GrpcServer`` in this process and waits for their statuses; it
prints the process's CPU per stream with the decoded blocks kept and with them turned off,
the two alternated ``--rounds`` times, and the ``hpack`` decode of that block alone.

    .venv/bin/python -m tests.bench.stream_open [--streams 20000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import grpc
import hpack

from adapters.envoy.h2 import H2GrpcServer, MethodHandler
from adapters.envoy.h2 import headers as h2headers
from tests.support.h2frames import (
    DATA,
    END_HEADERS,
    END_STREAM,
    HEADERS,
    INITIAL_WINDOW_SIZE,
    MAX_WINDOW,
    PREFACE,
    WINDOW_UPDATE,
    frame,
    message,
    settings,
)

PATH = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
BATCH = 100


def _gateway_blocks() -> tuple[bytes, bytes]:
    """The first header block (it adds entries) and the one repeated after it."""
    encoder = hpack.Encoder()
    headers: list[Any] = [
        (":method", "POST"),
        hpack.NeverIndexedHeaderTuple(":path", PATH),
        (":authority", "epp"),
        (":scheme", "http"),
        ("te", "trailers"),
        ("content-type", "application/grpc"),
        ("x-envoy-internal", "true"),
        ("x-forwarded-for", "192.0.2.2"),
    ]
    return encoder.encode(headers), encoder.encode(headers)


async def _unary(request: bytes, context: Any) -> bytes:
    return request


class _Client(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.ended = 0
        self.changed = asyncio.Event()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        offset = 0
        while len(self.buffer) - offset >= 9:
            size = int.from_bytes(self.buffer[offset : offset + 3], "big")
            if len(self.buffer) - offset < 9 + size:
                break
            kind, flags = self.buffer[offset + 3], self.buffer[offset + 4]
            if kind == HEADERS and flags & END_STREAM:  # a call's status
                self.ended += 1
            offset += 9 + size
        del self.buffer[:offset]
        self.changed.set()


async def _round(port: int, streams: int, keep: bool) -> float:
    h2headers.DECODED_BLOCKS = 16 if keep else 0
    loop = asyncio.get_running_loop()
    _, client = await loop.create_connection(_Client, "127.0.0.1", port)
    assert client.transport is not None
    # the largest windows: the replies never wait for the client to give credit back
    opening = settings((INITIAL_WINDOW_SIZE, MAX_WINDOW))
    credit = frame(WINDOW_UPDATE, 0, 0, (MAX_WINDOW - 65_535).to_bytes(4, "big"))
    client.transport.write(PREFACE + opening + credit)
    first, repeated = _gateway_blocks()
    body = message(b"hi")
    started = time.process_time()
    for batch_start in range(0, streams, BATCH):
        frames = []
        for n in range(batch_start, min(streams, batch_start + BATCH)):
            stream_id = 2 * n + 1
            block = first if n == 0 else repeated
            frames.append(frame(HEADERS, END_HEADERS, stream_id, block))
            frames.append(frame(DATA, END_STREAM, stream_id, body))
        client.transport.write(b"".join(frames))
        while client.ended < min(streams, batch_start + BATCH):
            client.changed.clear()
            await client.changed.wait()
    used = time.process_time() - started
    client.transport.close()
    return used / streams * 1e6


async def _main(args: argparse.Namespace) -> None:
    server = H2GrpcServer({PATH: MethodHandler(_unary, bytes, bytes, streaming=False)})
    port = await server.start("127.0.0.1", 0)
    results: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.rounds):
        for keep in (True, False):
            results[keep].append(await _round(port, args.streams, keep))
    await server.stop(1.0)
    decoder = hpack.Decoder()
    first, repeated = _gateway_blocks()
    decoder.decode(first, raw=True)
    count = 20_000
    started = time.process_time()
    for _ in range(count):
        decoder.decode(repeated, raw=True)
    decode = (time.process_time() - started) / count * 1e6
    print(f"{args.streams} streams a round, {args.rounds} rounds alternated, CPU per stream:")
    for keep, label in ((True, "blocks kept decoded"), (False, "decoded every time")):
        values = results[keep]
        print(
            f"  {label:20} median {statistics.median(values):6.1f} µs "
            f"(rounds: {', '.join(f'{v:.1f}' for v in values)})"
        )
    print(f"  hpack decode of the repeated block alone: {decode:.1f} µs")
    print(f"  grpc {grpc.__version__}, hpack {hpack.__version__}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--streams", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    asyncio.run(_main(parser.parse_args()))


if __name__ == "__main__":
    main()
