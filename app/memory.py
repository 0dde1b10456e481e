"""Giving freed heap memory back to the system (glibc only).

After a burst (a large request body refused, a large response passed through, thousands of
streams opened and closed, a large ``/metrics`` render in its worker thread), CPython frees
its objects but glibc's malloc keeps the pages in its arenas: the process's resident memory
stays at the burst's peak. ``malloc_trim(0)`` returns every free page of every arena.
``trim_periodically`` calls it in a worker thread every ``interval`` seconds, so the loop
never waits on the arenas' locks; it costs a few milliseconds of CPU a time. Elsewhere than
glibc, ``malloc_trim`` is ``None`` and nothing is done.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import platform
from collections.abc import Callable

__all__ = ["TRIM_INTERVAL", "malloc_trim", "trim_periodically"]


#: Seconds between two trims.
TRIM_INTERVAL = 10.0


def _glibc_malloc_trim() -> Callable[[], int] | None:
    if platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int

    def malloc_trim() -> int:
        """1 when memory was returned to the system, else 0."""
        return int(trim(0))

    return malloc_trim


#: ``malloc_trim(0)`` of glibc, or ``None`` on another C library.
malloc_trim = _glibc_malloc_trim()


async def trim_periodically(interval: float = TRIM_INTERVAL) -> None:
    """Runs until cancelled (start it only where ``malloc_trim`` is not ``None``)."""
    trim = malloc_trim
    if trim is None:
        raise RuntimeError("no glibc malloc_trim")
    while True:
        await asyncio.sleep(interval)
        await asyncio.to_thread(trim)
