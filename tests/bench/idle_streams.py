"""What a burst of idle ext_proc streams costs the EPP's event loop (not a test, not run by the
suite), straight to the EPP: no Envoy, so no other process shares the measure.

Starts the EPP (``tests.support.stack``, one simulator as its endpoint, no Envoy). A client
process of its own keeps ``--clients`` (4) Envoy-like exchanges going (request headers with
an ``x-request-id``, a small body, the replies, a response and its reply, then the reset
Envoy sends), 10 ms apart each. Then ``--rounds`` (5) times: 3 s quiet, then another process
opens ``--streams`` (1,000) idle streams on ``--connections`` (10) connections of its own
(request headers only, no ``x-request-id``), holds them 0.5 s and closes them. It prints the
CPU seconds of the EPP's event-loop thread per hostile stream while they opened (the normal
exchanges of that window included), and the exchanges' latency p50/p99/max in the quiet,
burst and closing windows. First, in this process, it times the EPP's own Python for such a
stream's request headers (``_Stream`` of ``adapters/envoy/extproc.py``, best of 7 rounds):
the rest of the event loop's cost per stream is grpc.aio's.

    .venv/bin/python -m tests.bench.idle_streams [--streams 1000] [--rounds 5] [EPP flags...]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
from typing import Any

from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from adapters.envoy.extproc import StreamLimits, _Stream
from adapters.envoy.loglimit import LogLimiter
from ports.observer import NoopObserver
from tests.fakes import FakeProcessor
from tests.support.extproc import (
    envoy_headers,
    epp_tls_channel,
    non_streamed_exchange,
    request_headers,
)
from tests.support.stack import Stack, StackOptions

__all__ = ["main"]


def _loop_cpu(pid: int) -> float:
    """CPU seconds of ``pid``'s main thread (the EPP's event loop)."""
    with open(f"/proc/{pid}/task/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _exchange(stub: Any) -> float:
    started = time.perf_counter()
    call = await non_streamed_exchange(stub, ("x-request-id", "normal"))
    call.cancel()
    return (time.perf_counter() - started) * 1000


async def _hostile(port: int, streams: int, connections: int) -> None:
    """Runs in its own process: opens, holds and closes the idle streams, saying when."""
    channels = [epp_tls_channel(port, f"hostile-{i}") for i in range(connections)]
    for channel in channels:
        await channel.channel_ready()
    print("connected", flush=True)
    message = request_headers(envoy_headers())
    calls = [
        pb_grpc.ExternalProcessorStub(channels[i % connections]).Process(timeout=120)
        for i in range(streams)
    ]
    await asyncio.gather(*(c.write(message) for c in calls), return_exceptions=True)
    await asyncio.sleep(0.5)
    print("written", flush=True)
    for call in calls:
        call.cancel()
    for channel in channels:
        await channel.close()


async def _own_python_us() -> float:
    """CPU microseconds of our handling of one hostile stream's request headers, in
    process."""
    message = request_headers(envoy_headers())
    processor, observer, limits = FakeProcessor(), NoopObserver(), StreamLimits()
    log = LogLimiter(logging.getLogger(__name__))
    best = float("inf")
    for _ in range(7):
        started = time.thread_time()  # CPU time: other processes do not inflate it
        for _ in range(5000):
            await _Stream(processor, observer, limits, log).handle(message)
        best = min(best, (time.thread_time() - started) / 5000 * 1e6)
    return best


def _summary(name: str, values: list[float]) -> str:
    if not values:
        return f"{name}: no exchanges"
    ordered = sorted(values)
    p50 = ordered[len(ordered) // 2]
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return (
        f"{name:>8}: {len(ordered):5d} exchanges, p50 {p50:6.1f} ms, p99 {p99:6.1f} ms, "
        f"max {ordered[-1]:6.1f} ms"
    )


async def _run(stack: Stack, args: argparse.Namespace) -> None:
    assert stack.epp is not None
    assert stack.epp.process is not None
    pid = stack.epp.process.pid
    normal = epp_tls_channel(stack.epp_port, "normal")
    await normal.channel_ready()
    stub = pb_grpc.ExternalProcessorStub(normal)
    latencies: dict[str, list[float]] = {"quiet": [], "burst": [], "closing": []}
    window = ["quiet"]
    stopping = asyncio.Event()

    async def client() -> None:
        while not stopping.is_set():
            name = window[0]
            latencies[name].append(await _exchange(stub))
            await asyncio.sleep(0.01)

    clients = [asyncio.create_task(client()) for _ in range(args.clients)]
    print(f"EPP pid {pid}; load {os.getloadavg()[0]:.2f}", flush=True)
    per_stream: list[float] = []
    for n in range(args.rounds):
        window[0] = "quiet"
        await asyncio.sleep(3)
        attacker = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tests.bench.idle_streams",
            "--hostile",
            str(stack.epp_port),
            str(args.streams),
            str(args.connections),
            stdout=asyncio.subprocess.PIPE,
        )
        assert attacker.stdout is not None
        await attacker.stdout.readline()  # connected
        window[0] = "burst"
        before = _loop_cpu(pid)
        await attacker.stdout.readline()  # all streams written and held
        used = _loop_cpu(pid) - before
        window[0] = "closing"
        await attacker.wait()
        await asyncio.sleep(1)
        per_stream.append(used / args.streams * 1e6)
        print(f"round {n}: event loop {per_stream[-1]:.0f} µs CPU per idle stream", flush=True)
    stopping.set()
    await asyncio.gather(*clients)
    await normal.close()
    print(f"event loop per idle stream: {min(per_stream):.0f}-{max(per_stream):.0f} µs")
    for name, values in latencies.items():
        print(_summary(name, values))
    print(f"load {os.getloadavg()[0]:.2f}")


def main() -> int:
    if sys.argv[1:2] == ["--hostile"]:
        port, streams, connections = (int(a) for a in sys.argv[2:5])
        asyncio.run(_hostile(port, streams, connections))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--connections", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--clients", type=int, default=4)
    args, epp_args = parser.parse_known_args()
    own = asyncio.run(_own_python_us())
    print(f"our Python for an idle stream's request headers: {own:.1f} µs CPU (in process)")
    with Stack.run(StackOptions(simulators=1, envoy=False, epp_args=epp_args)) as stack:
        asyncio.run(_run(stack, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
