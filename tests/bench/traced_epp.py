"""The EPP process with ``tracemalloc`` on, for finding what grows (not product code).

    EPP_TRACEMALLOC_OUT=/tmp/mem.txt python -m tests.bench.traced_epp <the epp command's flags>

The same process as ``python -m app``. Each SIGUSR1 collects garbage, takes a snapshot and
appends to ``$EPP_TRACEMALLOC_OUT``: the traced total, VmRSS before and after
``malloc_trim(0)`` (what glibc gives back is freed memory, not live objects), and the
allocation sites that grew most since the first snapshot (``$EPP_TRACEMALLOC_FRAMES`` frames
each, default 3). Tracing slows the process down; use it to find a leak, not to time one.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import signal
import time
import tracemalloc
from types import FrameType

from app.cli import main as epp_main

_first: list[tracemalloc.Snapshot] = []


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def _malloc_trim() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _dump(signum: int, frame: FrameType | None) -> None:
    started = time.perf_counter()
    gc.collect()
    snapshot = tracemalloc.take_snapshot().filter_traces(
        [tracemalloc.Filter(False, tracemalloc.__file__)]
    )
    current, peak = tracemalloc.get_traced_memory()
    rss = _rss_kib()
    _malloc_trim()
    lines = [
        f"--- snapshot at {time.time():.0f}: traced {current / 2**20:.1f} MiB (peak "
        f"{peak / 2**20:.1f}), VmRSS {rss / 1024:.1f} MiB, after malloc_trim "
        f"{_rss_kib() / 1024:.1f} MiB"
    ]
    tracemalloc.reset_peak()
    if not _first:
        _first.append(snapshot)
    else:
        for stat in snapshot.compare_to(_first[0], "traceback")[:12]:
            where = " <- ".join(
                f"{f.filename.split('/work/')[-1]}:{f.lineno}" for f in stat.traceback
            )
            lines.append(
                f"  {stat.size_diff / 2**20:+8.2f} MiB {stat.count_diff:+8d} blocks  {where}"
            )
    lines.append(f"  (took {time.perf_counter() - started:.2f}s)")
    with open(os.environ.get("EPP_TRACEMALLOC_OUT", "/dev/stderr"), "a") as out:
        out.write("\n".join(lines) + "\n")


def main() -> None:
    tracemalloc.start(int(os.environ.get("EPP_TRACEMALLOC_FRAMES", "3")))
    signal.signal(signal.SIGUSR1, _dump)
    epp_main()


if __name__ == "__main__":
    main()
