"""The llm-d router's band settings: the template for priorities below 0
(``defaultNegativePriorityBand``) and a band's own request TTL (``defaultRequestTTL``)."""

from __future__ import annotations

import pytest

from domain.flowcontrol import BandConfig, FlowControlConfig, PriorityBandConfig, QueueOutcome
from tests.unit.flowcontrol.harness import Harness


async def test_bands_below_zero_are_made_from_the_negative_template() -> None:
    config = FlowControlConfig(
        default_priority_band=BandConfig(max_requests=3),
        default_negative_priority_band=BandConfig(max_requests=1),
        displacement=False,
    )
    h = Harness(config, saturation=1.0)
    low = await h.submit_many([h.request(priority=-5) for _ in range(2)])
    normal = await h.submit_many([h.request(priority=5) for _ in range(3)])
    assert not low[0].done()
    assert low[1].result().outcome is QueueOutcome.REJECTED_CAPACITY  # 1 per negative band
    assert not any(t.done() for t in normal)  # 3 in a band made from the default template
    bands = {b.priority: b.max_requests for b in h.controller.stats().bands}
    assert bands == {5: 3, -5: 1}


async def test_without_a_negative_template_every_band_uses_the_default_one() -> None:
    h = Harness(FlowControlConfig(default_priority_band=BandConfig(max_requests=2)), saturation=1.0)
    await h.submit_many([h.request(priority=-5), h.request(priority=5)])
    assert {b.priority: b.max_requests for b in h.controller.stats().bands} == {5: 2, -5: 2}


async def test_a_bands_ttl_replaces_the_default_for_its_requests() -> None:
    config = FlowControlConfig(
        default_request_ttl=10.0,
        priority_bands=(PriorityBandConfig(priority=-1, request_ttl=100.0),),
    )
    h = Harness(config, saturation=1.0)
    batch = await h.submit(h.request(priority=-1))
    normal = await h.submit(h.request(priority=0))
    own = await h.submit(h.request(priority=-1, ttl=5.0))  # a request's own TTL still wins
    await h.advance(10.0)
    assert normal.result().outcome is QueueOutcome.EVICTED_TTL
    assert own.result().outcome is QueueOutcome.EVICTED_TTL
    assert not batch.done()
    await h.advance(90.0)
    assert batch.result().outcome is QueueOutcome.EVICTED_TTL
    assert batch.result().queue_time == pytest.approx(100.0)


async def test_a_template_ttl_of_zero_waits_until_dispatched() -> None:
    config = FlowControlConfig(
        default_request_ttl=10.0,
        default_priority_band=BandConfig(request_ttl=0.0),
        max_dispatch_interval=60.0,
    )
    h = Harness(config, saturation=1.0)
    task = await h.submit(h.request(priority=3))
    await h.advance(3600.0)
    assert not task.done()


def test_a_band_ttl_must_be_a_finite_duration() -> None:
    with pytest.raises(ValueError, match=r"^defaultRequestTTL: must be a finite duration >= 0"):
        BandConfig(request_ttl=-1.0)
