"""What one endpoint of the KV-block index costs at its cap (not a test, not run by the suite).

Fills an ``InMemoryKVBlockIndex`` (``indexerConfig.maxBlocksPerEndpoint``, default
1,048,576) for one endpoint with twice its cap of distinct 64-bit hashes, as a publisher
that floods would, a piece of 1,024 at a time, and prints: the entries kept, the bytes
they hold (tracemalloc: the hashes' ints included, as the decoder makes them), per entry
and for the endpoint, the process's RSS growth, the longest single ``apply`` of a piece,
(wall-clock and CPU time: on a busy machine the first includes waiting for a core), and how
long a full garbage collection takes with the index full. Then clears the endpoint
(``AllBlocksCleared``) and times that call, and the calls that free its shards after it.

    .venv/bin/python -m tests.bench.kv_index_memory [--cap 1048576]
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import time
import tracemalloc

from domain.prefixcache.kv_block_index import InMemoryKVBlockIndex
from ports.kv_events import AllBlocksCleared, BlockStored


def _rss() -> int:
    with open(f"/proc/{os.getpid()}/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _fill(index: InMemoryKVBlockIndex, cap: int) -> tuple[list[float], list[float]]:
    """Twice ``cap`` distinct hashes, 1,024 a call; the wall and CPU time of each call."""
    rng = random.Random(1)
    walls: list[float] = []
    cpus: list[float] = []
    for _ in range(2 * cap // 1024):
        piece = (
            BlockStored(
                block_hashes=tuple(rng.getrandbits(64) | (1 << 63) for _ in range(1024)),
                parent_block_hash=None,
                block_size=16,
            ),
        )
        started, cpu = time.perf_counter(), time.thread_time()
        index.apply("flooding", piece)
        walls.append(time.perf_counter() - started)
        cpus.append(time.thread_time() - cpu)
        del piece
    return walls, cpus


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cap", type=int, default=1 << 20)
    args = parser.parse_args()
    cap = args.cap
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 50, 100)  # as the epp process
    # RSS and time, untraced (first: RSS does not shrink after)
    index = InMemoryKVBlockIndex(max_blocks_per_endpoint=cap)
    rss = _rss()
    walls, cpus = _fill(index, cap)
    grown = _rss() - rss
    entries = index.endpoint_size("flooding")
    started = time.perf_counter()
    gc.collect()
    collection = time.perf_counter() - started
    started = time.perf_counter()
    index.apply("flooding", (AllBlocksCleared(),))
    cleared = time.perf_counter() - started
    longest = 0.0
    calls = 0
    while index._released:  # the shards freed by later calls
        started = time.perf_counter()
        index.apply("other", ())
        longest = max(longest, time.perf_counter() - started)
        calls += 1
    # held bytes, traced (tracemalloc slows allocation and adds its own memory: apart)
    traced = InMemoryKVBlockIndex(max_blocks_per_endpoint=cap)
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    _fill(traced, cap)
    held = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    traced.forget("flooding")
    while traced._released:
        traced.apply("other", ())
    print(f"cap {cap:,}: {entries:,} entries kept")
    print(f"  traced {held / 2**20:.1f} MiB = {held / entries:.0f} B per entry")
    print(f"  RSS growth {grown / 2**20:.1f} MiB = {grown / entries:.0f} B per entry")
    walls.sort()
    cpus.sort()
    p99 = len(walls) * 99 // 100
    print(
        f"  apply of 1,024 hashes: longest {walls[-1] * 1000:.1f} ms "
        f"({cpus[-1] * 1000:.1f} ms of CPU), p99 {walls[p99] * 1000:.1f} ms "
        f"({cpus[p99] * 1000:.1f} ms of CPU)"
    )
    print(f"  full garbage collection with the index full {collection * 1000:.1f} ms")
    print(f"  AllBlocksCleared {cleared * 1000:.2f} ms; then {calls} calls freed its shards,")
    print(f"  the longest {longest * 1000:.2f} ms")


if __name__ == "__main__":
    main()
