"""utilization-detector and concurrency-detector: saturation values, filters, parameters."""

from __future__ import annotations

from typing import Any

import pytest

from domain.datalayer.attributes import IN_FLIGHT_LOAD, InFlightLoad
from domain.plugins.base import Duration, PluginRegistry, TypedName
from domain.requestcontrol.admission import FlowSaturation
from domain.requestcontrol.interfaces import SaturationDetector
from domain.requestcontrol.plugins import concurrency_detector, inflight_load, utilization_detector
from domain.requestcontrol.plugins.concurrency_detector import (
    ConcurrencyDetector,
    ConcurrencyDetectorParameters,
)
from domain.requestcontrol.plugins.utilization_detector import (
    UtilizationDetector,
    UtilizationDetectorParameters,
)
from domain.scheduling.interfaces import Filter
from domain.scheduling.types import Candidate, ProfileRunResult, SchedulingResult
from tests.support.scheduling import candidate, cycle, inference_request
from tests.unit.requestcontrol import FakeClock, make_handle

NOW = 1000.0


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(NOW)


def _utilization(clock: FakeClock, **parameters: Any) -> UtilizationDetector:
    registry = PluginRegistry()
    utilization_detector.register(registry)
    plugin = registry.create(
        "utilization-detector",
        "utilization-detector",
        UtilizationDetectorParameters(**parameters),
        make_handle(clock),
    )
    assert isinstance(plugin, UtilizationDetector)
    return plugin


def _fresh(name: str, waiting: int = 0, kv: float = 0.0, age: float = 0.0) -> Candidate:
    return candidate(
        name, waiting_queue_size=waiting, kv_cache_usage_percent=kv, update_time=NOW - age
    )


def _names(candidates: Any) -> list[str]:
    return [c.name for c in candidates]


# --- utilization-detector -----------------------------------------------------------------


def test_utilization_detector_fills_both_slots(clock: FakeClock) -> None:
    detector = _utilization(clock)
    assert isinstance(detector, SaturationDetector)
    assert isinstance(detector, Filter)


def test_utilization_saturation_is_the_mean_of_the_worse_ratio(clock: FakeClock) -> None:
    detector = _utilization(clock)
    candidates = [
        _fresh("a", waiting=2, kv=0.4),  # max(2/5, 0.4/0.8) = 0.5
        _fresh("b", waiting=10, kv=0.2),  # max(10/5, 0.2/0.8) = 2.0
        _fresh("c"),  # 0.0
        _fresh("d", waiting=1, kv=0.6),  # max(0.2, 0.75) = 0.75
    ]
    assert detector.saturation(candidates) == pytest.approx((0.5 + 2.0 + 0.0 + 0.75) / 4)


def test_utilization_uses_the_configured_thresholds(clock: FakeClock) -> None:
    detector = _utilization(clock, queue_depth_threshold=10, kv_cache_util_threshold=0.5)
    candidates = [_fresh("a", waiting=5, kv=0.1), _fresh("b", waiting=1, kv=0.4)]
    assert detector.saturation(candidates) == pytest.approx((0.5 + 0.8) / 2)


def test_endpoint_without_metrics_counts_as_saturated(clock: FakeClock) -> None:
    detector = _utilization(clock)
    assert detector.saturation([_fresh("idle"), candidate("unknown")]) == pytest.approx(0.5)


def test_stale_metrics_count_as_saturated(clock: FakeClock) -> None:
    detector = _utilization(clock, metrics_staleness_threshold=Duration(0.25))
    at_limit = _fresh("a", age=0.25)  # exactly the threshold: still fresh
    stale = _fresh("b", age=0.5)
    assert detector.saturation([at_limit, stale]) == pytest.approx(0.5)

    clock.now += 0.25  # now "a" is 0.5 s old as well
    assert detector.saturation([at_limit, stale]) == pytest.approx(1.0)


def test_default_staleness_is_200ms(clock: FakeClock) -> None:
    detector = _utilization(clock)
    assert detector.saturation([_fresh("a", age=0.125)]) == 0.0
    assert detector.saturation([_fresh("a", age=0.25)]) == 1.0


def test_no_candidates_is_saturated(clock: FakeClock) -> None:
    assert _utilization(clock).saturation([]) == 1.0


def test_utilization_filter_keeps_endpoints_below_thresholds(clock: FakeClock) -> None:
    detector = _utilization(clock)
    candidates = [
        _fresh("ok", waiting=4, kv=0.75),
        _fresh("queue-full", waiting=5),
        _fresh("kv-full", kv=0.8),
        _fresh("stale", age=0.5),
        candidate("no-metrics"),
        _fresh("also-ok", waiting=0, kv=0.0),
    ]
    request = inference_request({"model": "m", "prompt": "p"})
    before = list(candidates)

    kept = detector.filter(cycle(request), request, candidates)

    assert _names(kept) == ["ok", "also-ok"]
    assert candidates == before


