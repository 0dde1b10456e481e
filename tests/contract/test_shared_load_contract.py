"""The ``SharedLoad`` contract, run on every implementation: the in-memory one
(``domain.sharedstate.LoadBoard``), Redis on one server and Redis on a 3-master cluster. Two or
three instances play the processes of one pool sharing a store."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Mapping

import pytest

from adapters.redis import RedisClient, RedisSharedLoad, connect
from domain.sharedstate import BoardMember, LoadBoard
from ports.shared_state import EndpointLoad, SharedLoad
from tests.contract.conftest import BACKENDS, CONTRACT_TIMEOUT

LEASE = 0.6
STALENESS = 0.02
#: Long enough for a few refreshes on a busy 2-core machine.
SEEN_WITHIN = 3.0


class _Pool:
    """Makes started "processes" on one shared store; stops them all at the end."""

    def __init__(self, client: RedisClient | None, prefix: str) -> None:
        self.client = client
        self._prefix = prefix
        self._board = LoadBoard()
        self.started: list[SharedLoad] = []
        self._members = 0

    def make(self, *, lease: float = LEASE) -> SharedLoad:
        """A process, not started."""
        if self.client is None:
            self._members += 1
            return self._board.member(f"p{self._members}", lease=lease, staleness=STALENESS)
        return RedisSharedLoad(
            self.client, key_prefix=self._prefix, lease=lease, staleness=STALENESS
        )

    async def process(self, *, lease: float = LEASE) -> SharedLoad:
        load = self.make(lease=lease)
        await load.start()
        self.started.append(load)
        return load

    async def crash(self, load: SharedLoad) -> None:
        """The process dies: it stops renewing and never withdraws."""
        if isinstance(load, BoardMember):
            await load._halt()  # a crash, as no public method would ever do it
            return
        assert isinstance(load, RedisSharedLoad)
        task = load._task  # a crash, as no public method would ever do it
        load._task = None
        assert task is not None
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


@pytest.fixture(params=BACKENDS)
async def pool(request: pytest.FixtureRequest, key_prefix: str) -> AsyncIterator[_Pool]:
    name: str = request.param
    client: RedisClient | None = None
    if name == "redis":
        client = connect(
            request.getfixturevalue("redis_server").url, socket_timeout=CONTRACT_TIMEOUT
        )
    elif name == "redis-cluster":
        client = connect(
            request.getfixturevalue("redis_cluster").url, socket_timeout=CONTRACT_TIMEOUT
        )
    made = _Pool(client, key_prefix)
    yield made
    for load in made.started:
        await load.stop()
    if client is not None:
        await client.aclose()


async def until(condition: Callable[[], bool], what: str, within: float = SEEN_WITHIN) -> float:
    """Wait for ``condition`` (polled every 5 ms); returns the seconds it took."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > within:
            raise AssertionError(f"not within {within}s: {what}")
        await asyncio.sleep(0.005)
    return time.monotonic() - started


def seen(view: Mapping[str, EndpointLoad], expected: dict[str, EndpointLoad]) -> bool:
    """``view`` equals ``expected``, an endpoint at zero counting as absent."""
    return {k: v for k, v in view.items() if v.requests or v.tokens} == expected


async def test_another_process_sees_what_one_publishes(pool: _Pool) -> None:
    a, b = await pool.process(), await pool.process()
    a.publish("pod-1", EndpointLoad(requests=3, tokens=300))
    await until(lambda: seen(b.others(), {"pod-1": EndpointLoad(3, 300)}), "b sees a")
    assert a.others() == {}  # its own bookings are not "others"


async def test_the_others_are_summed_per_endpoint(pool: _Pool) -> None:
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


async def test_published_values_are_absolute(pool: _Pool) -> None:
    a, b = await pool.process(), await pool.process()
    a.publish("pod-1", EndpointLoad(4, 40))
    await until(lambda: seen(b.others(), {"pod-1": EndpointLoad(4, 40)}), "4 in flight")
    a.publish("pod-1", EndpointLoad(1, 10))
    a.publish("pod-1", EndpointLoad(1, 10))  # repeated: no harm
    await until(lambda: seen(b.others(), {"pod-1": EndpointLoad(1, 10)}), "1 in flight")
    a.publish("pod-1", EndpointLoad(0, 0))
    await until(lambda: seen(b.others(), {}), "nothing in flight")


async def test_remove_endpoint_forgets_this_process_totals(pool: _Pool) -> None:
    a, b = await pool.process(), await pool.process()
    a.publish("pod-1", EndpointLoad(2, 20))
    a.publish("pod-2", EndpointLoad(3, 30))
    b.publish("pod-1", EndpointLoad(1, 1))
    await until(lambda: len(b.others()) == 2, "b sees both endpoints")
    a.remove_endpoint("pod-1")
    await until(lambda: seen(b.others(), {"pod-2": EndpointLoad(3, 30)}), "pod-1 gone")
    a.remove_endpoint("never-seen")


async def test_stop_withdraws_at_once(pool: _Pool) -> None:
    a, b = await pool.process(lease=30.0), await pool.process(lease=30.0)
    a.publish("pod-1", EndpointLoad(2, 20))
    await until(lambda: seen(b.others(), {"pod-1": EndpointLoad(2, 20)}), "b sees a")
    await a.stop()
    pool.started.remove(a)
    took = await until(lambda: seen(b.others(), {}), "a withdrawn")
    assert took < 5.0  # well before the 30 s lease


async def test_a_process_that_stops_renewing_drops_out_after_its_lease(pool: _Pool) -> None:
    a, b = await pool.process(), await pool.process()
    a.publish("pod-1", EndpointLoad(2, 20))
    await until(lambda: seen(b.others(), {"pod-1": EndpointLoad(2, 20)}), "b sees a")
    crashed_at = time.monotonic()
    await pool.crash(a)
    pool.started.remove(a)
    await until(lambda: seen(b.others(), {}), "a's lease lapsed", within=LEASE + SEEN_WITHIN)
    # Not dropped before its lease could have lapsed (less one refresh of slack).
    assert time.monotonic() - crashed_at >= LEASE - 0.25


async def test_publishing_before_start_is_kept(pool: _Pool) -> None:
    b = await pool.process()
    a = pool.make()
    a.publish("pod-1", EndpointLoad(1, 2))
    await a.start()
    pool.started.append(a)
    await until(lambda: seen(b.others(), {"pod-1": EndpointLoad(1, 2)}), "b sees a")


async def test_staleness_is_what_was_configured(pool: _Pool) -> None:
    a = await pool.process()
    assert a.staleness == STALENESS
    assert a.others() == {}
