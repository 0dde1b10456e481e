"""The in-memory SharedLoad implementations: one process alone, and a board several share."""

from __future__ import annotations

import pytest

from domain.sharedstate import LoadBoard, LocalSharedLoad
from ports.shared_state import EndpointLoad, SharedLoad
from tests.unit.requestcontrol import FakeClock


async def test_one_process_alone_sees_nobody_else() -> None:
    load: SharedLoad = LocalSharedLoad()
    await load.start()
    load.publish("a", EndpointLoad(3, 300))
    assert load.others() == {}
    assert load.others() is load.others()
    assert load.staleness == 0.0
    load.remove_endpoint("a")
    await load.stop()


def test_members_see_the_sum_of_the_others_but_not_themselves() -> None:
    board = LoadBoard(clock=FakeClock())
    a, b, c = board.member("a"), board.member("b"), board.member("c")
    a.publish("pod-1", EndpointLoad(2, 200))
    b.publish("pod-1", EndpointLoad(1, 100))
    b.publish("pod-2", EndpointLoad(4, 40))
    assert c.others() == {"pod-1": EndpointLoad(3, 300), "pod-2": EndpointLoad(4, 40)}
    assert a.others() == {"pod-1": EndpointLoad(1, 100), "pod-2": EndpointLoad(4, 40)}
    b.publish("pod-2", EndpointLoad(0, 0))  # absolute totals: zero means none
    assert a.others() == {"pod-1": EndpointLoad(1, 100)}


def test_others_is_the_same_object_until_it_changes() -> None:
    board = LoadBoard(clock=FakeClock())
    a, b = board.member("a"), board.member("b")
    b.publish("pod-1", EndpointLoad(1, 10))
    first = a.others()
    assert a.others() is first
    b.publish("pod-1", EndpointLoad(2, 20))
    assert a.others() is not first


def test_a_member_that_stops_renewing_drops_out_after_its_lease() -> None:
    clock = FakeClock()
    board = LoadBoard(lease=10.0, clock=clock)
    a, b = board.member("a"), board.member("b")
    b.publish("pod-1", EndpointLoad(1, 10))
    a.publish("pod-1", EndpointLoad(1, 10))
    clock.now += 6
    a.renew()
    clock.now += 6  # b's lease (published at t=0) lapsed; a renewed at t=6
    assert a.others() == {}
    assert b.others() == {"pod-1": EndpointLoad(1, 10)}
    assert board.live() == ["a"]
    b.publish("pod-1", EndpointLoad(1, 10))  # publishing renews
    assert a.others() == {"pod-1": EndpointLoad(1, 10)}


async def test_stop_withdraws_and_remove_endpoint_forgets_one_endpoint() -> None:
    board = LoadBoard(clock=FakeClock())
    a, b = board.member("a"), board.member("b")
    await b.start()
    b.publish("pod-1", EndpointLoad(1, 10))
    b.publish("pod-2", EndpointLoad(1, 10))
    b.remove_endpoint("pod-1")
    assert a.others() == {"pod-2": EndpointLoad(1, 10)}
    await b.stop()
    assert a.others() == {}


def test_a_lease_must_be_positive() -> None:
    with pytest.raises(ValueError, match="lease"):
        LoadBoard(lease=0)