def test_utilization_filter_headroom_raises_the_limits(clock: FakeClock) -> None:
    detector = _utilization(clock, headroom=0.25)  # limits: queue 6.25, kv 1.0
    candidates = [
        _fresh("queue-6", waiting=6),
        _fresh("queue-7", waiting=7),
        _fresh("kv-0.95", kv=0.95),
        _fresh("kv-1.0", kv=1.0),
    ]
    request = inference_request({"model": "m", "prompt": "p"})
    assert _names(detector.filter(cycle(request), request, candidates)) == ["queue-6", "kv-0.95"]


def test_utilization_filter_fails_open(clock: FakeClock) -> None:
    detector = _utilization(clock)
    candidates = [_fresh("busy", waiting=9), _fresh("stale", age=1.0), candidate("unknown")]
    request = inference_request({"model": "m", "prompt": "p"})
    assert _names(detector.filter(cycle(request), request, candidates)) == [
        "busy",
        "stale",
        "unknown",
    ]


@pytest.mark.parametrize(
    ("parameters", "key"),
    [
        ({"queue_depth_threshold": 0}, "queueDepthThreshold"),
        ({"queue_depth_threshold": -3}, "queueDepthThreshold"),
        ({"kv_cache_util_threshold": 0.0}, "kvCacheUtilThreshold"),
        ({"kv_cache_util_threshold": 1.01}, "kvCacheUtilThreshold"),
        ({"metrics_staleness_threshold": Duration(0.0)}, "metricsStalenessThreshold"),
        ({"headroom": -0.1}, "headroom"),
    ],
)
def test_utilization_parameters_are_validated(parameters: dict[str, Any], key: str) -> None:
    with pytest.raises(ValueError, match=f"^{key}: "):
        UtilizationDetectorParameters(**parameters)


def test_utilization_parameter_defaults() -> None:
    parameters = UtilizationDetectorParameters()
    assert parameters.queue_depth_threshold == 5
    assert parameters.kv_cache_util_threshold == 0.8
    assert parameters.metrics_staleness_threshold == 0.2
    assert parameters.headroom == 0.0
    assert UtilizationDetectorParameters(kv_cache_util_threshold=1.0).kv_cache_util_threshold == 1


# --- concurrency-detector -----------------------------------------------------------------


def _concurrency(**parameters: Any) -> ConcurrencyDetector:
    registry = PluginRegistry()
    concurrency_detector.register(registry)
    plugin = registry.create(
        "concurrency-detector",
        "concurrency-detector",
        ConcurrencyDetectorParameters(**parameters),
        make_handle(),
    )
    assert isinstance(plugin, ConcurrencyDetector)
    return plugin


def _loaded(name: str, requests: int = 0, tokens: int = 0) -> Candidate:
    c = candidate(name)
    c.attributes[IN_FLIGHT_LOAD] = InFlightLoad(requests, tokens)
    return c


def test_concurrency_detector_fills_both_slots_and_consumes_in_flight_load() -> None:
    detector = _concurrency()
    assert isinstance(detector, SaturationDetector)
    assert isinstance(detector, Filter)
    assert list(detector.consumes()) == [IN_FLIGHT_LOAD]


def test_consumed_key_has_the_inflight_producer_as_default() -> None:
    registry = PluginRegistry()
    concurrency_detector.register(registry)
    inflight_load.register(registry)
    (key,) = _concurrency().consumes()
    assert registry.default_producer_for(key) == "inflight-load-producer"


def test_request_saturation_is_total_over_capacity() -> None:
    detector = _concurrency(max_concurrency=10)
    candidates = [_loaded("a", requests=5), _loaded("b", requests=10), candidate("no-attribute")]
    assert detector.saturation(candidates) == pytest.approx(15 / 30)


def test_default_request_limit_is_100() -> None:
    detector = _concurrency()
    assert detector.saturation([_loaded("a", requests=150, tokens=1)]) == pytest.approx(1.5)


def test_token_saturation_uses_token_limit() -> None:
    detector = _concurrency(concurrency_mode="tokens", max_token_concurrency=1000)
    candidates = [_loaded("a", requests=99, tokens=500), _loaded("b", requests=99, tokens=1500)]
    assert detector.saturation(candidates) == pytest.approx(2000 / 2000)


def test_default_token_limit_is_one_million() -> None:
    detector = _concurrency(concurrency_mode="tokens")
    assert detector.saturation([_loaded("a", tokens=250_000)]) == pytest.approx(0.25)


def test_concurrency_no_candidates_is_saturated() -> None:
    assert _concurrency().saturation([]) == 1.0


