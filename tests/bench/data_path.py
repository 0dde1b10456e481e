"""Benchmark (not a test): the CPU of every process on a request's path, through Envoy + the
EPP and through SGLang's model gateway, side by side in one run.

The same simulated vLLM servers (``--itl-ms`` apart per token, so every token of a streamed
response is its own chunk) are behind three front ends, all up at once:

- ``envoy+epp``: the shipped ``deploy/envoy/envoy.yaml``, response bodies through ext_proc
  (``response_body_mode: FULL_DUPLEX_STREAMED``);
- ``envoy+epp lean``: the same Envoy config with ``response_body_mode: NONE`` (response
  trailers still ``SEND``), the same EPP process: the EPP sees the response's headers and
  its end, no chunk (docs/decisions/0028);
- ``sglang``: ``sglang-router`` (the ``bench`` extra, installed on first use), policy
  ``cache_aware``, which is itself the HTTP proxy;
- ``envoy alone``: the shipped Envoy config without ext_proc, the client naming a server at
  random in ``x-gateway-destination-endpoint``: what Envoy's proxying costs with no EPP and
  no routing decision, the floor of the first two.

The Envoys run the shipped config (without the test stack's stand-in trusted filter).

Four workloads: completions of ``--tokens`` (default 30 and 300) output tokens, not streamed
and streamed (``stream: true`` with usage). Prompts share one of ``--prefixes`` long
prefixes, so the cache-aware policies have work to do. Each round runs every workload through
every front end in turn, closed loop at ``--concurrency``, or open loop at ``--rate``
requests/s (Poisson arrivals, as a load tool at a fixed rate sends them); ``--rounds`` rounds
alternate, so that the machine's drifting load falls on each alike.

For each process (the EPP, each Envoy, the SGLang router with its children) the CPU time is
read from ``/proc`` before and after each run and given per request, net of its idle CPU
(measured for ``--idle-seconds`` with no traffic before the rounds: the EPP's scrapes, the
router's health checks). A run's CPU belongs to its front end alone: the EPP's CPU in an
``envoy+epp`` run is the EPP's, the other Envoy and the router being idle then. Also printed:
requests/s, latency, errors, ext_proc messages Envoy sent the EPP per request, and Envoy's
``ext_proc.rejected_header_mutations`` (must be 0).

    .venv/bin/python -m tests.bench.data_path [--requests 400] [--rounds 2] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import aiohttp
import orjson

from tests.bench.load import cpu_seconds
from tests.bench.routing_quality import sglang_router_missing, start_sglang_router
from tests.simulator import DEFAULT_MODEL
from tests.support.stack import ChildProcess, Stack, StackOptions

FULL = "envoy+epp"
LEAN = "envoy+epp lean"
SGLANG = "sglang"
ALONE = "envoy alone"


def _tree_cpu(pid: int) -> float:
    """CPU seconds of ``pid`` and its live descendants."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        try:
            total += cpu_seconds(current)
        except OSError:
            continue
        todo.extend(children.get(current, ()))
    return total


@dataclass
class Sample:
    requests: int = 0
    seconds: float = 0.0
    errors: int = 0
    latencies_ms: list[float] = field(default_factory=list)
    #: process name → CPU seconds, net of idle
    cpu: dict[str, float] = field(default_factory=dict)
    messages: int = 0

    def add(self, other: Sample) -> None:
        self.requests += other.requests
        self.seconds += other.seconds
        self.errors += other.errors
        self.latencies_ms.extend(other.latencies_ms)
        for name, value in other.cpu.items():
            self.cpu[name] = self.cpu.get(name, 0.0) + value
        self.messages += other.messages

    def ms_per_request(self, name: str) -> float:
        return self.cpu.get(name, 0.0) / max(1, self.requests) * 1000

    def percentile(self, q: float) -> float:
        ordered = sorted(self.latencies_ms)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def _bodies(tokens: int, stream: bool, prefixes: int, seed: int) -> Callable[[], bytes]:
    rng = random.Random(seed)
    heads = [
        f"System prompt {i}: " + f"You answer questions about topic {i}. " * 40
        for i in range(prefixes)
    ]

    def body() -> bytes:
        document: dict[str, object] = {
            "model": DEFAULT_MODEL,
            "prompt": rng.choice(heads) + f"Question {rng.randrange(1 << 30)}?",
            "max_tokens": tokens,
        }
        if stream:
            document["stream"] = True
            document["stream_options"] = {"include_usage": True}
        return orjson.dumps(document)

    return body


def _json_headers() -> dict[str, str]:
    return {"content-type": "application/json"}


