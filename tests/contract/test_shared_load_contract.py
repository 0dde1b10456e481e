"""The ``SharedLoad`` contract, run on every implementation: the in-memory one
(``domain.sharedstate.LoadBoard``), Redis on one server and Redis on a 3-master cluster. Two or
three instances play the processes of one pool sharing a store."""

from __future__ import annotations

import time
from collections.abc import Mapping

from ports.shared_state import EndpointLoad
from tests.contract.processes import LEASE, SEEN_WITHIN, STALENESS, Processes, until


def seen(view: Mapping[str, EndpointLoad], expected: dict[str, EndpointLoad]) -> bool:
    """``view`` equals ``expected``, an endpoint at zero counting as absent."""
    return {k: v for k, v in view.items() if v.requests or v.tokens} == expected


async def test_another_process_sees_what_one_publishes(pool: Processes) -> None:
    a, b = await pool.process(), await pool.process()
    a.publish("pod-1", EndpointLoad(requests=3, tokens=300))
    await until(lambda: seen(b.others(), {"pod-1": EndpointLoad(3, 300)}), "b sees a")
    assert a.others() == {}  # its own bookings are not "others"


async def test_the_others_are_summed_per_endpoint(pool: Processes) -> None:
    a, b, c = await pool.process(), await pool.process(), await pool.process()
    a.publish("pod-1", EndpointLoad(1, 10))
    b.publish("pod-1", EndpointLoad(2, 20))
    b.publish("pod-2", EndpointLoad(5, 50))
    c.publish("pod-2", EndpointLoad(1, 1))
    await until(
        lambda: seen(c.others(), {"pod-1": EndpointLoad(3, 30), "pod-2": EndpointLoad(5, 50)}),
        "c sees a + b",
    )
    await until(
        lambda: seen(a.others(), {"pod-1": EndpointLoad(2, 20), "pod-2": EndpointLoad(6, 51)}),
        "a sees b + c",
    )


async def test_published_values_are_absolute(pool: Processes) -> None:
    a, b = await pool.process(), await pool.process()
    a.publish("pod-1", EndpointLoad(4, 40))
    await until(lambda: seen(b.others(), {"pod-1": EndpointLoad(4, 40)}), "4 in flight")
    a.publish("pod-1", EndpointLoad(1, 10))
    a.publish("pod-1", EndpointLoad(1, 10))  # repeated: no harm
    await until(lambda: seen(b.others(), {"pod-1": EndpointLoad(1, 10)}), "1 in flight")
    a.publish("pod-1", EndpointLoad(0, 0))
    await until(lambda: seen(b.others(), {}), "nothing in flight")


async def test_remove_endpoint_forgets_this_process_totals(pool: Processes) -> None:
    a, b = await pool.process(), await pool.process()
    a.publish("pod-1", EndpointLoad(2, 20))
    a.publish("pod-2", EndpointLoad(3, 30))
    b.publish("pod-1", EndpointLoad(1, 1))
    await until(lambda: len(b.others()) == 2, "b sees both endpoints")
    a.remove_endpoint("pod-1")
    await until(lambda: seen(b.others(), {"pod-2": EndpointLoad(3, 30)}), "pod-1 gone")
    a.remove_endpoint("never-seen")


async def test_stop_withdraws_at_once(pool: Processes) -> None:
    a, b = await pool.process(lease=30.0), await pool.process(lease=30.0)
    a.publish("pod-1", EndpointLoad(2, 20))
    await until(lambda: seen(b.others(), {"pod-1": EndpointLoad(2, 20)}), "b sees a")
    await a.stop()
    pool.started.remove(a)
    took = await until(lambda: seen(b.others(), {}), "a withdrawn")
    assert took < 5.0  # well before the 30 s lease


async def test_a_process_that_stops_renewing_drops_out_after_its_lease(pool: Processes) -> None:
    a, b = await pool.process(), await pool.process()
    a.publish("pod-1", EndpointLoad(2, 20))
    await until(lambda: seen(b.others(), {"pod-1": EndpointLoad(2, 20)}), "b sees a")
    crashed_at = time.monotonic()
    await pool.crash(a)
    pool.started.remove(a)
    await until(lambda: seen(b.others(), {}), "a's lease lapsed", within=LEASE + SEEN_WITHIN)
    # Not dropped before its lease could have lapsed (less one refresh of slack).
    assert time.monotonic() - crashed_at >= LEASE - 0.25


async def test_publishing_before_start_is_kept(pool: Processes) -> None:
    b = await pool.process()
    a = pool.make()
    a.publish("pod-1", EndpointLoad(1, 2))
    await a.start()
    pool.started.append(a)
    await until(lambda: seen(b.others(), {"pod-1": EndpointLoad(1, 2)}), "b sees a")


async def test_staleness_is_what_was_configured(pool: Processes) -> None:
    a = await pool.process()
    assert a.staleness == STALENESS
    assert a.others() == {}