def test_concurrency_capacity_in_requests_mode_only() -> None:
    assert _concurrency(max_concurrency=4).capacity([candidate("a"), candidate("b")]) == 8
    assert _concurrency(concurrency_mode="tokens").capacity([candidate("a")]) is None


class _InFlight:
    """What ``FlowSaturation`` reads of a flow controller."""

    def __init__(self, count: int) -> None:
        self.count = count

    def pool_in_flight(self) -> int:
        return self.count


def test_flow_saturation_counts_requests_let_go_before_they_are_booked() -> None:
    booked = [_loaded("a", requests=1), _loaded("b", requests=0)]
    saturation = FlowSaturation(_concurrency(max_concurrency=2), lambda: booked)
    assert saturation() == pytest.approx(1 / 4)  # no controller yet: the detector's
    controller = _InFlight(3)  # two let go and not booked yet
    saturation.controller = controller  # type: ignore[assignment]
    assert saturation() == pytest.approx(3 / 4)
    controller.count = 0  # the booked count is higher: it wins
    assert saturation() == pytest.approx(1 / 4)


def test_flow_saturation_of_a_detector_without_capacity_is_the_detectors(
    clock: FakeClock,
) -> None:
    saturation = FlowSaturation(_utilization(clock), lambda: [_fresh("a", waiting=5)])
    saturation.controller = _InFlight(1000)  # type: ignore[assignment]
    assert saturation() == pytest.approx(1.0)


def test_concurrency_filter_keeps_endpoints_below_limit() -> None:
    detector = _concurrency(max_concurrency=10)
    candidates = [
        _loaded("nine", requests=9),
        _loaded("ten", requests=10),
        candidate("no-attribute"),
    ]
    request = inference_request({"model": "m", "prompt": "p"})
    assert _names(detector.filter(cycle(request), request, candidates)) == ["nine", "no-attribute"]


def test_concurrency_filter_headroom() -> None:
    detector = _concurrency(max_concurrency=10, headroom=0.5)  # limit 15
    candidates = [_loaded("ten", requests=10), _loaded("fifteen", requests=15)]
    request = inference_request({"model": "m", "prompt": "p"})
    assert _names(detector.filter(cycle(request), request, candidates)) == ["ten"]


def test_concurrency_filter_in_token_mode() -> None:
    detector = _concurrency(concurrency_mode="tokens", max_token_concurrency=100)
    candidates = [
        _loaded("light", requests=50, tokens=99),
        _loaded("heavy", requests=0, tokens=100),
    ]
    request = inference_request({"model": "m", "prompt": "p"})
    assert _names(detector.filter(cycle(request), request, candidates)) == ["light"]


def test_concurrency_filter_does_not_fail_open() -> None:
    detector = _concurrency(max_concurrency=1)
    candidates = [_loaded("a", requests=1), _loaded("b", requests=2)]
    request = inference_request({"model": "m", "prompt": "p"})
    assert list(detector.filter(cycle(request), request, candidates)) == []


async def test_concurrency_with_the_inflight_producer() -> None:
    handle = make_handle()
    producer = inflight_load.InFlightLoadProducer(
        TypedName("inflight-load-producer", "inflight-load-producer"), handle
    )
    detector = _concurrency(max_concurrency=2)
    a = candidate("a")
    for request_id in ("r1", "r2", "r3"):
        await producer.pre_request(
            inference_request({"model": "m", "prompt": "p"}, request_id=request_id),
            SchedulingResult(
                profile_results={"default": ProfileRunResult((a,))},
                primary_profile_name="default",
            ),
        )
    fresh = [candidate("a"), candidate("b")]
    await producer.prepare_request_data(inference_request(None), fresh)
    assert detector.saturation(fresh) == pytest.approx(3 / 4)
    request = inference_request({"model": "m", "prompt": "p"})
    assert _names(detector.filter(cycle(request), request, fresh)) == ["b"]


@pytest.mark.parametrize(
    ("parameters", "key"),
    [
        ({"concurrency_mode": "bytes"}, "concurrencyMode"),
        ({"max_concurrency": 0}, "maxConcurrency"),
        ({"max_token_concurrency": -1}, "maxTokenConcurrency"),
        ({"headroom": -0.5}, "headroom"),
    ],
)
def test_concurrency_parameters_are_validated(parameters: dict[str, Any], key: str) -> None:
    with pytest.raises(ValueError, match=f"^{key}: "):
        ConcurrencyDetectorParameters(**parameters)


def test_concurrency_parameter_defaults() -> None:
    parameters = ConcurrencyDetectorParameters()
    assert parameters.concurrency_mode == "requests"
    assert parameters.max_concurrency == 100
    assert parameters.max_token_concurrency == 1_000_000
    assert parameters.headroom == 0
