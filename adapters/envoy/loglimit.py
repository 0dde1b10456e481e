"""Log lines a peer can cause once per stream or connection, at a bounded rate.

Whoever reaches the ext_proc port decides how often a stream is refused, closed idle or
turned away past a limit; one log line each would let a peer make the EPP format and write
hundreds of lines a second (on its event loop) and fill the log. A ``LogLimiter`` writes the
first ``burst`` lines of each kind in every ``interval``, counts the rest, and puts the count
on the next line of that kind it writes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

__all__ = ["LogLimiter"]


class _Kind:
    __slots__ = ("left_out", "started", "written")

    def __init__(self, now: float) -> None:
        self.started = now
        self.written = 0
        self.left_out = 0


class LogLimiter:
    """``info(format, *args)``: a kind of line is its format string (a fixed set)."""

    def __init__(
        self,
        logger: logging.Logger,
        *,
        burst: int = 10,
        interval: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if burst < 1 or interval <= 0:
            raise ValueError("burst must be at least 1 and interval positive")
        self._logger = logger
        self._burst = burst
        self._interval = interval
        self._clock = clock
        self._kinds: dict[str, _Kind] = {}

    def info(self, message: str, *args: object) -> None:
        if not self._logger.isEnabledFor(logging.INFO):
            return
        now = self._clock()
        kind = self._kinds.get(message)
        if kind is None:
            kind = self._kinds[message] = _Kind(now)
        elif now - kind.started >= self._interval:
            kind.started = now
            kind.written = 0
        if kind.written >= self._burst:
            kind.left_out += 1
            return
        kind.written += 1
        if kind.left_out:
            left_out, kind.left_out = kind.left_out, 0
            self._logger.info(message + " (%d more like this left out before it)", *args, left_out)
        else:
            self._logger.info(message, *args)
