"""ResilientPrefixIndex: deadline and fallback, background writes, degraded mode, the probe
and the rebuild."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Mapping, Sequence

import pytest

from domain.sharedstate import ResilientPrefixIndex
from ports.metric_catalogue import (
    SHARED_STATE_CLAIMS,
    SHARED_STATE_DEADLINE_MISSES,
    SHARED_STATE_DEGRADED,
    SHARED_STATE_DROPPED_WRITES,
    SHARED_STATE_ERRORS,
    SHARED_STATE_ROUNDTRIP,
    SHARED_STATE_WRITES,
)
from ports.prefix_index import PrefixIndex
from tests.fakes.observer import RecordingObserver
from tests.unit.sharedstate.fakes import FakeRemoteIndex, StagedRemoteIndex, StepSleep, until

# asserts how long calls take: run alone (`make test` runs these after the others)
pytestmark = pytest.mark.timed

H = [0x1000 + i for i in range(8)]
LOGGER = "domain.sharedstate.resilient_index"


class Rig:
    def __init__(self, **options: object) -> None:
        self.remote = FakeRemoteIndex()
        self.observer = RecordingObserver()
        self.sleep = StepSleep()
        self.index = ResilientPrefixIndex(
            self.remote,
            observer=self.observer,
            sleep=self.sleep,
            **options,  # type: ignore[arg-type]
        )

    def count(self, metric: object, **labels: str) -> float:
        return sum(
            r.value
            for r in self.observer.counters
            if r.metric is metric and all(r.labels.get(k) == v for k, v in labels.items())
        )

    def gauge(self) -> list[float]:
        return [r.value for r in self.observer.gauges if r.metric is SHARED_STATE_DEGRADED]


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    rig = Rig()
    await rig.index.start()
    yield rig
    await rig.index.stop()


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


async def test_conforms_to_the_port(rig: Rig) -> None:
    index: PrefixIndex = rig.index
    await index.add(H[:3], "a", 10)
    assert await index.match(H[:3]) == {"a": 3}
    assert index.size() == 3


async def test_an_answered_match_is_the_remotes_merged_with_the_local_one() -> None:
    rig = Rig(write_timeout=0.05)
    await rig.index.start()
    rig.remote.index.add_sync(H[:4], "other-process-pod", 10)
    rig.remote.slow.add("add")  # never reaches the remote: only the local index knows it
    await rig.index.add(H[:2], "a", 10)
    assert await rig.index.match(H[:4]) == {"other-process-pod": 4, "a": 2}
    answered = [r for r in rig.observer.histograms if r.metric is SHARED_STATE_ROUNDTRIP]
    assert [r.labels for r in answered] == [{"operation": "match"}]
    await rig.index.stop()


async def test_a_slow_match_answers_from_local_at_the_deadline_and_is_counted(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    await rig.index.add(H[:3], "a", 10)
    await rig.index.flush()
    rig.remote.slow.add("match")
    started = time.perf_counter()
    assert await rig.index.match(H[:3]) == {"a": 3}
    assert time.perf_counter() - started < 0.5  # the 5 ms budget, with room for CI
    assert rig.count(SHARED_STATE_DEADLINE_MISSES) == 1
    assert not rig.index.degraded
    assert _lines(caplog) == []


async def test_start_warms_the_remote_and_degrades_if_it_fails(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rig = Rig(warm_connections=3)
    await rig.index.start()
    try:
        assert rig.remote.answered == ["match"] * 3  # before any request
        assert not rig.index.degraded
    finally:
        await rig.index.stop()
    down = Rig(warm_connections=1)
    down.remote.failing = True
    await down.index.start()
    try:
        assert down.index.degraded  # the first request does not wait for a dead store
        assert len([line for line in _lines(caplog) if "degraded" in line]) == 1
    finally:
        await down.index.stop()


async def test_consecutive_misses_degrade_once_and_stop_waiting_for_the_remote(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rig = Rig(miss_limit=3)
    await rig.index.start()
    try:
        rig.remote.slow.add("match")
        for _ in range(2):
            await rig.index.match(H)
        rig.remote.slow.clear()
        await rig.index.match(H)  # answered: the count starts again
        rig.remote.slow.add("match")
        with caplog.at_level(logging.INFO, logger=LOGGER):
            for _ in range(3):
                await rig.index.match(H)
        assert rig.index.degraded
        assert rig.count(SHARED_STATE_DEADLINE_MISSES) == 5
        assert rig.gauge() == [0.0, 1.0]
        (line,) = _lines(caplog)
        assert "degraded" in line
        assert "3 consecutive deadline misses" in line
        # Degraded for slowness: no wait at all, but the call is still sent (its late
        # answer feeds the answers index), and writes still go out.
        calls = rig.remote.calls.count("match")
        started = time.perf_counter()
        await rig.index.match(H)
        assert time.perf_counter() - started < 0.004  # less than the 5 ms budget
        await until(lambda: rig.remote.calls.count("match") == calls + 1)
        assert rig.count(SHARED_STATE_DEADLINE_MISSES) == 5  # not a miss: not waited for
        await rig.index.add(H[:2], "a", 10)
        await until(lambda: rig.remote.index.match_sync(H[:2]) == {"a": 2})
        assert rig.count(SHARED_STATE_DROPPED_WRITES) == 0
    finally:
        await rig.index.stop()


async def test_a_failure_degrades_the_probe_backs_off_then_heals_and_rebuilds(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    await rig.index.add(H[:3], "a", 10)
    await rig.index.flush()
    rig.remote.failing = True
    assert await rig.index.match(H[:3]) == {"a": 3}  # from local, never raises
    assert rig.index.degraded
    assert rig.count(SHARED_STATE_ERRORS, operation="match") == 1
    # While degraded: adds and removals are local only; matches do not touch the remote.
    await rig.index.add(H[:5], "b", 10)
    await rig.index.add(H[:2], "gone", 10)
    await rig.index.remove_endpoint("gone")
    calls = len(rig.remote.calls)
    assert await rig.index.match(H[:5]) == {"a": 3, "b": 5}
    assert len(rig.remote.calls) == calls
    assert rig.count(SHARED_STATE_DROPPED_WRITES) == 2
    # The probe backs off while the remote keeps failing.
    for _ in range(3):
        await rig.sleep.release()
    assert rig.sleep.delays == [0.1, 0.2, 0.4, 0.8]
    assert rig.remote.calls[-3:] == ["match"] * 3
    # The remote comes back empty (restarted): the next probe heals, the rebuild re-adds.
    rig.remote.failing = False
    rig.remote.index.add_sync(H[:2], "gone", 10)  # a removal the remote missed
    await rig.sleep.release()
    await until(lambda: not rig.index.degraded)
    await until(lambda: rig.remote.index.match_sync(H[:5]) == {"a": 3, "b": 5})
    assert rig.gauge() == [0.0, 1.0, 0.0]  # reported at start, then on each change
    lines = _lines(caplog)
    assert len(lines) == 2
    assert "degraded" in lines[0]
    assert "healthy again" in lines[1]
    assert "re-sending 2 adds and 1 removals" in lines[1]
    # Healthy again: matches go to the remote.
    rig.remote.index.add_sync(H[:6], "c", 10)
    assert (await rig.index.match(H[:6]))["c"] == 6


async def test_the_probe_backoff_is_capped() -> None:
    rig = Rig(probe_initial=1.0, probe_max=3.0)
    await rig.index.start()
    try:
        rig.remote.failing = True
        await rig.index.match(H)
        for _ in range(4):
            await rig.sleep.release()
        assert rig.sleep.delays == [1.0, 2.0, 3.0, 3.0, 3.0]
    finally:
        await rig.index.stop()


async def test_the_probe_has_its_own_timeout_not_the_routing_budget(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A busy machine (or a reconnect after an outage) answers slower than the 5 ms routing
    budget: the probe still heals the state, under its own timeout."""
    rig = Rig(budget=0.005, probe_timeout=2.0)
    await rig.index.start()
    try:
        rig.remote.failing = True
        await rig.index.match(H)
        assert rig.index.degraded
        rig.remote.failing = False
        rig.remote.latency = 0.05  # ten times the budget, far under the probe's timeout
        await rig.sleep.release()
        await until(lambda: not rig.index.degraded)
        assert rig.sleep.delays == [0.1]  # the first probe healed
    finally:
        await rig.index.stop()


