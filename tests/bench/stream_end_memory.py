"""Native memory per ext_proc stream (not a test, not run by the suite): streams ended the
way Envoy ends them, straight to the EPP process, and the EPP's resident memory after each
block of them.

Starts the EPP (``tests.support.stack``, one simulator as its endpoint, no Envoy) and drives
``--streams`` (30,000) ``Process`` streams, ``--concurrency`` (16) at a time, each a whole
exchange as Envoy sends it: request headers and a small completion body, the replies, then
response headers and a non-streamed response body with end of stream, and its reply. Each
stream then ends as ``--end`` says:

- ``reset`` (Envoy's way: its ``cluster.epp.http2.tx_reset`` counts about one per request):
  half-close, then cancel (RST_STREAM) at once, without waiting for the EPP's status;
- ``half-close``: half-close and wait for the status.

The prompt is the same on every stream, so the prefix index does not grow. After a warm-up
of ``--warmup`` (2,000) streams it prints, every ``--block`` (5,000) streams, the EPP's
VmRSS, the streams' rate, and the growth per stream since the warm-up. Memory that grows
here per stream and never comes back is native (tracemalloc does not see it): grpc.aio
leaks the operation array of a batch that fails on a call the client already reset. RSS is
coarse (the allocators' own growth dominates the first tens of thousands of streams); for
an exact count attach ``heaptrack -p <EPP pid>`` and read ``heaptrack_print --print-leaks 1``
(docs/decisions/0016-end-extproc-stream-when-response-ends.md).

    .venv/bin/python -m tests.bench.stream_end_memory [--streams 30000] [--end reset]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import time
from typing import Any

from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from tests.support.extproc import (
    epp_tls_channel,
    non_streamed_exchange,
)
from tests.support.stack import Stack, StackOptions

__all__ = ["main"]


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


async def _one(stub: Any, end: str) -> None:
    call = await non_streamed_exchange(stub)
    with contextlib.suppress(asyncio.InvalidStateError):  # the EPP already ended the call
        await call.done_writing()
    if end == "reset":
        call.cancel()
    else:
        await call.code()


async def _drive(stack: Stack, args: argparse.Namespace) -> None:
    assert stack.epp is not None
    assert stack.epp.process is not None
    pid = stack.epp.process.pid
    channel = epp_tls_channel(stack.epp_port)
    stub = pb_grpc.ExternalProcessorStub(channel)
    done = 0
    base: tuple[int, int] | None = None
    started = time.monotonic()
    block_started = started
    print(
        f"EPP pid {pid}, --end {args.end}, {args.concurrency} streams at a time; load "
        f"{os.getloadavg()[0]:.2f}"
    )
    print(f"{'streams':>8} {'RSS MiB':>8} {'streams/s':>9} {'bytes/stream since warm-up':>27}")

    async def worker(count: int) -> None:
        nonlocal done
        for _ in range(count):
            await _one(stub, args.end)
            done += 1

    total = args.warmup + args.streams
    for goal in [args.warmup, *range(args.warmup + args.block, total + 1, args.block)]:
        todo = goal - done
        share = [todo // args.concurrency] * args.concurrency
        for i in range(todo % args.concurrency):
            share[i] += 1
        await asyncio.gather(*(worker(n) for n in share if n))
        await asyncio.sleep(1.0)  # the EPP finishes the last streams' work
        rss = _rss_kib(pid)
        now = time.monotonic()
        rate = todo / (now - block_started)
        block_started = now
        if base is None:
            base = (done, rss)
            per = "(warm-up)"
        else:
            per = f"{(rss - base[1]) * 1024 / (done - base[0]):.0f}"
        print(f"{done:8d} {rss / 1024:8.1f} {rate:9.0f} {per:>27}", flush=True)
    await channel.close()
    print(f"load {os.getloadavg()[0]:.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--streams", type=int, default=30_000)
    parser.add_argument("--warmup", type=int, default=2_000)
    parser.add_argument("--block", type=int, default=5_000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--end", choices=["reset", "half-close"], default="reset")
    args = parser.parse_args()
    with Stack.run(StackOptions(simulators=1, envoy=False)) as stack:
        asyncio.run(_drive(stack, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
