"""``metrics-freshness-filter`` alone, and the default profile's choices when one server's
``/metrics`` fails: new prefixes avoid it, a prefix sticky to it alone stays."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from app.config import ConfigError, load_config
from app.plugins import build_registry
from domain.datalayer.attributes import (
    IN_FLIGHT_LOAD,
    PREFIX_CACHE_MATCH_INFO,
    InFlightLoad,
    PrefixCacheMatchInfo,
)
from domain.plugins.base import Duration
from domain.plugins.handle import Handle
from domain.scheduling.interfaces import Filter
from domain.scheduling.plugins import metrics_freshness_filter
from domain.scheduling.plugins.metrics_freshness_filter import MetricsFreshnessFilterParameters
from domain.scheduling.profile import SchedulerProfile
from domain.scheduling.types import Candidate
from tests.support.scheduling import CODEC, candidate, cycle, inference_request, plugin_handle

NOW = 1000.0


class _Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now


def _filter(clock: _Clock, threshold: float | None = None) -> Filter:
    parameters = (
        MetricsFreshnessFilterParameters()
        if threshold is None
        else MetricsFreshnessFilterParameters(metrics_staleness_threshold=Duration(threshold))
    )
    handle = plugin_handle()
    handle.clock = clock
    registry = build_registry()
    plugin = registry.create(metrics_freshness_filter.TYPE, "f", parameters, handle)
    assert isinstance(plugin, Filter)
    return plugin


def _scraped(name: str, age: float | None) -> Candidate:
    """A candidate last scraped ``age`` seconds before ``NOW`` (None: never scraped)."""
    if age is None:
        return candidate(name)
    return candidate(name, update_time=NOW - age, waiting_queue_size=0)


def _kept(f: Filter, candidates: Sequence[Candidate]) -> list[str]:
    request = inference_request({"model": "m", "prompt": "x"})
    return [c.name for c in f.filter(cycle(request), request, candidates)]


def test_keeps_the_fresh_candidates_in_order() -> None:
    f = _filter(_Clock())
    candidates = [
        _scraped("a", 0.05),
        _scraped("stale", 2.5),
        _scraped("b", 2.0),  # exactly at the threshold: still fresh
        _scraped("never", None),
        _scraped("c", 0.0),
    ]
    assert _kept(f, candidates) == ["a", "b", "c"]


def test_keeps_everyone_when_no_candidate_is_fresh() -> None:
    f = _filter(_Clock())
    candidates = [_scraped("stale", 30.0), _scraped("never", None)]
    assert _kept(f, candidates) == ["stale", "never"]
    assert _kept(f, []) == []


def test_an_endpoint_turns_stale_and_fresh_with_the_clock() -> None:
    clock = _Clock()
    f = _filter(clock, threshold=0.5)
    candidates = [_scraped("old", 0.0), _scraped("new", -1.0)]
    assert _kept(f, candidates) == ["old", "new"]
    clock.now += 0.75
    assert _kept(f, candidates) == ["new"]


def test_the_default_threshold_is_that_of_the_staleness_flag() -> None:
    assert MetricsFreshnessFilterParameters().metrics_staleness_threshold == 2.0


@pytest.mark.parametrize(
    ("value", "message"),
    [("0s", "must be > 0"), ("-1s", "'-1s': durations cannot be negative")],
)
def test_a_threshold_that_is_not_positive_stops_start_up(value: str, message: str) -> None:
    text = (
        "plugins:\n- type: metrics-freshness-filter\n"
        f"  parameters:\n    metricsStalenessThreshold: {value}\n"
    )
    with pytest.raises(ConfigError) as caught:
        load_config(text, registry=build_registry(), handle=plugin_handle())
    path = "plugins[0].parameters.metricsStalenessThreshold: "
    assert str(caught.value).startswith(path + message), caught.value


# --- the default profile ------------------------------------------------------------------


def _default_profile(clock: _Clock) -> SchedulerProfile:
    handle = Handle(
        codec=CODEC,
        hasher=plugin_handle().hasher,
        prefix_index=plugin_handle().prefix_index,
        datastore=plugin_handle().datastore,
        rng=random.Random(0),
        clock=clock,
    )
    loaded = load_config(None, registry=build_registry(), handle=handle)
    profile = loaded.profiles["default"]
    assert [f.typed_name.type for f in profile.filters] == [
        "prefix-cache-affinity-filter",
        metrics_freshness_filter.TYPE,
    ]
    return profile


def _server(name: str, *, age: float, matched: int, in_flight: int) -> Candidate:
    """Scraped ``age`` seconds ago, holding ``matched`` of the prompt's 10 blocks, with
    ``in_flight`` uncached tokens in flight."""
    c = _scraped(name, age)
    c.attributes[PREFIX_CACHE_MATCH_INFO] = PrefixCacheMatchInfo(matched, 10, 16)
    c.attributes[IN_FLIGHT_LOAD] = InFlightLoad(1 if in_flight else 0, in_flight)
    return c


def _chosen(profile: SchedulerProfile, candidates: Sequence[Candidate]) -> str:
    request = inference_request({"model": "m", "prompt": "y" * 640})
    return profile.run(request, candidates).target_endpoints[0].name


def test_the_default_sends_a_new_prefix_to_a_fresh_server_even_when_busier() -> None:
    profile = _default_profile(_Clock())
    # the failing server looks idle to the EPP (nothing in flight): it is still not chosen
    candidates = [
        _server("failing", age=10.0, matched=0, in_flight=0),
        _server("busy", age=0.05, matched=0, in_flight=5000),
        _server("busier", age=0.05, matched=0, in_flight=9000),
    ]
    assert _chosen(profile, candidates) == "busy"


def test_the_default_keeps_a_prefix_sticky_to_a_failing_server_alone() -> None:
    profile = _default_profile(_Clock())
    candidates = [
        _server("failing", age=10.0, matched=10, in_flight=0),
        _server("fresh", age=0.05, matched=0, in_flight=0),
    ]
    assert _chosen(profile, candidates) == "failing"


def test_the_default_prefers_the_fresh_one_of_two_sticky_servers() -> None:
    profile = _default_profile(_Clock())
    candidates = [
        _server("failing", age=10.0, matched=10, in_flight=0),
        _server("fresh", age=0.05, matched=10, in_flight=3000),
        _server("cold", age=0.05, matched=0, in_flight=0),
    ]
    assert _chosen(profile, candidates) == "fresh"


def test_the_default_routes_as_before_when_no_server_is_scraped() -> None:
    profile = _default_profile(_Clock())
    candidates = [
        _server("a", age=10.0, matched=0, in_flight=4000),
        _server("b", age=10.0, matched=0, in_flight=1000),
    ]
    assert _chosen(profile, candidates) == "b"
