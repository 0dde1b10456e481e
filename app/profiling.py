"""``--enable-pprof``: profiling pages on the metrics port, for a live process.

Go's ``net/http/pprof`` paths are kept where Python has the same thing; what each returns is
plain text a person can read (or, for ``profile``, feed to a flame-graph tool):

- ``/debug/pprof/``: the index of these pages.
- ``/debug/pprof/tasks``: every asyncio task of the event loop with its coroutine's stack
  (where a stuck request or background loop is waiting).
- ``/debug/pprof/goroutine`` and ``/debug/pprof/threads``: every thread's current stack
  (the event loop's thread included), from ``sys._current_frames``.
- ``/debug/pprof/profile?seconds=N``: a sampled CPU profile over N seconds (default 10,
  at most 60): a sampler thread records every thread's stack ``SAMPLE_HZ`` times a second
  and the page lists the stacks in the "collapsed" format (``frame;frame;frame count``,
  the input of flamegraph.pl and speedscope), most frequent first, with the threads that
  waited in a poll left out. One profile runs at a time (a second one is answered 409);
  distinct stacks are capped at ``MAX_STACKS`` and each at ``MAX_DEPTH`` frames.

Why sampling and not ``cProfile``: ``cProfile`` instruments every call of the thread that
enables it, slowing the routing path several times while it runs, and sees only that
thread; sampling costs the process one short walk of the frames per tick (about 1% at
100 Hz) and sees every thread. Only CPython frames are visible: time in C (gRPC's core,
OpenSSL) shows as the Python frame that called it.

Everything here reads the interpreter's state; none of it changes the process. The pages
are behind the same authorization as ``/metrics`` (``--metrics-endpoint-auth``).
"""

from __future__ import annotations

import asyncio
import collections
import io
import sys
import threading
import time
import traceback
from collections.abc import Mapping
from types import FrameType

from adapters.prometheus.exporter import TextPage

__all__ = ["MAX_DEPTH", "MAX_STACKS", "SAMPLE_HZ", "Profiler", "pprof_pages"]

SAMPLE_HZ = 100
MAX_SECONDS = 60.0
DEFAULT_SECONDS = 10.0
MAX_STACKS = 20_000
MAX_DEPTH = 128

_INDEX = """\
/debug/pprof/ (--enable-pprof)

tasks                  stacks of every asyncio task
goroutine, threads     stacks of every thread
profile?seconds=N      sampled CPU profile for N seconds (default 10, at most 60),
                       collapsed stacks: "frame;frame;... count", most frequent first
"""

#: Functions in which a thread is idle, not using CPU: their samples are left out.
_IDLE = frozenset(
    {
        ("selectors.py", "select"),
        ("runners.py", "run"),  # uvloop: its loop waits in C below this frame
        ("threading.py", "wait"),
        ("threading.py", "_wait_for_tstate_lock"),
        ("queue.py", "get"),
        ("thread.py", "_worker"),
    }
)


def _frame_name(frame: FrameType) -> str:
    code = frame.f_code
    module = frame.f_globals.get("__name__", "?")
    return f"{module}.{code.co_qualname}:{frame.f_lineno}"


def _stack(frame: FrameType | None) -> list[FrameType]:
    frames: list[FrameType] = []
    while frame is not None and len(frames) < MAX_DEPTH:
        frames.append(frame)
        frame = frame.f_back
    frames.reverse()
    return frames


def _idle(frame: FrameType) -> bool:
    code = frame.f_code
    return (code.co_filename.rsplit("/", 1)[-1], code.co_name) in _IDLE


class Profiler:
    """Samples every thread's stack; one profile at a time."""

    def __init__(self, hz: int = SAMPLE_HZ) -> None:
        self._interval = 1.0 / hz
        self._lock = threading.Lock()

    async def profile(self, seconds: float) -> str | None:
        """Collapsed stacks over ``seconds``; ``None`` when a profile is already running."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            return await asyncio.to_thread(self._sample, seconds)
        finally:
            self._lock.release()

    def _sample(self, seconds: float) -> str:
        counts: collections.Counter[str] = collections.Counter()
        dropped = samples = 0
        me = threading.get_ident()
        names = {t.ident: t.name for t in threading.enumerate()}
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            for ident, top in sys._current_frames().items():
                if ident == me or _idle(top):
                    continue
                key = ";".join(
                    [names.get(ident, f"thread-{ident}"), *map(_frame_name, _stack(top))]
                )
                if key in counts or len(counts) < MAX_STACKS:
                    counts[key] += 1
                else:
                    dropped += 1
            samples += 1
            time.sleep(self._interval)
        out = io.StringIO()
        out.write(
            f"# sampled CPU profile: {seconds:g}s, {samples} ticks at {1 / self._interval:.0f} "
            f"Hz, {sum(counts.values())} busy samples, {dropped} dropped\n"
        )
        for stack, count in counts.most_common():
            out.write(f"{stack} {count}\n")
        return out.getvalue()


def thread_stacks() -> str:
    """Every thread's current stack, innermost frame last."""
    names = {t.ident: (t.name, t.daemon) for t in threading.enumerate()}
    out = io.StringIO()
    for ident, frame in sys._current_frames().items():
        name, daemon = names.get(ident, (f"thread-{ident}", True))
        out.write(f"thread {name} (id {ident}{', daemon' if daemon else ''}):\n")
        out.write("".join(traceback.format_stack(frame)))
        out.write("\n")
    return out.getvalue()


def task_stacks() -> str:
    """Every asyncio task of the running loop with its stack (call on the loop)."""
    tasks = sorted(asyncio.all_tasks(), key=lambda t: t.get_name())
    out = io.StringIO()
    out.write(f"{len(tasks)} asyncio tasks\n\n")
    for task in tasks:
        out.write(f"task {task.get_name()} ({task.get_coro()!r}):\n")
        task.print_stack(limit=MAX_DEPTH, file=out)
        out.write("\n")
    return out.getvalue()


def pprof_pages(profiler: Profiler | None = None) -> dict[str, TextPage]:
    """The ``/debug/pprof/`` pages for ``MetricsServer(pages=...)``."""
    sampler = profiler or Profiler()

    async def index(query: Mapping[str, str]) -> tuple[int, str]:
        return 200, _INDEX

    async def tasks(query: Mapping[str, str]) -> tuple[int, str]:
        return 200, task_stacks()

    async def threads(query: Mapping[str, str]) -> tuple[int, str]:
        return 200, await asyncio.to_thread(thread_stacks)

    async def profile(query: Mapping[str, str]) -> tuple[int, str]:
        try:
            seconds = float(query.get("seconds", DEFAULT_SECONDS))
        except ValueError:
            return 400, "seconds: not a number\n"
        if not 0 < seconds <= MAX_SECONDS:
            return 400, f"seconds: must be in (0, {MAX_SECONDS:g}]\n"
        text = await sampler.profile(seconds)
        if text is None:
            return 409, "a profile is already running\n"
        return 200, text

    return {
        "/debug/pprof/": index,
        "/debug/pprof/tasks": tasks,
        "/debug/pprof/goroutine": threads,
        "/debug/pprof/threads": threads,
        "/debug/pprof/profile": profile,
    }
