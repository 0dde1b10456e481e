"""Finding: unfinished gRPC messages hoarded memory. The stream window was credited back as
bytes of a partial message arrived, so each stream could push a whole message of
``--grpc-max-recv-msg-size`` (then 64 MiB) that never ends: one connection with 16 streams
took the process from 102 MB to 1,072 MB in 2.5 s.

Now a message larger than a stream's window gets its window back only once its whole size
is reserved, within a bound per connection and one per process; the rest wait, holding at
most their window. A raw client here does what a hoarder does: it opens streams, declares
a large message on each, and sends every byte the server's windows allow but the last.
The server runs in a process of its own (``h2_serve``): its resident memory is measured.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import cast

import pytest

from adapters.envoy.h2 import H2GrpcServer, H2Limits
from adapters.envoy.h2 import flow as h2flow
from tests.adversarial.test_h2_transport import (
    MIB,
    SERVICE,
    STOP_DEADLINE,
    Harness,
    Peer,
    _advertised,
)
from tests.support.h2frames import DATA, INITIAL_WINDOW_SIZE, WINDOW_UPDATE, frame

_PAGE = os.sysconf("SC_PAGE_SIZE")
SETTLE = 10.0  # seconds the memory may take to come back once the hoarders are gone


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as statm:
        return int(statm.read().split()[1]) * _PAGE


class _Hoarder:
    """One connection's streams, each declaring a message of ``declared`` bytes and sending
    all of it but its last byte, as fast as the server's windows allow."""

    def __init__(self, peer: Peer, streams: int, declared: int) -> None:
        self.peer = peer
        self.declared = declared
        self.streams = range(1, 2 * streams, 2)
        self.sent = dict.fromkeys(self.streams, 0)  # message bytes, prefix included
        self.granted: dict[int, int] = {}  # window granted per stream (0: the connection)
        self._seen = 0  # frames of the server's already counted
        self._pings = 0

    def _update(self) -> None:
        frames = self.peer.frames
        for kind, _, stream_id, payload in frames[self._seen :]:
            if kind == WINDOW_UPDATE:
                increment = int.from_bytes(payload, "big")
                self.granted[stream_id] = self.granted.get(stream_id, 0) + increment
        self._seen = len(frames)

    def _window(self, stream_id: int) -> int:
        initial = _advertised(self.peer, INITIAL_WINDOW_SIZE) or 65_535
        return initial + self.granted.get(stream_id, 0) - self.sent[stream_id]

    def _connection_window(self) -> int:
        return 65_535 + self.granted.get(0, 0) - sum(self.sent.values())

    def open(self) -> None:
        self.peer.send(b"".join(self.peer.request(s, f"{SERVICE}/Drain") for s in self.streams))

    def push(self) -> bool:
        """Sends what the windows allow now; False if nothing could be sent."""
        self._update()
        total = self.declared + 5
        progressed = False
        for stream_id in self.streams:
            while True:
                room = min(
                    self._window(stream_id),
                    self._connection_window(),
                    total - 1 - self.sent[stream_id],
                    16_384,
                )
                if room <= 0 or self.peer.closed:
                    break
                if self.sent[stream_id] == 0:
                    chunk = (b"\x00" + self.declared.to_bytes(4, "big") + b"x" * room)[:room]
                else:
                    chunk = b"x" * room
                self.peer.send(frame(DATA, 0, stream_id, chunk))
                self.sent[stream_id] += room
                progressed = True
        return progressed

    async def stalled(self) -> bool:
        """True when the server, having handled everything sent, has given no window back
        since: the hoarder can push no more."""
        self._update()
        before = sum(self.granted.values())
        self._pings += 1
        await self.peer.ping(b"hoard" + self._pings.to_bytes(3, "big"))
        self._update()
        return self.peer.closed or sum(self.granted.values()) == before


