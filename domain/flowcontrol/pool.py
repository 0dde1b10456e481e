"""How a flow controller shares its flows with the pool's other processes.

Each controller publishes, per flow (priority band and fairness id), how many of its
requests it has dispatched and not seen end, and how many wait in its queues
(``ports.shared_state.SharedAdmission``). It reads back the other processes' sums and
uses them in three places (``controller``): a band's fairness policy sees each flow's
in-flight count over the pool (``BandView.pool_in_flight``) and the flows that wait only
at other processes (``BandView.waiting_elsewhere``); a band does not dispatch while
another process holds requests of a higher band waiting; and the pool's in-flight total
(``FlowController.pool_in_flight``) is what a capacity-based saturation divides.

Bounds. A fairness id comes from a request header, so the published key is the id itself
only when it is short (at most ``MAX_KEY_BYTES`` UTF-8 bytes, not starting with ``#``),
else ``#`` and a 64-bit BLAKE2b of it: every process derives the same key. A process
publishes at most ``MAX_PUBLISHED_FLOWS`` flows at a time; a flow that becomes busy while
that many are published is counted, with every other such flow of its band, under the
band's ``OVERFLOW_KEY`` (the empty string, which no fairness id is). A flow keeps the key
it got until its counts are back at zero. So one process writes at most that many fields
whatever the number of tenants, and the band totals stay exact.
"""

from __future__ import annotations

import hashlib

__all__ = ["MAX_KEY_BYTES", "MAX_PUBLISHED_FLOWS", "OVERFLOW_KEY", "flow_key"]

#: Longer fairness ids are published as a digest.
MAX_KEY_BYTES = 64
#: Flows one process publishes by their own key at most; the rest share ``OVERFLOW_KEY``.
MAX_PUBLISHED_FLOWS = 128
#: The key under which a band's flows beyond ``MAX_PUBLISHED_FLOWS`` are summed.
OVERFLOW_KEY = ""


def flow_key(flow_id: str) -> str:
    """The key ``flow_id`` is published under (the same in every process)."""
    raw = flow_id.encode()
    if 0 < len(raw) <= MAX_KEY_BYTES and not flow_id.startswith("#"):
        return flow_id
    return "#" + hashlib.blake2b(raw, digest_size=8).hexdigest()
