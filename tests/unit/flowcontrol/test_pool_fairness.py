"""Max-min fairness over several processes, measured in simulated time (``pool_sim``):
3 flow controllers sharing their flows on a board whose copies are 20 ms old (the Redis
adapter's round-trip period), 24 server slots, requests of 0.4-1.2 s (the pool completes
about 30 a second), tenants spread at random over the processes. The targets are issue
39's: a tenant that asks for less than half the pool keeps at least 90% of its rate alone
beside a heavy one; two tenants that both ask for more each get 45-55%. Per-process flow
control (no shared counts) is the contrast: it lets each process fill the pool."""

from __future__ import annotations

from tests.unit.flowcontrol.pool_sim import ROUND_ROBIN, PoolSim, Tenant

STALENESS = 0.02
WARMUP = 5.0
SECONDS = 30.0


def pool(
    *, shared: bool = True, fairness: str = "max-min-fairness-policy", receivers: int = 3
) -> PoolSim:
    return PoolSim(
        processes=3, staleness=STALENESS, shared=shared, fairness=fairness, receivers=receivers
    )


async def test_an_open_loop_tenant_under_half_the_pool_gets_what_it_asks() -> None:
    # 7.5 requests a second: a quarter of what the pool completes.
    light = Tenant("light", rate=7.5)
    alone = await pool().run([light], warmup=WARMUP, seconds=SECONDS)
    mixed = await pool().run([light, Tenant("heavy", users=30)], warmup=WARMUP, seconds=SECONDS)
    assert mixed.completed["light"] >= 0.95 * mixed.sent["light"]
    assert mixed.rate("light") >= 0.95 * alone.rate("light")
    assert mixed.rate("heavy") > mixed.rate("light")  # the heavy tenant has the rest
    waits = sorted(mixed.waits["light"])
    assert waits[int(0.9 * len(waits))] < 0.2  # within a few releases (about 33 ms apart)


async def test_a_closed_loop_tenant_under_half_the_pool_keeps_its_rate_alone() -> None:
    alone = await pool().run([Tenant("light", users=6)], warmup=WARMUP, seconds=SECONDS)
    mixed = await pool().run(
        [Tenant("light", users=6), Tenant("heavy", users=30)], warmup=WARMUP, seconds=SECONDS
    )
    assert mixed.rate("light") >= 0.9 * alone.rate("light")


async def test_two_tenants_above_half_the_pool_share_it_evenly() -> None:
    mixed = await pool().run(
        [Tenant("light", users=16), Tenant("heavy", users=80)], warmup=WARMUP, seconds=SECONDS
    )
    assert 0.45 <= mixed.share("light") <= 0.55
    assert mixed.over_limit < 0.1  # a round trip's staleness: a few dispatches too many


async def test_per_process_flow_control_gives_the_heavier_tenant_more_and_overfills() -> None:
    mixed = await pool(shared=False, fairness=ROUND_ROBIN).run(
        [Tenant("light", users=16), Tenant("heavy", users=80)], warmup=WARMUP, seconds=SECONDS
    )
    assert mixed.share("light") < 0.35
    assert mixed.over_limit > 0.5


async def test_a_burst_at_idle_processes_is_held_to_the_pools_limit() -> None:
    # 96 users start at once, spread over 3 idle processes whose copies are 20 ms old.
    # Before: each process saw an empty pool and let in up to the whole limit on its own
    # (72 in all, 5 heavy for 1 light), and the excess took a request's length to drain.
    # Now each counts, for every other live process, as many as it let in since its copy.
    burst = await pool().run(
        [Tenant("light", users=16), Tenant("heavy", users=80)], warmup=0.0, seconds=1.0
    )
    assert burst.peak <= 26


async def test_one_process_receiving_everything_still_fills_the_pool() -> None:
    # The others are live and idle: the share a process assumes they take lasts only until
    # its next copy shows they took nothing, so it still fills the pool alone.
    alone = await pool(receivers=1).run([Tenant("heavy", users=40)], warmup=1.0, seconds=10.0)
    spread = await pool().run([Tenant("heavy", users=40)], warmup=1.0, seconds=10.0)
    assert alone.peak == 24
    assert alone.rate("heavy") >= 0.97 * spread.rate("heavy")