async def _memory_back(pid: int, bound: int, peak: int) -> None:
    """Waits for the resident memory to fall under ``bound``, at most ``SETTLE`` seconds."""
    deadline = time.monotonic() + SETTLE
    while _rss(pid) >= bound:
        if time.monotonic() > deadline:
            raise AssertionError(
                f"RSS {(_rss(pid) - bound) / MIB:.0f} MiB over the bound after the peak "
                f"(+{peak / MIB:.0f} MiB)"
            )
        await asyncio.sleep(0.01)


def _writable(peer: Peer) -> bool:
    return peer.writable or peer.closed


async def _hoard(
    harness: Harness, pid: int, connections: int, streams: int, declared: int, cap: int
) -> int:
    """Hoards until every connection is stalled (or the process has grown by ``cap``, the
    test already lost); returns the peak growth of the resident memory, in bytes."""
    base = _rss(pid)
    hoarders = []
    for _ in range(connections):
        peer = await harness.connect()
        await peer.ping()
        hoarders.append(_Hoarder(peer, streams, declared))
    for hoarder in hoarders:
        hoarder.open()
    peak = 0
    stalled: set[int] = set()
    async with asyncio.timeout(60):
        while len(stalled) < len(hoarders) and peak < cap:
            for index, hoarder in enumerate(hoarders):
                if index in stalled:
                    continue
                peer = hoarder.peer
                if hoarder.push():
                    await peer.until(functools.partial(_writable, peer))
                    await asyncio.sleep(0)
                elif await hoarder.stalled():
                    stalled.add(index)
                peak = max(peak, _rss(pid) - base)
    return peak


@contextlib.contextmanager
def _server_process(limit: int | None) -> Iterator[tuple[Harness, int]]:
    """The server in a process of its own (``h2_serve``): a harness on its port, its pid."""
    argv = [sys.executable, "-m", "tests.adversarial.h2_serve", str(limit or 0)]
    process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    assert process.stdin is not None
    try:
        port = int(process.stdout.readline())
        yield Harness(cast(H2GrpcServer, None), port), process.pid
    finally:
        process.stdin.close()
        try:
            process.wait(STOP_DEADLINE)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.mark.parametrize(
    ("connections", "limit", "declared"),
    [
        (1, 64 * MIB, 64 * MIB),  # the finding: the old default limit, messages of it
        (3, 64 * MIB, 64 * MIB),  # three connections: the process's bound
        (1, None, 4 * MIB - 5),  # the default limit, messages of it
    ],
    ids=["1-connection-64MiB", "3-connections-64MiB", "default-limit"],
)
async def test_partial_messages_hold_a_bounded_memory_given_back_when_the_peer_leaves(
    connections: int, limit: int | None, declared: int
) -> None:
    limits = H2Limits() if limit is None else H2Limits(max_receive_message_length=limit)
    streams = 16
    # what the server may hold: the reservations of one connection (or of the process, for
    # several), and a stream window of bytes for each stream waiting for a reservation
    held = min(connections * limits.held_per_connection, limits.held_per_process)
    bound = held + connections * streams * h2flow.STREAM_WINDOW + 16 * MIB
    with _server_process(limit) as (harness, pid):
        await harness.assert_serves()
        base = _rss(pid)
        peak = await _hoard(harness, pid, connections, streams, declared, cap=2 * bound)
        # before: 16 streams x 64 MiB per connection (about 1 GiB each) held
        assert peak < bound, f"RSS grew by {peak / MIB:.0f} MiB (bound {bound / MIB:.0f})"
        # served meanwhile: a call on a new connection
        await harness.assert_serves()
        for peer in harness.peers:
            peer.close()
        # the memory comes back once the hoarders are gone (before: none of it did)
        await _memory_back(pid, base + 16 * MIB, peak)
        print(
            f"\nRSS {base / MIB:.0f} MiB, peak +{peak / MIB:.0f} MiB, "
            f"after +{(_rss(pid) - base) / MIB:.0f} MiB"
        )
