"""standing-queue-detector: the batch it learns from the servers' scrapes, the capacity and
saturation it reports, and how it behaves as load rises, holds, falls and servers stall."""

from __future__ import annotations

import math
from typing import Any

import pytest

from app.config import ConfigError, load_config
from app.plugins import build_registry
from domain.datalayer.attributes import IN_FLIGHT_LOAD, InFlightLoad
from domain.plugins.base import Duration, PluginRegistry
from domain.requestcontrol.admission import FlowSaturation
from domain.requestcontrol.interfaces import CapacityDetector, SaturationDetector
from domain.requestcontrol.plugins import standing_queue_detector
from domain.requestcontrol.plugins.standing_queue_detector import (
    StandingQueueDetector,
    StandingQueueDetectorParameters,
)
from domain.scheduling.types import Candidate
from tests.support.scheduling import candidate
from tests.unit.config import make_handle as config_handle
from tests.unit.requestcontrol import FakeClock, make_handle

SCRAPE = 0.05  # the EPP's default scrape interval


class Pool:
    """Scrapes of a few servers over time, as the data layer would leave them."""

    def __init__(self, clock: FakeClock, names: list[str]) -> None:
        self.clock = clock
        self.names = names
        self.in_flight = dict.fromkeys(names, 0)
        self.state = {name: (0, 0) for name in names}  # (running, waiting)
        self.scraped_at = dict.fromkeys(names, clock.now)

    def scrape(self, **state: tuple[int, int]) -> None:
        """The named servers' new (running, waiting); every server is scraped now."""
        self.state.update(state)
        for name in self.names:
            self.scraped_at[name] = self.clock.now

    def candidates(self) -> list[Candidate]:
        out = []
        for name in self.names:
            running, waiting = self.state[name]
            c = candidate(
                name,
                running_requests_size=running,
                waiting_queue_size=waiting,
                update_time=self.scraped_at[name],
            )
            c.attributes[IN_FLIGHT_LOAD] = InFlightLoad(tokens=0, requests=self.in_flight[name])
            out.append(c)
        return out

    def tick(self, seconds: float = SCRAPE) -> None:
        self.clock.now += seconds


def _detector(clock: FakeClock, **parameters: Any) -> StandingQueueDetector:
    registry = PluginRegistry()
    standing_queue_detector.register(registry)
    plugin = registry.create(
        "standing-queue-detector",
        "standing-queue-detector",
        StandingQueueDetectorParameters(**parameters),
        make_handle(clock),
    )
    assert isinstance(plugin, StandingQueueDetector)
    return plugin


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(1000.0)


def test_it_is_a_saturation_and_capacity_detector(clock: FakeClock) -> None:
    detector = _detector(clock)
    assert isinstance(detector, SaturationDetector)
    assert isinstance(detector, CapacityDetector)
    assert detector.consumes() == (IN_FLIGHT_LOAD,)


def test_before_any_queue_nothing_is_known_and_nothing_is_held(clock: FakeClock) -> None:
    detector = _detector(clock)
    pool = Pool(clock, ["a", "b"])
    pool.scrape(a=(7, 0), b=(3, 0))
    pool.in_flight.update(a=7, b=3)
    assert detector.capacity(pool.candidates()) == math.inf
    assert detector.saturation(pool.candidates()) == 0.0
    assert detector.saturation([]) == 1.0


def test_a_server_that_queues_teaches_its_batch(clock: FakeClock) -> None:
    detector = _detector(clock)
    pool = Pool(clock, ["a", "b"])
    pool.scrape(a=(16, 3), b=(4, 2))
    candidates = pool.candidates()
    assert detector.capacity(candidates) == (16 + 1) + (4 + 1)
    assert detector.learned_batch("a") == 16
    assert detector.learned_batch("b") == 4
    pool.in_flight.update(a=17, b=5)
    assert detector.saturation(pool.candidates()) == pytest.approx(1.0)
    pool.in_flight.update(a=10, b=1)
    assert detector.saturation(pool.candidates()) == pytest.approx(11 / 22)


def test_servers_not_learned_yet_count_as_the_mean_of_the_learned(clock: FakeClock) -> None:
    detector = _detector(clock)
    pool = Pool(clock, ["a", "b", "new"])
    pool.scrape(a=(8, 1), b=(4, 1), new=(0, 0))
    assert detector.capacity(pool.candidates()) == pytest.approx(9 + 5 + 7)


