"""Freed heap memory goes back to the system (glibc's ``malloc_trim``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from app.memory import malloc_trim

ROOT = Path(__file__).resolve().parents[2]

#: A burst of 200 MB of bodies on a worker thread (its own malloc arena), one in 50 kept:
#: the arena's pages stay resident until trimmed.
_BURST = """
import threading
from app.memory import malloc_trim

def rss_mib():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) // 1024

kept = []
def burst():
    bodies = [bytes(2000) + bytes([i % 256]) for i in range(100_000)]
    kept.extend(bodies[::50])

worker = threading.Thread(target=burst)
worker.start()
worker.join()
before = rss_mib()
malloc_trim()
print(before, rss_mib())
"""


@pytest.mark.skipif(malloc_trim is None, reason="glibc only")
def test_a_trim_returns_a_bursts_freed_memory() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _BURST],
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    before, after = (int(v) for v in done.stdout.split())
    # without the trim the freed 196 MB stay resident
    assert before > 150, before
    assert before - after > 100, (before, after)
