"""``priority-holdback-policy``: its ceilings, its parameters as the config loader sees
them, and what it does to a flow controller whose pool fills with low-priority requests."""

from __future__ import annotations

import asyncio

import pytest

from app.config import ConfigError, load_config
from app.plugins import build_registry
from domain.flowcontrol import (
    FlowControlConfig,
    FlowKey,
    FlowResult,
    PriorityBandConfig,
    QueueOutcome,
    UsageLimitPolicy,
)
from domain.flowcontrol.plugins.priority_holdback import (
    PriorityHoldbackParameters,
    PriorityHoldbackPolicy,
)
from domain.flowcontrol.plugins.static_usage_limit import (
    StaticUsageLimitParameters,
    StaticUsageLimitPolicy,
)
from domain.plugins.base import TypedName
from tests.support.scheduling import plugin_handle
from tests.unit.flowcontrol.harness import Harness

TYPE = "priority-holdback-policy"
Tasks = list[asyncio.Task[FlowResult]]


def policy(**parameters: object) -> PriorityHoldbackPolicy:
    return PriorityHoldbackPolicy(
        TypedName(TYPE, TYPE),
        PriorityHoldbackParameters(**parameters),  # type: ignore[arg-type]
    )


# -- the ceilings -----------------------------------------------------------------------------


def test_rank_ceilings_step_evenly_from_max_to_min_whatever_the_values() -> None:
    limits = policy(min_ceiling=0.4).compute_limit(0.0, [100, 10, 0, -5])
    assert limits == pytest.approx([1.0, 0.8, 0.6, 0.4])
    assert limits[0] == 1.0
    assert limits[-1] == 0.4
    assert policy(min_ceiling=0.5, max_ceiling=0.9).compute_limit(0.3, [10, 0]) == [0.9, 0.5]


def test_value_ceilings_follow_the_priority_values() -> None:
    limits = policy(min_ceiling=0.2, domain="value").compute_limit(0.0, [100, 90, 0, -100])
    assert limits == pytest.approx([1.0, 0.96, 0.6, 0.2])


@pytest.mark.parametrize("domain", ["rank", "value"])
def test_one_band_or_equal_values_get_the_max_ceiling(domain: str) -> None:
    holdback = policy(min_ceiling=0.3, max_ceiling=0.95, domain=domain)
    assert holdback.compute_limit(0.5, [7]) == [0.95]
    assert holdback.compute_limit(0.5, []) == []


def test_saturation_does_not_move_the_ceilings() -> None:
    holdback = policy(min_ceiling=0.5)
    assert holdback.compute_limit(0.0, [1, 0]) == holdback.compute_limit(3.0, [1, 0])


