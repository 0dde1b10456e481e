"""Listening ports for the tests' servers, chosen below Linux's ephemeral range.

A port that is free when chosen may be bound a moment later by the server it is for. If it
lay in the ephemeral range (32768-60999 by default), some outgoing connection could take it
as its source port in between, and the server would fail to start ("Address already in
use"): this happened to the stack's ports and to a Redis Cluster node. Ports from
``LISTEN_PORTS`` are never handed out as source ports.
"""

from __future__ import annotations

import random
import socket
from collections import deque
from collections.abc import Sequence

__all__ = ["LISTEN_PORTS", "bindable", "free_port"]

LISTEN_PORTS = range(20000, 32768)

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
    for _ in range(200):
        port = rng.choice(choices)
        wanted = [port + offset for offset in offsets]
        if recent.isdisjoint(wanted) and all(bindable(p, host) for host in targets for p in wanted):
            _RECENT.extend(wanted)
            return port
    raise RuntimeError(f"no free port on {', '.join(targets)} (offsets {list(offsets)})")
