"""Benchmark (not a test): memory and speed of the in-memory prefix index.

Fills an ``InMemoryPrefixIndex`` with 100 endpoints x 31,250 distinct hashes each (the
default ``lruCapacityPerServer``), and prints the bytes per (hash, endpoint) entry, from
tracemalloc (Python allocations) and from the process RSS growth. Then times, for
256-hash requests: ``match`` on a fully held prefix, on a prefix held by several endpoints
and on a miss, ``add`` of hashes already held (re-touch), and ``add`` of new hashes at full
capacity (each one evicts), the chained hashing of a 256-block prompt, and a whole request
through the producer (hash, match, set attributes on 100 candidates, index).

    .venv/bin/python -m tests.bench.prefix_index_memory [--endpoints 100] [--entries 31250]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import random
import time
import tracemalloc
from collections.abc import Callable

from domain.datastore.store import Datastore
from domain.plugins.base import TypedName
from domain.prefixcache.hasher import StdlibBlockHasher
from domain.prefixcache.index import InMemoryPrefixIndex
from domain.requestcontrol.plugins import prefix_producer
from domain.requestcontrol.plugins.prefix_producer import (
    ApproxPrefixCacheProducer,
    PrefixCacheParameters,
)
from domain.scheduling.types import Candidate, ProfileRunResult, SchedulingResult
from ports.endpoints import EndpointEvent, EndpointEventKind
from ports.prefix_index import BlockHasher
from tests.support.scheduling import endpoint, inference_request, plugin_handle

REQUEST_BLOCKS = 256


def rss_bytes() -> int:
    """Resident set size of this process (Linux ``/proc``), 0 where unavailable."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def fill(index: InMemoryPrefixIndex, endpoints: int, entries: int, rng: random.Random) -> None:
    """Adds ``entries`` distinct hashes per endpoint, in 256-hash requests."""
    for e in range(endpoints):
        name = f"pool-model-server-{e:03d}-rank-0"
        remaining = entries
        while remaining:
            n = min(REQUEST_BLOCKS, remaining)
            index.add_sync([rng.getrandbits(64) for _ in range(n)], name, entries)
            remaining -= n