def test_queue_per_server_is_the_room_beyond_the_batch(clock: FakeClock) -> None:
    detector = _detector(clock, queue_per_server=0)
    pool = Pool(clock, ["a"])
    pool.scrape(a=(8, 1))
    assert detector.capacity(pool.candidates()) == 8


def test_steady_overload_does_not_move_the_batch(clock: FakeClock) -> None:
    """The scrapes of a full server: its batch, one waiting, now and then a slot being
    refilled (one fewer running, two waiting) or the queue empty for a moment."""
    detector = _detector(clock)
    pool = Pool(clock, ["a"])
    pattern = [(16, 1), (16, 1), (15, 2), (16, 1), (16, 0), (15, 1), (16, 1), (16, 2)]
    capacities = set()
    for _ in range(40):
        for state in pattern:
            pool.scrape(a=state)
            capacities.add(detector.capacity(pool.candidates()))
            pool.tick()
    assert capacities == {17}


def test_the_batch_rises_at_once_when_the_server_runs_more(clock: FakeClock) -> None:
    detector = _detector(clock)
    pool = Pool(clock, ["a"])
    pool.scrape(a=(3, 5))  # first queue seen while the server was still filling its batch
    assert detector.capacity(pool.candidates()) == 4
    running = 3
    # the EPP lets batch + 1 go; the server runs it without queueing: the batch grows
    while running < 16:
        pool.tick()
        running = int(detector.capacity(pool.candidates()))
        pool.scrape(a=(min(running, 16), max(0, running - 16)))
    assert detector.capacity(pool.candidates()) == 17
    assert detector.learned_batch("a") == 16


def test_the_batch_falls_only_on_a_queue_that_lasts(clock: FakeClock) -> None:
    """A server that runs fewer at once (longer prompts fill its KV cache): the batch
    follows once the queue has been seen with fewer running for half an interval."""
    detector = _detector(clock, interval=Duration(0.5))
    pool = Pool(clock, ["a"])
    pool.scrape(a=(16, 1))
    detector.capacity(pool.candidates())
    for _ in range(3):  # 0.15 s of a queue with 10 running: not yet
        pool.tick()
        pool.scrape(a=(10, 4))
        assert detector.capacity(pool.candidates()) == 17
    for _ in range(20):
        pool.tick()
        pool.scrape(a=(10, 4))
        detector.capacity(pool.candidates())
    assert detector.learned_batch("a") == 10


def test_a_burst_that_drains_within_the_interval_is_not_saturation(clock: FakeClock) -> None:
    detector = _detector(clock, interval=Duration(0.5))
    pool = Pool(clock, ["a", "b"])
    pool.scrape(a=(4, 9), b=(4, 9))
    for waiting in (9, 7, 5, 3, 1, 0):  # 0.3 s of draining
        pool.scrape(a=(4, waiting), b=(4, waiting))
        assert detector.saturation(pool.candidates()) < 1.0
        pool.tick()


def test_a_standing_queue_on_every_server_is_saturation_whatever_the_epp_sent(
    clock: FakeClock,
) -> None:
    """Load from outside this EPP: its own in-flight count is low, the servers' queues
    stand for a whole interval."""
    detector = _detector(clock, interval=Duration(0.5))
    pool = Pool(clock, ["a", "b"])
    values = []
    for _ in range(12):
        pool.scrape(a=(4, 6), b=(4, 6))
        values.append(detector.saturation(pool.candidates()))
        pool.tick()
    assert values[0] < 1.0
    assert values[-1] == 1.0
    pool.scrape(b=(4, 0))  # one server's queue is gone: half the pool stands
    assert detector.saturation(pool.candidates()) == pytest.approx(0.5)


def test_it_recovers_when_load_falls(clock: FakeClock) -> None:
    detector = _detector(clock)
    pool = Pool(clock, ["a", "b"])
    for _ in range(20):  # overloaded: full batches, queues standing, EPP at its capacity
        pool.scrape(a=(8, 5), b=(8, 5))
        pool.in_flight.update(a=9, b=9)
        assert detector.saturation(pool.candidates()) >= 1.0
        pool.tick()
    for in_flight in (7, 5, 3, 1, 0):  # load falls
        pool.scrape(a=(in_flight, 0), b=(in_flight, 0))
        pool.in_flight.update(a=in_flight, b=in_flight)
        assert detector.saturation(pool.candidates()) == pytest.approx(in_flight / 9)
        pool.tick()
    assert detector.learned_batch("a") == 8  # what it learned stays for the next rise


