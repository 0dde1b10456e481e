"""What a loaded config says at start-up about keys and plugins that have no effect here.

The loader collects one line per such item (``ConfigNotices``) and hands them to a
``NoticeLog``, which logs each line the first time it is seen in the process: a config
reload that keeps the same key does not repeat it, a reload that adds one says it once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

__all__ = ["PROCESS_NOTICES", "ConfigNotices", "NoticeLog"]

logger = logging.getLogger(__name__)


class ConfigNotices:
    """The notices of one load, in the order they were found (a line is kept once)."""

    __slots__ = ("_lines",)

    def __init__(self) -> None:
        self._lines: dict[str, int] = {}

    def ignored(self, path: str, why: str) -> None:
        """``path`` is accepted and has no effect here, because ``why``."""
        self._lines.setdefault(f"{path}: accepted and ignored: {why}", logging.INFO)

    def note(self, path: str, what: str, level: int = logging.INFO) -> None:
        """Anything else worth one line at start-up (what was applied, a deprecation)."""
        self._lines.setdefault(f"{path}: {what}", level)

    def extend(self, lines: Iterable[tuple[int, str]]) -> None:
        for level, line in lines:
            self._lines.setdefault(line, level)

    def lines(self) -> tuple[tuple[int, str], ...]:
        return tuple((level, line) for line, level in self._lines.items())


class NoticeLog:
    """Logs each notice line once per ``NoticeLog`` (the process keeps one)."""

    __slots__ = ("_lock", "_said")

    def __init__(self) -> None:
        self._said: set[str] = set()
        self._lock = threading.Lock()

    def say(self, lines: Iterable[tuple[int, str]]) -> int:
        """Logs the lines not said before; returns how many were logged."""
        said = 0
        for level, line in lines:
            with self._lock:
                if line in self._said:
                    continue
                self._said.add(line)
            logger.log(level, "config %s", line)
            said += 1
        return said


#: The process's log: start-up and every reload share it.
PROCESS_NOTICES = NoticeLog()