def per_call_us(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--endpoints", type=int, default=100)
    parser.add_argument("--entries", type=int, default=31_250)
    parser.add_argument("--calls", type=int, default=2_000)
    args = parser.parse_args()
    rng = random.Random(1)
    total = args.endpoints * args.entries

    # RSS first (tracemalloc's own bookkeeping would inflate it), then tracemalloc.
    gc.collect()
    rss_before = rss_bytes()
    index = InMemoryPrefixIndex()
    fill(index, args.endpoints, args.entries, rng)
    gc.collect()
    rss_after = rss_bytes()
    assert index.size() == total, index.size()
    del index
    gc.collect()

    tracemalloc.start()
    index = InMemoryPrefixIndex()
    fill(index, args.endpoints, args.entries, rng)
    gc.collect()
    traced, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()

    print(f"entries: {total:,} ({args.endpoints} endpoints x {args.entries:,})")
    print(f"tracemalloc: {traced / 2**20:8.1f} MiB  {traced / total:6.1f} bytes/entry")
    if rss_before and rss_after:
        rss = rss_after - rss_before
        print(f"RSS growth:  {rss / 2**20:8.1f} MiB  {rss / total:6.1f} bytes/entry")

    # Timing on the full index. A request's prefix: held by one endpoint, by several, none.
    held = [rng.getrandbits(64) for _ in range(REQUEST_BLOCKS)]
    index.add_sync(held, "pool-model-server-000-rank-0", args.entries)
    shared = [rng.getrandbits(64) for _ in range(REQUEST_BLOCKS)]
    for e in range(8):
        index.add_sync(
            shared[: REQUEST_BLOCKS - e * 16], f"pool-model-server-{e:03d}-rank-0", 10**9
        )
    missing = [rng.getrandbits(64) for _ in range(REQUEST_BLOCKS)]
    calls = args.calls
    name = "pool-model-server-000-rank-0"
    fresh = iter([[rng.getrandbits(64) for _ in range(REQUEST_BLOCKS)] for _ in range(2 * calls)])
    endpoint_names = [f"pool-model-server-{e:03d}-rank-0" for e in range(args.endpoints)]
    names = iter([rng.choice(endpoint_names) for _ in range(calls)])
    timings: list[tuple[str, Callable[[], object]]] = [
        ("match, held by 1 endpoint", lambda: index.match_sync(held)),
        ("match, held by 8 endpoints", lambda: index.match_sync(shared)),
        ("match, first hash unknown", lambda: index.match_sync(missing)),
        ("add, all already held", lambda: index.add_sync(held, name, args.entries)),
        ("add, all new (256 evictions)", lambda: index.add_sync(next(fresh), name, args.entries)),
        ("  same, random endpoint", lambda: index.add_sync(next(fresh), next(names), args.entries)),
    ]
    print(f"\nper call, {REQUEST_BLOCKS}-hash requests:")
    for label, fn in timings:
        print(f"{label + ':':32s}{per_call_us(fn, calls):8.1f} us")
    hasher: BlockHasher = StdlibBlockHasher()
    prompt = rng.randbytes(REQUEST_BLOCKS * 64)
    stdlib_us = per_call_us(lambda: hasher.chain(prompt, 64, b"model", REQUEST_BLOCKS), calls)
    print(f"{'hash chain, stdlib blake2b:':32s}{stdlib_us:8.1f} us")
    try:
        from adapters.xxhash import XxhashBlockHasher
    except ImportError:
        print(f"{'hash chain, xxh64:':32s}(xxhash not installed)")
    else:
        fast = XxhashBlockHasher()
        xx_us = per_call_us(lambda: fast.chain(prompt, 64, b"model", REQUEST_BLOCKS), calls)
        print(f"{'hash chain, xxh64:':32s}{xx_us:8.1f} us")
        hasher = fast
    producer_us = asyncio.run(time_producer(index, hasher, endpoint_names, rng, calls))
    print(f"{'producer, whole request:':32s}{producer_us:8.1f} us")
    print(f"  (prepare + pre_request, {len(endpoint_names)} candidates, new 16 KiB prompt)")


async def time_producer(
    index: InMemoryPrefixIndex,
    hasher: BlockHasher,
    endpoint_names: list[str],
    rng: random.Random,
    calls: int,
) -> float:
    """µs per request through the producer: hashing, matching, attributes, indexing."""
    handle = plugin_handle(hasher=hasher, prefix_index=index, datastore=Datastore())
    pods = [endpoint(name, cache_block_size=16) for name in endpoint_names]
    for pod in pods:
        handle.datastore.apply(
            EndpointEvent(kind=EndpointEventKind.ADD_OR_UPDATE, endpoint=pod.info)
        )
    producer = ApproxPrefixCacheProducer(
        TypedName(prefix_producer.TYPE, "prefix"), PrefixCacheParameters(), handle
    )
    system = rng.randbytes(4096).hex()  # a shared 8 KiB prefix, then 8 KiB of new text
    requests = [
        inference_request({"model": "m", "prompt": system + rng.randbytes(4096).hex()})
        for _ in range(calls)
    ]
    snapshots = [[Candidate(pod) for pod in pods] for _ in requests]  # the Director's work
    start = time.perf_counter()
    for request, candidates in zip(requests, snapshots, strict=True):
        await producer.prepare_request_data(request, candidates)
        chosen = ProfileRunResult((rng.choice(candidates),))
        result = SchedulingResult(profile_results={"d": chosen}, primary_profile_name="d")
        await producer.pre_request(request, result)
    return (time.perf_counter() - start) / calls * 1e6


if __name__ == "__main__":
    main()