async def _load(
    url: str,
    body: Callable[[], bytes],
    total: int,
    concurrency: int,
    headers: Callable[[], dict[str, str]] = _json_headers,
    rate: float = 0.0,
) -> tuple[float, list[float], int]:
    """``total`` requests, closed loop at ``concurrency``, or, with ``rate`` (requests/s),
    open loop: Poisson arrivals at that rate, at most ``concurrency`` at once."""
    latencies: list[float] = []
    errors = 0
    remaining = total

    async def one(session: aiohttp.ClientSession) -> None:
        nonlocal errors
        started = time.perf_counter()
        try:
            async with session.post(
                f"{url}/v1/completions", data=body(), headers=headers()
            ) as response:
                await response.read()
                if response.status != 200:
                    errors += 1
        except aiohttp.ClientError:
            errors += 1
        latencies.append((time.perf_counter() - started) * 1000)

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            await one(session)

    async def arrivals(session: aiohttp.ClientSession) -> None:
        rng = random.Random(total)
        tasks = []
        for _ in range(total):
            tasks.append(asyncio.create_task(one(session)))
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)

    connector = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        started = time.perf_counter()
        if rate > 0:
            await arrivals(session)
        else:
            await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        return time.perf_counter() - started, latencies, errors


@dataclass(frozen=True)
class FrontEnd:
    name: str
    url: str
    #: process name → pid, the processes on this front end's path
    processes: dict[str, int]
    envoy_name: str | None = None
    headers: Callable[[], dict[str, str]] = _json_headers


def _messages(stack: Stack, envoy_name: str | None) -> int:
    if envoy_name is None:
        return 0
    counters = stack.envoy_counters(envoy_name, "ext_proc.stream_msgs_sent")
    return sum(counters.values())


def _run(
    stack: Stack,
    front: FrontEnd,
    body: Callable[[], bytes],
    total: int,
    concurrency: int,
    idle: dict[str, float],
    rate: float = 0.0,
) -> Sample:
    before = {name: _tree_cpu(pid) for name, pid in front.processes.items()}
    messages = _messages(stack, front.envoy_name)
    seconds, latencies, errors = asyncio.run(
        _load(front.url, body, total, concurrency, front.headers, rate)
    )
    cpu = {
        name: _tree_cpu(pid) - before[name] - idle[name] * seconds
        for name, pid in front.processes.items()
    }
    return Sample(
        requests=total,
        seconds=seconds,
        errors=errors,
        latencies_ms=latencies,
        cpu=cpu,
        messages=_messages(stack, front.envoy_name) - messages,
    )


