"""Listening ports for the tests' servers, chosen below Linux's ephemeral range.

A port that is free when chosen may be bound a moment later by the server it is for. If it
lay in the ephemeral range (32768-60999 by default), some outgoing connection could take it
as its source port in between, and the server would fail to start ("Address already in
use"): this happened to the stack's ports and to a Redis Cluster node. Ports from
``LISTEN_PORTS`` are never handed out as source ports.

When the suite runs in several processes (pytest-xdist), each worker hands out only its own
class of ports, so two workers never hand out the same one.
"""

from __future__ import annotations

import os
import random
import re
import socket
from collections import deque
from collections.abc import Sequence

__all__ = ["LISTEN_PORTS", "bindable", "free_port"]

LISTEN_PORTS = range(20000, 32768)


def _worker() -> tuple[int, int]:
    """This process's index among the suite's workers and their count: (0, 1) unless
    pytest-xdist runs it as ``gw<index>`` of ``PYTEST_XDIST_WORKER_COUNT``."""
    worker = re.fullmatch(r"gw(\d+)", os.environ.get("PYTEST_XDIST_WORKER", ""))
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return (int(worker.group(1)), count) if worker is not None and count > 1 else (0, 1)


def _ours(port: int, worker: tuple[int, int]) -> bool:
    """Whether ``port`` is in this worker's class. The class is taken from the port's last
    four digits, so a port and its offsets by multiples of 10,000 (a Redis Cluster node's
    bus port) are always in the same class."""
    index, count = worker
    return (port % 10_000) % count == index


#: Ports handed out lately by this process: not handed out again, since a server is often
#: given its port some time before it binds it (a Redis Cluster's six nodes are all given
#: theirs before the first starts).
_RECENT: deque[int] = deque(maxlen=2048)


def bindable(port: int, host: str = "127.0.0.1") -> bool:
    """Whether ``port`` on ``host`` can be bound now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def free_port(*hosts: str, offsets: Sequence[int] = (0,)) -> int:
    """A port ``p`` such that ``p + offset`` is free now on every host (127.0.0.1 when
    none is given) for every offset, all within ``LISTEN_PORTS``."""
    targets = hosts or ("127.0.0.1",)
    choices = range(LISTEN_PORTS.start, LISTEN_PORTS.stop - max(offsets))
    rng = random.Random()
    recent = set(_RECENT)
    worker = _worker()
    for _ in range(200 * worker[1]):
        port = rng.choice(choices)
        wanted = [port + offset for offset in offsets]
        if not all(_ours(p, worker) for p in wanted):
            continue
        if recent.isdisjoint(wanted) and all(bindable(p, host) for host in targets for p in wanted):
            _RECENT.extend(wanted)
            return port
    raise RuntimeError(f"no free port on {', '.join(targets)} (offsets {list(offsets)})")