async def test_degraded_by_misses_heals_once_a_probe_fits_the_budget(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    rig = Rig(budget=0.005, miss_limit=2)
    await rig.index.start()
    try:
        rig.remote.slow.add("match")
        for _ in range(2):
            await rig.index.match(H)
        assert rig.index.degraded
        rig.remote.slow.clear()
        rig.remote.latency = 0.05  # answers, but slower than every request's budget
        await rig.sleep.release()
        await rig.sleep.release()
        assert rig.index.degraded  # healing now would only degrade again
        assert rig.sleep.delays == [0.1, 0.2, 0.4]
        rig.remote.latency = 0.0
        await rig.sleep.release()
        await until(lambda: not rig.index.degraded)
        assert len(_lines(caplog)) == 2  # degraded, healthy: one line per change
    finally:
        await rig.index.stop()


async def test_degraded_again_soon_after_healing_keeps_the_backoff() -> None:
    """A store that answers probes but fails requests flaps at most once per probe_max."""
    rig = Rig(probe_initial=0.1, probe_max=5.0)
    await rig.index.start()
    try:
        delays = []
        for _ in range(3):
            rig.remote.failing = True
            await rig.index.match(H)
            assert rig.index.degraded
            rig.remote.failing = False
            await rig.sleep.release()
            await until(lambda: not rig.index.degraded)
            delays.append(rig.sleep.delays[-1])
        assert delays == [0.1, 0.2, 0.4]
    finally:
        await rig.index.stop()


async def test_error_replies_fall_back_per_call_and_warn_once(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    """Garbage or an error reply about one key: that call routes on local state, the store
    stays in use for the others, and a flood of them is one warning, not one per request."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    await rig.index.add(H[:3], "a", 10)
    await rig.index.flush()
    rig.remote.garbage = {"match", "add", "remove_endpoint"}
    for _ in range(20):
        assert await rig.index.match(H[:3]) == {"a": 3}
    await rig.index.add(H[:4], "b", 10)
    await rig.index.flush()
    await rig.index.remove_endpoint("b")
    assert not rig.index.degraded
    assert rig.count(SHARED_STATE_ERRORS, operation="match") == 20
    assert rig.count(SHARED_STATE_ERRORS, operation="add") == 1
    assert rig.count(SHARED_STATE_ERRORS, operation="remove_endpoint") == 1
    (line,) = _lines(caplog)
    assert "error replies" in line
    assert "WRONGTYPE" in line
    rig.remote.garbage.clear()
    rig.remote.index.add_sync(H[:5], "c", 10)
    assert (await rig.index.match(H[:5]))["c"] == 5  # the store was used all along


async def test_refused_writes_keep_matching_the_remote_and_log_each_change_once(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    rig.remote.full = True
    for endpoint in ("a", "b", "c"):
        await rig.index.add(H[:3], endpoint, 10)
        await rig.index.flush()
    assert rig.index.writes_refused
    assert not rig.index.degraded
    assert rig.count(SHARED_STATE_ERRORS, operation="add") == 3
    assert rig.count(SHARED_STATE_DROPPED_WRITES) == 0  # kept, to be sent again
    rig.remote.index.add_sync(H[:5], "other", 10)
    assert (await rig.index.match(H[:5]))["other"] == 5
    rig.remote.full = False
    await rig.index.add(H[:3], "d", 10)
    await rig.index.flush()
    assert not rig.index.writes_refused
    # The refused writes were sent again once the store had room.
    assert rig.remote.index.match_sync(H[:3]) == {"a": 3, "b": 3, "c": 3, "d": 3, "other": 3}
    lines = _lines(caplog)
    assert len(lines) == 2, lines
    assert "refuses writes" in lines[0]
    assert "accepts writes again; re-sending 3 refused writes" in lines[1]


async def test_a_failed_write_degrades_and_is_counted(rig: Rig) -> None:
    rig.remote.failing = True
    await rig.index.add(H[:2], "a", 10)
    await until(lambda: rig.index.degraded)
    assert rig.count(SHARED_STATE_ERRORS, operation="add") == 1
    assert rig.count(SHARED_STATE_WRITES) == 0


async def test_adds_are_sent_in_the_background_never_awaited_by_the_request() -> None:
    rig = Rig(write_timeout=0.05)
    await rig.index.start()
    rig.remote.slow.add("add")  # every remote write hangs
    for i in range(3):
        await asyncio.wait_for(rig.index.add(H[i : i + 2], "a", 10), 0.5)
    # The match still gets the remote's answer, quickly, and the local index has the adds.
    assert await asyncio.wait_for(rig.index.match(H[:3]), 0.5) == {"a": 3}
    assert rig.count(SHARED_STATE_DEADLINE_MISSES) == 0
    await until(lambda: rig.remote.calls.count("add") == 1)  # one writer, blocked
    assert rig.index.pending_writes() == 2
    await rig.index.stop()


async def test_writes_are_sent_in_order_and_counted(rig: Rig) -> None:
    await rig.index.add(H[:3], "a", 3)
    await rig.index.add(H[3:4], "a", 3)  # evicts H[0] at the remote too
    await rig.index.flush()
    assert rig.remote.index.match_sync(H[1:4]) == {"a": 3}
    assert rig.remote.index.match_sync(H[:1]) == {}
    assert rig.count(SHARED_STATE_WRITES) == 2


async def test_pending_writes_are_bounded_and_the_overflow_is_counted() -> None:
    rig = Rig(max_pending=3)  # not started: nothing drains the queue
    for i in range(10):
        await rig.index.add(H[i % 4 : i % 4 + 2], "a", 10)
    assert rig.index.pending_writes() == 3
    assert rig.count(SHARED_STATE_DROPPED_WRITES) == 7
    assert rig.index.local.match_sync(H[:5]) == {"a": 5}  # every add recorded locally


async def test_stop_sends_what_is_queued(rig: Rig) -> None:
    await rig.index.add(H[:2], "a", 10)
    await rig.index.stop()
    assert rig.remote.index.match_sync(H[:2]) == {"a": 2}


async def test_remove_endpoint_removes_from_both(rig: Rig) -> None:
    await rig.index.add(H[:2], "a", 10)
    await rig.index.flush()
    await rig.index.remove_endpoint("a")
    assert rig.index.local.match_sync(H[:2]) == {}
    assert rig.remote.index.match_sync(H[:2]) == {}


async def test_the_rebuild_journal_is_bounded() -> None:
    rig = Rig(journal_hashes=4)
    await rig.index.start()
    try:
        rig.remote.failing = True
        await rig.index.match(H)
        await rig.index.add(H[:3], "a", 10)
        await rig.index.add(H[3:6], "b", 10)  # pushes a's chain out of the journal
        rig.remote.failing = False
        await rig.sleep.release()
        await until(lambda: rig.remote.index.match_sync(H[3:6]) == {"b": 3})
        assert rig.remote.index.match_sync(H[:3]) == {}
    finally:
        await rig.index.stop()


def test_invalid_options_are_refused() -> None:
    with pytest.raises(ValueError, match="budget"):
        ResilientPrefixIndex(FakeRemoteIndex(), budget=0)
    with pytest.raises(ValueError, match="probe_initial"):
        ResilientPrefixIndex(FakeRemoteIndex(), probe_initial=2.0, probe_max=1.0)


class GatedRemote(FakeRemoteIndex):
    """Its matches wait for ``gate``; ``ended`` says how each one ended."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.ended: list[str] = []

    async def match(self, hashes: Sequence[int]) -> Mapping[str, int]:
        try:
            await self.gate.wait()
        except asyncio.CancelledError:
            self.ended.append("cancelled")
            raise
        self.ended.append("answered")
        return self.index.match_sync(hashes)


async def test_a_match_past_the_budget_runs_on_in_the_background_up_to_max_late() -> None:
    """Cancelling a Redis call whose answer is on its way costs the client its connection
    (the next call reconnects, and misses too): the late call is left to finish."""
    remote = GatedRemote()
    index = ResilientPrefixIndex(remote, observer=RecordingObserver(), max_late=2)
    await index.start()
    try:
        await index.add(H[:3], "a", 10)
        for _ in range(3):
            assert await index.match(H[:3]) == {"a": 3}  # each past the budget: local
        await until(lambda: remote.ended == ["cancelled"])  # the third: over max_late
        remote.gate.set()
        await until(lambda: len(remote.ended) == 3)
        assert sorted(remote.ended) == ["answered", "answered", "cancelled"]
    finally:
        await index.stop()


async def test_a_miss_is_answered_from_what_the_remote_said_before(rig: Rig) -> None:
    """Another process's prefix, learnt from an answered match, still steers a request
    whose match misses the budget (the answers index), merged with this process's adds."""
    rig.remote.index.add_sync(H[:6], "other-process-pod", 10)
    assert await rig.index.match(H[:6]) == {"other-process-pod": 6}
    await rig.index.add(H[:2], "a", 10)
    await rig.index.flush()
    rig.remote.slow.add("match")
    assert await rig.index.match(H[:6]) == {"other-process-pod": 6, "a": 2}
    assert await rig.index.match([*H[:3], 0xBAD]) == {"other-process-pod": 3, "a": 2}
    assert rig.count(SHARED_STATE_DEADLINE_MISSES) == 2
    # A removed endpoint is forgotten there too.
    await rig.index.remove_endpoint("other-process-pod")
    assert await rig.index.match(H[:6]) == {"a": 2}


async def test_a_late_answer_teaches_the_answers_index() -> None:
    remote = GatedRemote()
    remote.index.add_sync(H[:4], "other-process-pod", 10)
    index = ResilientPrefixIndex(remote, observer=RecordingObserver())
    await index.start()
    try:
        assert await index.match(H[:4]) == {}  # past the budget, nothing known yet
        remote.gate.set()
        await until(lambda: remote.ended == ["answered"])
        remote.gate.clear()
        assert await index.match(H[:4]) == {"other-process-pod": 4}  # missed again
    finally:
        await index.stop()


async def test_while_degraded_matches_use_the_answers_index(rig: Rig) -> None:
    rig.remote.index.add_sync(H[:4], "other-process-pod", 10)
    await rig.index.match(H[:4])
    rig.remote.failing = True
    assert await rig.index.match(H[:4]) == {"other-process-pod": 4}
    assert rig.index.degraded
    calls = len(rig.remote.calls)
    assert await rig.index.match(H[:4]) == {"other-process-pod": 4}
    assert len(rig.remote.calls) == calls


async def test_stop_cancels_the_late_matches() -> None:
    remote = GatedRemote()
    index = ResilientPrefixIndex(remote, observer=RecordingObserver())
    await index.start()
    for _ in range(2):
        await index.match(H[:3])
    await index.stop()
    assert remote.ended == ["cancelled", "cancelled"]


async def test_slow_then_failing_drops_writes_and_heals_with_a_rebuild(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rig = Rig(miss_limit=1)
    await rig.index.start()
    caplog.set_level(logging.INFO, logger=LOGGER)
    try:
        rig.remote.slow.add("match")
        await rig.index.match(H)  # one miss: degraded, slow
        assert rig.index.degraded
        rig.remote.failing = True
        await rig.index.add(H[:3], "a", 10)  # the write fails: degraded, failing
        await until(lambda: rig.count(SHARED_STATE_ERRORS, operation="add") == 1)
        await rig.index.add(H[3:5], "b", 10)
        assert rig.count(SHARED_STATE_DROPPED_WRITES) == 1  # failing: writes stay local
        rig.remote.failing = False
        rig.remote.slow.clear()
        await rig.sleep.release()
        await until(lambda: not rig.index.degraded)
        await until(lambda: rig.remote.index.match_sync(H[3:5]) == {"b": 2})  # rebuilt
        lines = _lines(caplog)
        assert "degraded" in lines[0]
        assert "failing while degraded" in lines[1]
        assert "healthy again" in lines[2]
    finally:
        await rig.index.stop()


async def test_healed_from_slowness_nothing_is_re_sent(caplog: pytest.LogCaptureFixture) -> None:
    rig = Rig(miss_limit=1)
    await rig.index.start()
    caplog.set_level(logging.INFO, logger=LOGGER)
    try:
        await rig.index.add(H[:3], "a", 10)
        await rig.index.flush()
        rig.remote.slow.add("match")
        await rig.index.match(H)
        assert rig.index.degraded
        rig.remote.slow.clear()
        await rig.sleep.release()
        await until(lambda: not rig.index.degraded)
        assert "re-sending 0 adds and 0 removals" in _lines(caplog)[-1]
    finally:
        await rig.index.stop()


async def test_a_won_claim_is_recorded_once_and_not_written_again(rig: Rig) -> None:
    assert await rig.index.claim(H[:4], "a", 10) == "a"
    await rig.index.flush()
    assert "add" not in rig.remote.calls  # the claim wrote it
    assert rig.remote.index.match_sync(H[:4]) == {"a": 4}
    assert rig.index.local.match_sync(H[:4]) == {"a": 4}
    assert rig.count(SHARED_STATE_WRITES) == 1
    assert rig.count(SHARED_STATE_CLAIMS, outcome="won") == 1


async def test_a_staged_claim_answers_with_its_owner_and_finishes_in_the_background() -> None:
    remote = StagedRemoteIndex()
    remote.slow.add("claim_rest")
    observer = RecordingObserver()
    index = ResilientPrefixIndex(remote, write_timeout=0.05, claim_budget=1.0, observer=observer)
    await index.start()
    try:
        assert await index.claim(H[:4], "a", 10) == "a"
        # answered in time, not held up by the last step
        (claimed,) = [r.labels for r in observer.counters if r.metric is SHARED_STATE_CLAIMS]
        assert claimed == {"outcome": "won"}
        assert remote.calls[-1] == "claim_rest"
        assert "claim_rest" not in remote.answered
        assert index.local.match_sync(H[:4]) == {"a": 4}
    finally:
        await index.stop()  # gives the last steps write_timeout, then cancels them
    assert not index.degraded
    remote.slow.clear()
    index = ResilientPrefixIndex(remote, claim_budget=1.0)
    await index.start()
    assert await index.claim(H[4:], "b", 10) == "b"
    await index.stop()
    assert remote.answered[-1] == "claim_rest"  # stop waited for it


async def test_a_staged_claims_failed_last_step_is_counted_as_the_claims_error() -> None:
    rig = Rig()
    rig.remote = remote = StagedRemoteIndex()
    rig.index = ResilientPrefixIndex(remote, observer=rig.observer, sleep=rig.sleep)
    remote.garbage.add("claim_rest")
    await rig.index.start()
    try:
        assert await rig.index.claim(H[:4], "a", 10) == "a"
        await until(lambda: rig.count(SHARED_STATE_ERRORS, operation="claim") == 1)
        assert rig.count(SHARED_STATE_CLAIMS, outcome="won") == 1
        assert not rig.index.degraded  # an error reply: the store is up
    finally:
        await rig.index.stop()


async def test_a_claim_moved_to_a_tied_alternate_is_counted_and_learnt(rig: Rig) -> None:
    assert await rig.index.claim(H[:4], "a", 10, ["b"]) == "a"
    assert await rig.index.claim(H[4:], "a", 10, ["b"]) == "b"  # fewer new chains lately
    assert rig.count(SHARED_STATE_CLAIMS, outcome="won") == 1
    assert rig.count(SHARED_STATE_CLAIMS, outcome="moved") == 1
    rig.remote.slow.add("match")
    assert await rig.index.match(H[4:]) == {"b": 4}  # a miss, answered from what it learnt


async def test_a_lost_claim_names_the_owner_and_records_nothing(rig: Rig) -> None:
    rig.remote.index.add_sync(H[:4], "other-process-pod", 10)
    assert await rig.index.claim(H[:4], "a", 10) == "other-process-pod"
    await rig.index.flush()
    assert rig.remote.index.match_sync(H[:4]) == {"other-process-pod": 4}
    assert rig.index.local.match_sync(H[:4]) == {}
    assert rig.count(SHARED_STATE_CLAIMS, outcome="lost") == 1


async def test_a_slow_claim_keeps_the_pick_and_follows_the_owner_the_late_answer_names() -> None:
    rig = Rig(budget=0.01)
    await rig.index.start()
    rig.remote.index.add_sync(H[:4], "other-process-pod", 10)
    rig.remote.latency = 0.05  # answers, past the budget
    assert await rig.index.claim(H[:4], "a", 10) == "a"
    assert rig.count(SHARED_STATE_DEADLINE_MISSES) == 1
    assert rig.count(SHARED_STATE_CLAIMS, outcome="fallback") == 1
    # The late answer names another owner: the request went to "a", but the chain's next
    # requests follow the owner; nothing is written for "a" here or in the remote.
    rig.remote.slow.add("match")
    await until(lambda: not rig.index._late_claims)
    assert await rig.index.match(H[:4]) == {"other-process-pod": 4}  # a miss: learnt
    await rig.index.flush()
    assert rig.remote.index.match_sync(H[:4]) == {"other-process-pod": 4}
    assert rig.index.local.match_sync(H[:4]) == {}
    await rig.index.stop()


async def test_a_claim_waits_for_its_own_budget_not_the_matchs() -> None:
    rig = Rig(budget=0.005, claim_budget=1.0)
    await rig.index.start()
    rig.remote.latency = 0.05  # past the match budget, within the claim's
    rig.remote.index.add_sync(H[:4], "other-process-pod", 10)
    assert await rig.index.claim(H[:4], "a", 10) == "other-process-pod"
    assert rig.count(SHARED_STATE_DEADLINE_MISSES) == 0
    assert await rig.index.match(H[:4]) == {"other-process-pod": 4}
    assert rig.count(SHARED_STATE_DEADLINE_MISSES) == 1  # the match's budget is 5 ms
    await rig.index.stop()
    with pytest.raises(ValueError, match="claim_budget"):
        ResilientPrefixIndex(rig.remote, claim_budget=0)


async def test_a_slow_claim_won_late_is_recorded_then() -> None:
    rig = Rig(budget=0.01)
    await rig.index.start()
    rig.remote.latency = 0.05
    assert await rig.index.claim(H[:4], "a", 10) == "a"
    assert rig.index.local.match_sync(H[:4]) == {}  # not known yet
    await until(lambda: rig.index.local.match_sync(H[:4]) == {"a": 4})
    assert rig.remote.index.match_sync(H[:4]) == {"a": 4}
    assert "add" not in rig.remote.calls  # the claim wrote it
    assert rig.count(SHARED_STATE_WRITES) == 1
    await rig.index.stop()


async def test_a_slow_claim_that_fails_late_records_the_pick_as_an_add() -> None:
    rig = Rig(budget=0.01)
    await rig.index.start()
    rig.remote.slow.add("claim")  # never answers; the test's stop cancels it
    assert await rig.index.claim(H[:4], "a", 10) == "a"
    (call,) = rig.index._late_claims
    call.cancel()
    await until(lambda: rig.index.local.match_sync(H[:4]) == {"a": 4})
    await until(lambda: rig.remote.index.match_sync(H[:4]) == {"a": 4})  # queued as an add
    await rig.index.stop()


@contextlib.asynccontextmanager
async def slow_degraded() -> AsyncIterator[Rig]:
    """A started rig whose index one slow match has degraded for slowness."""
    rig = Rig(miss_limit=1)
    await rig.index.start()
    try:
        rig.remote.slow.add("match")
        await rig.index.match(H)
        assert rig.index.degraded
        yield rig
    finally:
        await rig.index.stop()


async def test_degraded_for_slowness_a_claim_is_sent_without_waiting() -> None:
    async with slow_degraded() as rig:
        rig.remote.index.add_sync(H[:4], "other-process-pod", 10)
        started = time.perf_counter()
        assert await rig.index.claim(H[:4], "a", 10) == "a"
        assert time.perf_counter() - started < 0.004  # less than the 5 ms budget
        assert rig.count(SHARED_STATE_CLAIMS, outcome="fallback") == 1
        await until(lambda: rig.remote.calls.count("claim") == 1 and not rig.index._late_claims)
        assert rig.index.local.match_sync(H[:4]) == {}
        assert await rig.index.match(H[:4]) == {"other-process-pod": 4}  # learnt from it


async def test_degraded_for_slowness_a_claim_still_spreads_over_its_alternates() -> None:
    async with slow_degraded() as rig:
        assert await rig.index.claim(H[:4], "a", 10, ["b"]) == "a"  # a's first new chain
        await until(lambda: not rig.index._late_claims)
        # the second goes to "b", fewer new chains lately; this request stays on "a"
        assert await rig.index.claim(H[4:8], "a", 10, ["b"]) == "a"
        await until(lambda: not rig.index._late_claims)
        assert rig.remote.index.match_sync(H[4:8]) == {"b": 4}
        assert await rig.index.match(H[4:8]) == {"b": 4}  # a miss, answered from what it learnt


async def test_misses_of_calls_in_flight_together_count_as_one_stall(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rig = Rig(miss_limit=3)
    await rig.index.start()
    try:
        rig.remote.slow.add("match")
        rig.remote.slow.add("claim")
        burst = [rig.index.match(H) for _ in range(8)] + [rig.index.claim(H, "a", 10)]
        await asyncio.gather(*burst)
        assert rig.count(SHARED_STATE_DEADLINE_MISSES) == 9
        assert not rig.index.degraded  # one pause, not nine in a row
        for _ in range(2):  # then two more, each started after the last one missed
            await rig.index.match(H)
        assert rig.index.degraded
        assert "3 consecutive deadline misses" in _lines(caplog)[-1]
    finally:
        await rig.index.stop()


async def test_a_failing_claim_keeps_the_pick_records_locally_and_degrades(rig: Rig) -> None:
    rig.remote.failing = True
    assert await rig.index.claim(H[:4], "a", 10) == "a"
    assert rig.index.degraded
    assert rig.count(SHARED_STATE_ERRORS, operation="claim") == 1
    assert rig.index.local.match_sync(H[:4]) == {"a": 4}
    assert await rig.index.claim(H[:4], "b", 10) == "b"  # degraded: not asked
    assert rig.remote.calls.count("claim") == 1


async def test_a_chain_sharing_a_start_just_sent_sends_only_its_end() -> None:
    clock = [0.0]
    rig = Rig(clock=lambda: clock[0], resend_interval=1.0)
    await rig.index.start()
    shared, one, two = H[:6], [*H[:6], 0xA1, 0xA2], [*H[:6], 0xB1]
    await rig.index.add(one, "a", 100)
    await rig.index.add(two, "a", 100)  # its first 6 blocks went out with the first
    await rig.index.add(two, "a", 100)  # all of it did: nothing to send
    await rig.index.add(two, "b", 100)  # another endpoint: in full
    await rig.index.flush()
    assert [c for c in rig.remote.calls if c.startswith("add")] == ["add", "add_tail", "add"]
    assert rig.remote.tails == [6]
    assert rig.remote.index.match_sync(two) == {"a": 7, "b": 7}
    assert rig.count(SHARED_STATE_WRITES) == 4  # each acknowledged, the empty one too
    clock[0] = 1.5  # the shared start is sent in full again once per interval
    await rig.index.add(one, "a", 100)
    await rig.index.flush()
    assert rig.remote.calls[-1] == "add"
    assert rig.remote.index.match_sync(shared) == {"a": 6, "b": 6}
    await rig.index.stop()