def test_a_server_that_stops_answering_keeps_its_share_and_does_not_wedge(
    clock: FakeClock,
) -> None:
    """A server whose scrapes stop (it hangs): its learned batch stays, its silence is not
    a standing queue; when it answers again, an hour later, it is learned anew."""
    detector = _detector(clock)
    pool = Pool(clock, ["a", "b"])
    pool.scrape(a=(8, 1), b=(8, 1))
    assert detector.capacity(pool.candidates()) == 18
    pool.tick(3600.0)  # no scrape of either for an hour: both stale
    pool.in_flight.update(a=9, b=0)  # a's requests never ended
    assert detector.capacity(pool.candidates()) == 18
    assert detector.saturation(pool.candidates()) == pytest.approx(9 / 18)
    pool.scrape(a=(8, 1), b=(0, 0))
    pool.in_flight.update(a=0, b=0)
    assert detector.saturation(pool.candidates()) == 0.0


def test_a_server_stuck_with_a_queue_and_nothing_running_recovers(clock: FakeClock) -> None:
    """A server that queues but runs nothing (stalled) teaches a batch of 0: it still gets
    one request (queuePerServer), and when it runs again its batch grows back."""
    detector = _detector(clock)
    pool = Pool(clock, ["a"])
    for _ in range(20):
        pool.scrape(a=(0, 3))
        detector.capacity(pool.candidates())
        pool.tick()
    assert detector.capacity(pool.candidates()) == 1
    for running in range(1, 9):
        pool.scrape(a=(running, 0))
        detector.capacity(pool.candidates())
        pool.tick()
    assert detector.learned_batch("a") == 8


def test_servers_gone_for_long_are_forgotten(clock: FakeClock) -> None:
    detector = _detector(clock, interval=Duration(0.5))
    old = Pool(clock, ["old"])
    old.scrape(old=(4, 1))
    detector.capacity(old.candidates())
    assert detector.learned_batch("old") == 4
    clock.now += 0.5 * 121
    new = Pool(clock, ["new"])
    new.scrape(new=(2, 1))
    detector.saturation(new.candidates())
    assert detector.learned_batch("old") is None
    assert detector.learned_batch("new") == 2


class _Controller:
    def __init__(self, count: int) -> None:
        self.count = count

    def pool_in_flight(self) -> int:
        return self.count


def test_flow_control_gates_its_own_in_flight_on_the_learned_capacity(clock: FakeClock) -> None:
    detector = _detector(clock)
    pool = Pool(clock, ["a", "b"])
    pool.scrape(a=(4, 1), b=(4, 1))
    saturation = FlowSaturation(detector, pool.candidates)
    controller = _Controller(0)
    saturation.controller = controller  # type: ignore[assignment]
    controller.count = 9  # let go, not booked on an endpoint yet
    assert saturation() == pytest.approx(9 / 10)
    controller.count = 10
    assert saturation() == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("parameters", "field"),
    [
        ("interval: 0s", "interval"),
        ("queuePerServer: -1", "queuePerServer"),
        ("metricsStalenessThreshold: 0s", "metricsStalenessThreshold"),
    ],
)
def test_bad_parameters_stop_start_up_naming_the_field(parameters: str, field: str) -> None:
    text = f"plugins:\n- type: standing-queue-detector\n  parameters: {{{parameters}}}\n"
    with pytest.raises(ConfigError) as caught:
        load_config(text, registry=build_registry(), handle=config_handle())
    assert field in str(caught.value)


def test_the_config_names_it_as_the_saturation_detector() -> None:
    text = (
        "plugins:\n- type: standing-queue-detector\n  parameters: {interval: 1s}\n"
        "flowControl:\n  saturationDetector: {pluginRef: standing-queue-detector}\n"
    )
    loaded = load_config(text, registry=build_registry(), handle=config_handle())
    assert loaded.saturation_detector.typed_name.type == "standing-queue-detector"
    assert "inflight-load-producer" in [p.typed_name.type for p in loaded.data_producers]