def _pid(child: ChildProcess | None) -> int:
    assert child is not None
    assert child.process is not None
    return child.process.pid


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400, help="per workload, front end, round")
    parser.add_argument(
        "--long-requests", type=int, default=0, help="per run of the longer outputs (0: a third)"
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument(
        "--rate",
        type=float,
        default=0.0,
        help="requests/s, open loop (Poisson arrivals, at most --concurrency at once); "
        "0: closed loop",
    )
    parser.add_argument("--simulators", type=int, default=4)
    parser.add_argument("--itl-ms", type=float, default=2.0)
    parser.add_argument("--tokens", default="30,300", help="output tokens per workload")
    parser.add_argument("--prefixes", type=int, default=16)
    parser.add_argument("--idle-seconds", type=float, default=3.0)
    parser.add_argument("--no-sglang", action="store_true", help="without the SGLang column")
    parser.add_argument("--epp-arg", action="append", default=[], help="extra EPP flag")
    parser.add_argument(
        "--plaintext", action="store_true", help="the EPP without TLS (Envoy to it in clear)"
    )
    args = parser.parse_args(argv)

    missing = None if args.no_sglang else sglang_router_missing()
    if missing:
        print(f"without the sglang column: {missing}")
    token_counts = [int(t) for t in args.tokens.split(",")]
    workloads = [
        (f"{'streamed' if stream else 'non-streamed'} {tokens}", tokens, stream)
        for tokens in token_counts
        for stream in (False, True)
    ]
    options = StackOptions(
        simulators=args.simulators,
        simulator_args=["--itl-ms", str(args.itl_ms)],
        epp_args=args.epp_arg,
        epp_tls=not args.plaintext,
        envoy_trusted_test_filter=False,
    )
    results: dict[tuple[str, str], Sample] = {}
    rejected: dict[str, int] = {}
    with Stack.run(options) as stack:
        _, lean_port = stack.start_envoy(ext_proc=True, name="envoy-lean", response_body=False)
        epp = _pid(stack.epp)
        fronts = [
            FrontEnd(FULL, stack.url, {"epp": epp, "envoy": _pid(stack.envoy)}, "envoy"),
            FrontEnd(
                LEAN,
                f"http://127.0.0.1:{lean_port}",
                {"epp": epp, "envoy": _pid(stack.children[-1])},
                "envoy-lean",
            ),
        ]
        if not args.no_sglang and not missing:
            url = start_sglang_router(stack, "cache_aware")
            fronts.append(FrontEnd(SGLANG, url, {"router": _pid(stack.children[-1])}))
        _, alone_port = stack.start_envoy(ext_proc=False, name="envoy-alone")
        servers = list(stack.simulator_addresses.values())
        chooser = random.Random(7)

        def chosen_server() -> dict[str, str]:
            return {**_json_headers(), "x-gateway-destination-endpoint": chooser.choice(servers)}

        fronts.append(
            FrontEnd(
                ALONE,
                f"http://127.0.0.1:{alone_port}",
                {"envoy": _pid(stack.children[-1])},
                headers=chosen_server,
            )
        )
        # warm-up: connections, code paths, the prefixes cached everywhere
        for front in fronts:
            _run(
                stack,
                front,
                _bodies(4, True, args.prefixes, 1),
                200,
                args.concurrency,
                {name: 0.0 for name in front.processes},
            )
        started = time.monotonic()
        pids = {name: pid for front in fronts for name, pid in front.processes.items()}
        idle_before = {name: _tree_cpu(pid) for name, pid in pids.items()}
        time.sleep(args.idle_seconds)
        elapsed = time.monotonic() - started
        idle = {name: (_tree_cpu(pid) - idle_before[name]) / elapsed for name, pid in pids.items()}
        for round_ in range(args.rounds):
            for label, tokens, stream in workloads:
                total = args.requests
                if tokens > min(token_counts):
                    total = args.long_requests or max(args.concurrency, args.requests // 3)
                order = fronts if round_ % 2 == 0 else list(reversed(fronts))
                for front in order:
                    body = _bodies(tokens, stream, args.prefixes, 100 + round_)
                    sample = _run(stack, front, body, total, args.concurrency, idle, args.rate)
                    results.setdefault((label, front.name), Sample()).add(sample)
        for front in fronts:
            if front.envoy_name is not None:
                counters = stack.envoy_counters(front.envoy_name, "rejected_header_mutations")
                rejected[front.name] = sum(counters.values())

    names = [front.name for front in fronts]
    print(
        f"{time.strftime('%Y-%m-%d')}, {platform.node()}, {os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.1f}; {args.simulators} simulated servers (ITL {args.itl_ms:g} ms),"
        f" concurrency {args.concurrency}"
        + (f", open loop at {args.rate:g} requests/s" if args.rate else ", closed loop")
        + f", {args.rounds} rounds, EPP TLS "
        f"{'off' if args.plaintext else 'on'}, EPP flags {args.epp_arg or 'default'}; "
        "idle CPU (% of a core): "
        + ", ".join(f"{name} {rate * 100:.1f}" for name, rate in idle.items())
    )
    print(
        "CPU ms per request, net of idle (EPP, Envoy, their sum; the SGLang router; Envoy "
        "without ext_proc):"
    )
    header = f"{'workload':<18}" + "".join(
        f"{h:>11}"
        for h in (
            "EPP",
            "Envoy",
            "E+E",
            "EPP lean",
            "Envoy lean",
            "E+E lean",
            "sglang",
            "Envoy alone",
        )
    )
    print(header)
    for label, _, _ in workloads:
        full = results.get((label, FULL), Sample())
        lean = results.get((label, LEAN), Sample())
        row = [
            full.ms_per_request("epp"),
            full.ms_per_request("envoy"),
            full.ms_per_request("epp") + full.ms_per_request("envoy"),
            lean.ms_per_request("epp"),
            lean.ms_per_request("envoy"),
            lean.ms_per_request("epp") + lean.ms_per_request("envoy"),
        ]
        sglang = results.get((label, SGLANG))
        alone = results[(label, ALONE)]
        cells = "".join(f"{v:>11.3f}" for v in row)
        cells += f"{sglang.ms_per_request('router'):>11.3f}" if sglang else f"{'-':>11}"
        cells += f"{alone.ms_per_request('envoy'):>11.3f}"
        print(f"{label:<18}{cells}")
    print("requests/s, p50 / p99 latency ms, errors, ext_proc messages per request:")
    for label, _, _ in workloads:
        for name in names:
            s = results[(label, name)]
            print(
                f"  {label:<16} {name:<15} {s.requests / s.seconds:>7.1f}/s "
                f"{s.percentile(0.5):>8.1f} {s.percentile(0.99):>8.1f} "
                f"errors {s.errors:<3} messages {s.messages / max(1, s.requests):.1f}"
            )
    print(
        "Envoy's ext_proc.rejected_header_mutations: "
        + ", ".join(f"{name} {count}" for name, count in rejected.items())
    )
    ratios = []
    for label, _, _ in workloads:
        sglang = results.get((label, SGLANG))
        if sglang is None or sglang.ms_per_request("router") <= 0:
            continue
        full = results[(label, FULL)]
        lean = results[(label, LEAN)]
        router = sglang.ms_per_request("router")
        both = full.ms_per_request("epp") + full.ms_per_request("envoy")
        both_lean = lean.ms_per_request("epp") + lean.ms_per_request("envoy")
        floor = results[(label, ALONE)].ms_per_request("envoy")
        ratios.append(
            f"  {label}: E+E / sglang {both / router:.2f}, lean {both_lean / router:.2f}, "
            f"Envoy alone {floor / router:.2f}"
        )
    if ratios:
        print("ratios:")
        print("\n".join(ratios))


if __name__ == "__main__":
    main()
