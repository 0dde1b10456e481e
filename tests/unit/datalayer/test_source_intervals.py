"""Each polling source on its own interval (the llm-d router's ``interval``): a slow source
is polled at its pace while a fast one beside it keeps the collectors' interval, and
start-up says which interval applies."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import pytest

from domain.datalayer.collector import Collectors, SourceBinding
from domain.datastore.store import Datastore
from ports.endpoints import EndpointAddress, EndpointEvent, EndpointEventKind, EndpointInfo
from ports.plugins import TypedName

BASE = 0.02
SLOW = 0.2


class CountingSource:
    """A polling source that counts its polls and may fail them."""

    def __init__(self, name: str, *, failing: bool = False) -> None:
        self.typed_name = TypedName("counting-source", name)
        self.polls = 0
        self.failing = failing

    def output_type(self) -> type:
        return object

    async def poll(self, endpoint: EndpointInfo) -> object:
        self.polls += 1
        if self.failing:
            raise OSError("down")
        return object()

    async def close(self) -> None:
        pass


def _datastore() -> Datastore:
    store = Datastore()
    address = EndpointAddress(ip="10.4.0.1", port=8000)
    store.apply(
        EndpointEvent(
            kind=EndpointEventKind.ADD_OR_UPDATE,
            endpoint=EndpointInfo(name="e", address=address),
        )
    )
    return store


async def _until(condition: Callable[[], bool], within: float = 20.0) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


async def test_a_source_with_its_own_interval_is_polled_at_its_pace() -> None:
    fast, slow = CountingSource("fast"), CountingSource("slow")
    collectors = Collectors(
        datastore=_datastore(),
        bindings=[SourceBinding(fast, ()), SourceBinding(slow, (), SLOW)],
        interval=BASE,
    )
    collectors.start()
    try:
        await _until(lambda: slow.polls >= 4)
        # the fast source keeps its interval, about 10 polls per slow one (a loaded machine
        # delays polls, it does not add any)
        assert fast.polls > 3 * slow.polls
        assert slow.polls <= fast.polls * BASE / SLOW + 2
    finally:
        await collectors.stop()


async def test_a_failing_slow_source_is_not_retried_sooner_than_its_interval() -> None:
    fast, slow = CountingSource("fast"), CountingSource("slow", failing=True)
    collectors = Collectors(
        datastore=_datastore(),
        bindings=[SourceBinding(fast, ()), SourceBinding(slow, (), SLOW)],
        interval=BASE,
        max_backoff=BASE,
    )
    collectors.start()
    try:
        await _until(lambda: fast.polls >= 50)  # 1 s at least
        assert 1 <= slow.polls <= fast.polls * BASE / SLOW + 2
        assert "down" in (collectors.error_of("e") or "")
    finally:
        await collectors.stop()
    for failures in (1, 2, 5):
        delay = collectors.backoff_delay(failures, SLOW)
        assert SLOW <= delay <= 2 * SLOW  # doubled from its own interval, capped at twice it


def test_start_up_says_which_sources_have_their_own_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="domain.datalayer.collector")
    Collectors(
        datastore=Datastore(),
        bindings=[
            SourceBinding(CountingSource("fast"), ()),
            SourceBinding(CountingSource("slow"), (), 1.0),
            SourceBinding(CountingSource("same"), (), BASE),
        ],
        interval=BASE,
    )
    said = [r.getMessage() for r in caplog.records]
    assert said == ["data source slow/counting-source: polled every 1s"]