def test_is_a_usage_limit_policy_registered_in_tree() -> None:
    loaded = load_config(
        "featureGates: [flowControl]\n"
        "plugins:\n"
        f"- {{type: {TYPE}, name: holdback, parameters: {{minCeiling: 0.75, domain: value}}}}\n"
        "flowControl: {usageLimitPolicyPluginRef: holdback}\n",
        registry=build_registry(),
        handle=plugin_handle(),
    )
    plugin = loaded.plugins["holdback"]
    assert isinstance(plugin, UsageLimitPolicy)
    assert plugin.compute_limit(0.0, [10, 5, 0]) == [1.0, 0.875, 0.75]
    assert loaded.flow_control is not None
    assert loaded.flow_control.usage_limit_policy_plugin_ref == "holdback"


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ("{}", "plugins[0].parameters.minCeiling: required field is missing"),
        ("{minCeiling: 1.0}", "plugins[0].parameters.minCeiling: must be in [0, 1), got 1.0"),
        ("{minCeiling: -0.1}", "plugins[0].parameters.minCeiling: must be in [0, 1), got -0.1"),
        (
            "{minCeiling: 0.5, maxCeiling: 0}",
            "plugins[0].parameters.maxCeiling: must be in (0, 1], got 0.0",
        ),
        (
            "{minCeiling: 0.5, maxCeiling: 1.5}",
            "plugins[0].parameters.maxCeiling: must be in (0, 1], got 1.5",
        ),
        (
            "{minCeiling: 0.8, maxCeiling: 0.6}",
            "plugins[0].parameters.minCeiling: must not exceed maxCeiling (0.6), got 0.8",
        ),
        ("{minCeiling: 0.5, shape: cubic}", "plugins[0].parameters.shape: Input should be"),
        ("{minCeiling: 0.5, domain: values}", "plugins[0].parameters.domain: Input should be"),
        ("{minCeiling: 0.5, headroom: 0.2}", "plugins[0].parameters.headroom: unknown field"),
    ],
)
def test_a_bad_parameter_stops_start_up_naming_it(parameters: str, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(
            f"plugins:\n- type: {TYPE}\n  parameters: {parameters}\n",
            registry=build_registry(),
            handle=plugin_handle(),
        )
    assert str(caught.value).startswith(message)


# -- in a flow controller ---------------------------------------------------------------------

SLOTS = 4  # the pool's capacity: saturation is the requests in flight over it


class Pool(Harness):
    """Saturation is the controller's own requests in flight over ``SLOTS``."""

    def _read(self) -> float:
        return self.controller.stats().in_flight / SLOTS


def pool(usage: UsageLimitPolicy, *priorities: int) -> Pool:
    """A controller with bands ``priorities`` configured, on a pool of ``SLOTS``."""
    return Pool(
        FlowControlConfig(
            priority_bands=tuple(PriorityBandConfig(priority=p) for p in priorities),
            usage_limit_policy_plugin_ref="usage",
            max_dispatch_per_cycle=16,
        ),
        plugins={"usage": usage},
    )


async def submit(h: Harness, count: int, priority: int, flow: str) -> Tasks:
    tasks = await h.submit_many([h.request(priority=priority, flow=flow) for _ in range(count)])
    await h.notify()
    return tasks


def dispatched(tasks: Tasks) -> int:
    return sum(t.done() and t.result().outcome is QueueOutcome.DISPATCHED for t in tasks)


async def test_high_priority_dispatches_while_low_priority_waits_at_its_ceiling() -> None:
    h = pool(policy(min_ceiling=0.5), 10, 0)  # ceilings 1.0 and 0.5
    low = await submit(h, 6, 0, "batch")
    assert dispatched(low) == 2  # half the pool: the low band's ceiling
    assert h.controller.stats().queued_requests == 4

    high = await h.submit(h.request(priority=10, flow="web"))
    assert high.done()
    assert high.result().outcome is QueueOutcome.DISPATCHED
    assert high.result().queue_time == 0.0
    await h.tick()
    assert dispatched(low) == 2  # the low band still waits

    h.controller.release(FlowKey("batch", 0))
    await h.notify()
    assert dispatched(low) == 2  # 2 of 4 in flight (one high): still at the ceiling
    h.controller.release(FlowKey("web", 10))
    await h.notify()
    assert dispatched(low) == 3  # below it again: the next low request goes


async def test_with_one_ceiling_high_priority_waits_for_low_priority_to_finish() -> None:
    """What the holdback changes: the static policy lets the low band fill the pool."""
    static = StaticUsageLimitPolicy(
        TypedName("static-usage-limit-policy", "usage"), StaticUsageLimitParameters()
    )
    h = pool(static, 10, 0)
    low = await submit(h, 6, 0, "batch")
    assert dispatched(low) == SLOTS
    high = await h.submit(h.request(priority=10, flow="web"))
    await h.tick()
    assert not high.done()
    h.controller.release(FlowKey("batch", 0))
    await h.notify()
    assert high.result().outcome is QueueOutcome.DISPATCHED
    assert dispatched(low) == SLOTS  # the freed slot went to the high request


async def test_a_sheddable_band_at_the_bottom_gets_the_lowest_ceiling() -> None:
    h = pool(policy(min_ceiling=0.25), 10, 0, -1)  # ceilings 1.0, 0.625, 0.25
    sheddable = await submit(h, 4, -1, "shed")
    assert dispatched(sheddable) == 1  # 0/4 < 0.25, 1/4 is not
    normal = await submit(h, 4, 0, "normal")
    assert dispatched(normal) == 2  # 1/4 and 2/4 < 0.625; 3/4 is not
    high = await h.submit(h.request(priority=10, flow="web"))
    assert high.result().outcome is QueueOutcome.DISPATCHED  # 3/4 < 1.0
    h.controller.release(FlowKey("web", 10))
    h.controller.release(FlowKey("normal", 0))
    await h.notify()
    assert dispatched(normal) == 3  # 2/4 < 0.625 again
    h.controller.release(FlowKey("normal", 0))
    h.controller.release(FlowKey("normal", 0))
    await h.notify()
    assert dispatched(normal) == 4
    assert dispatched(sheddable) == 1  # 2/4 is above the sheddable band's ceiling
    h.controller.release(FlowKey("normal", 0))
    h.controller.release(FlowKey("shed", -1))
    await h.notify()
    assert dispatched(sheddable) == 2  # an idle pool: the next one goes, and only one


async def test_min_ceiling_zero_holds_the_lowest_band_back_even_on_an_idle_pool() -> None:
    h = pool(policy(min_ceiling=0.0), 0, -1)
    held = await h.submit(h.request(priority=-1, flow="shed", ttl=5.0))
    await h.notify()
    assert not held.done()
    normal = await h.submit(h.request(priority=0, flow="normal"))
    assert normal.result().outcome is QueueOutcome.DISPATCHED
    await h.advance(5.0)
    assert held.result().outcome is QueueOutcome.EVICTED_TTL
