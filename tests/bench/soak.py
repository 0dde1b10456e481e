"""Soak (not a test, not run by the suite): normal traffic through Envoy, the EPP and
simulated model servers for a while, watching that nothing grows or slows down.

Starts a stack (``tests.support.stack``): ``--instances`` (3) simulators with no delays, the
EPP with its default profile, and the shipped Envoy config. ``--concurrency`` (16) clients
send, back to back, a mix of ``/v1/completions`` and ``/v1/chat/completions``, a third of
them streamed, with prompts from a few shared prefixes (so the prefix cache works), for
``--duration`` (5m). Every ``--interval`` (30s) it prints the window's answers by HTTP
status, the EPP's resident memory (VmRSS), the prefix index's size (its
``inference_extension_prefix_indexer_size`` gauge: blocks held, bounded by the LRU
capacity per endpoint), and the client-side latency p50/p99 of the window's requests: the
simulators answer at once, so that latency is Envoy plus the EPP's routing; finally the
totals. ``--trace-memory`` runs the EPP with ``tracemalloc`` (``tests.bench.traced_epp``,
slower) and prints, every interval, the allocation sites that grew most since the start.

    .venv/bin/python -m tests.bench.soak [--duration 5m] [--interval 30s] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import signal
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import orjson

from app.durations import parse_duration
from tests.simulator import DEFAULT_MODEL
from tests.support.stack import Stack, StackOptions

__all__ = ["main"]

_PREFIXES = [
    "You are a helpful assistant. " * 20,
    "Summarise the following support ticket for an engineer. " * 12,
    "Translate into French, keeping the formatting. " * 15,
    "",
]


@dataclass(slots=True)
class _Window:
    statuses: Counter[int | str] = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _prefix_index_size(stack: Stack) -> float:
    try:
        with urllib.request.urlopen(stack.epp_metrics_url, timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return float("nan")
    found = re.search(r"^inference_extension_prefix_indexer_size(?:\{[^}]*\})? (\S+)$", text, re.M)
    return float(found.group(1)) if found else float("nan")


def _memory_diff(stack: Stack, out: Path) -> str:
    """Has ``tests.bench.traced_epp`` append a snapshot; returns it (top 6 sites)."""
    assert stack.epp is not None
    size = len(out.read_text()) if out.exists() else 0
    stack.epp.signal(signal.SIGUSR1)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        time.sleep(0.2)
        text = out.read_text()[size:] if out.exists() else ""
        if text.rstrip().endswith("s)"):
            return "\n".join(text.rstrip().splitlines()[:7])
    return "(no tracemalloc snapshot within 60 s)"


def _request(rng: random.Random, n: int) -> tuple[str, bytes]:
    prefix = rng.choice(_PREFIXES)
    question = f"question {n} about item {rng.randrange(1000)}"
    stream = rng.random() < 1 / 3
    payload: dict[str, object] = {"model": DEFAULT_MODEL, "max_tokens": 8, "stream": stream}
    if rng.random() < 0.5:
        payload["messages"] = [
            {"role": "system", "content": prefix},
            {"role": "user", "content": question},
        ]
        return "/v1/chat/completions", orjson.dumps(payload)
    payload["prompt"] = prefix + question
    return "/v1/completions", orjson.dumps(payload)


async def _soak(
    stack: Stack, duration: float, interval: float, concurrency: int, memory_out: Path | None
) -> int:
    assert stack.epp is not None
    assert stack.epp.process is not None
    pid = stack.epp.process.pid
    window = _Window()
    total: Counter[int | str] = Counter()
    all_latencies: list[float] = []
    deadline = time.monotonic() + duration
    rng = random.Random(1)
    sent = 0

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal sent
        while time.monotonic() < deadline:
            sent += 1
            path, body = _request(rng, sent)
            started = time.perf_counter()
            try:
                async with session.post(
                    stack.url + path, data=body, headers={"content-type": "application/json"}
                ) as response:
                    await response.read()
                    status: int | str = response.status
            except aiohttp.ClientError as exc:
                status = type(exc).__name__
            elapsed = (time.perf_counter() - started) * 1000
            window.statuses[status] += 1
            window.latencies.append(elapsed)

    print(f"EPP pid {pid}, RSS at start {_rss_mib(pid):.1f} MiB, load {os.getloadavg()[0]:.2f}")
    if memory_out is not None:
        print(await asyncio.to_thread(_memory_diff, stack, memory_out))
    print(
        f"{'t (s)':>6} {'answers by status':<34} {'RSS MiB':>8} {'prefix':>8} {'p50 ms':>7} "
        f"{'p99 ms':>7}"
    )
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        clients = [asyncio.create_task(client(session)) for _ in range(concurrency)]
        started = time.monotonic()
        while not all(c.done() for c in clients):
            await asyncio.wait(clients, timeout=interval)
            current, window = window, _Window()
            total.update(current.statuses)
            all_latencies.extend(current.latencies)
            statuses = ", ".join(f"{k}: {v}" for k, v in sorted(current.statuses.items(), key=str))
            prefix = await asyncio.to_thread(_prefix_index_size, stack)
            print(
                f"{time.monotonic() - started:6.0f} {statuses:<34} {_rss_mib(pid):8.1f} "
                f"{prefix:8.0f} {_percentile(current.latencies, 0.5):7.1f} "
                f"{_percentile(current.latencies, 0.99):7.1f}",
                flush=True,
            )
            if memory_out is not None:
                print(await asyncio.to_thread(_memory_diff, stack, memory_out), flush=True)
        for c in clients:
            c.result()
    ok = total.get(200, 0)
    print(
        f"total: {sum(total.values())} requests, {dict(total)}; p50 "
        f"{_percentile(all_latencies, 0.5):.1f} ms, p99 {_percentile(all_latencies, 0.99):.1f} "
        f"ms; load {os.getloadavg()[0]:.2f}"
    )
    return 0 if ok == sum(total.values()) else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--duration", type=parse_duration, default=parse_duration("5m"))
    parser.add_argument("--interval", type=parse_duration, default=parse_duration("30s"))
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--instances", type=int, default=3)
    parser.add_argument("--trace-memory", action="store_true")
    parser.add_argument(
        "--epp-env", action="append", default=[], metavar="NAME=VALUE", help="EPP environment"
    )
    parser.add_argument(
        "--epp-arg", action="append", default=[], metavar="FLAG", help="an extra EPP flag"
    )
    parser.add_argument("--epp-module", default="app", help="the module run as the EPP")
    args = parser.parse_args()
    env = dict(item.split("=", 1) for item in args.epp_env)
    with tempfile.TemporaryDirectory(prefix="epp-soak-") as tmp:
        memory_out = Path(tmp) / "tracemalloc.txt" if args.trace_memory else None
        options = StackOptions(
            simulators=args.instances,
            epp_module="tests.bench.traced_epp" if memory_out else args.epp_module,
            epp_env={**env, "EPP_TRACEMALLOC_OUT": str(memory_out)} if memory_out else env,
            epp_args=args.epp_arg,
        )
        with Stack.run(options) as stack:
            return asyncio.run(
                _soak(stack, args.duration, args.interval, args.concurrency, memory_out)
            )


if __name__ == "__main__":
    raise SystemExit(main())
