"""Open-file descriptors: the soft limit raised to the hard one at start, and a watch that
logs when the process has run out of them.

Every connection is a descriptor. With the soft ``nofile`` limit many hosts and runtimes
still give (1,024), 1,100 idle connections made every new connection fail, Envoy's
included, and nothing said so: the event loop's accept fails (uvloop accepts and closes
the connection at once, asyncio pauses accepting for a second) without a line in the log.
So ``raise_open_file_limit`` lifts the soft limit to the hard one (which a process may do
without privileges) and says so, and ``watch_descriptors`` counts the process's open
descriptors every second and logs, once per change, when none is left (connections are
being refused) and when there are again.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import resource

__all__ = ["FD_DIRECTORY", "raise_open_file_limit", "watch_descriptors"]

logger = logging.getLogger(__name__)

#: Where the process's open descriptors are listed (Linux).
FD_DIRECTORY = "/proc/self/fd"
#: The soft limit when the hard one is unlimited (Linux's default ``fs.nr_open``).
_UNLIMITED_TARGET = 1 << 20
#: Out of descriptors: at most this many free (the count itself needs one).
_EXHAUSTED_FREE = 2


def raise_open_file_limit(*, log: bool = True) -> tuple[int, int]:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit; returns (before, after). Logged
    (info) when it changed, a warning when it could not be raised."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, _nr_open())
    if soft != resource.RLIM_INFINITY and soft >= target:
        return soft, soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (OSError, ValueError) as exc:
        if log:
            logger.warning(
                "open files: soft limit %d, could not raise it to %d: %s", soft, target, exc
            )
        return soft, soft
    if log:
        logger.info("open files: soft limit raised from %d to the hard limit %d", soft, target)
    return soft, target


def _nr_open() -> int:
    try:
        with open("/proc/sys/fs/nr_open") as file:
            return int(file.read())
    except (OSError, ValueError):
        return _UNLIMITED_TARGET


def _in_use() -> tuple[int, int] | None:
    """(open descriptors, soft limit); ``None`` where they cannot be listed."""
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    try:
        listed = len(os.listdir(FD_DIRECTORY)) - 1  # the listing's own descriptor
    except OSError as exc:
        if exc.errno in (errno.EMFILE, errno.ENFILE):
            return limit, limit
        return None
    return listed, limit


async def watch_descriptors(period: float = 1.0) -> None:
    """Every ``period`` seconds, count the open descriptors; log a warning when at most
    ``_EXHAUSTED_FREE`` are free (new connections are refused) and an info line when
    under nine tenths of the limit are in use again. Ends where they cannot be counted."""
    exhausted = False
    while True:
        counted = await asyncio.to_thread(_in_use)
        if counted is None:
            return
        in_use, limit = counted
        if limit == resource.RLIM_INFINITY:
            return
        if not exhausted and limit - in_use <= _EXHAUSTED_FREE:
            exhausted = True
            logger.warning(
                "open files: %d of the limit %d in use; new connections, Envoy's included, "
                "are refused until some close (raise the nofile limit)",
                in_use,
                limit,
            )
        elif exhausted and in_use < limit * 9 // 10:
            exhausted = False
            logger.info(
                "open files: %d of the limit %d in use; new connections accepted again",
                in_use,
                limit,
            )
        await asyncio.sleep(period)
