"""Benchmark (not a test): issue 39 (a) in simulated time, without the machine.

Runs ``tests.unit.flowcontrol.pool_sim`` (the real flow controllers and fairness policies
on a fake clock, 24 server slots, requests of 0.4-1.2 s: the pool completes about 30 a
second) for each column, and prints the light tenant's figures: closed-loop (6 users
beside 30) with heavy against alone, open-loop (``--light-rate``, 6/s, a fifth of the pool)
completed against offered and its wait for a slot, two tenants above half (16 and 80
users) and the share of dispatches that found the slots full, and the most requests
running at once when 96 users start together at idle processes.

    .venv/bin/python -m tests.bench.fairness_sim [--seconds 60] [--staleness 0.02,0.05,0.2]
"""

from __future__ import annotations

import argparse
import asyncio

from tests.unit.flowcontrol.pool_sim import MAX_MIN, ROUND_ROBIN, Outcome, PoolSim, Tenant


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values) or [0.0]
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def column(label: str, args: argparse.Namespace, **kw: object) -> None:
    async def run(tenants: list[Tenant], warmup: float = 5.0) -> Outcome:
        return await PoolSim(**kw).run(tenants, warmup=warmup, seconds=args.seconds)  # type: ignore[arg-type]

    heavy = Tenant("heavy", users=30)
    closed_alone = await run([Tenant("light", users=6)])
    closed = await run([Tenant("light", users=6), heavy])
    opened = await run([Tenant("light", rate=args.light_rate), heavy])
    equal = await run([Tenant("light", users=16), Tenant("heavy", users=80)])
    burst = await PoolSim(**kw).run(  # type: ignore[arg-type]
        [Tenant("light", users=16), Tenant("heavy", users=80)], warmup=0.0, seconds=1.0
    )
    waits = opened.waits.get("light", [])
    print(
        f"{label:<34} {closed.rate('light') / closed_alone.rate('light'):>7.1%}"
        f" {opened.completed['light'] / opened.sent['light']:>7.1%}"
        f" {1e3 * sum(waits) / max(1, len(waits)):>5.0f} / {1e3 * quantile(waits, 0.9):<4.0f}"
        f" {equal.share('light'):>7.1%} {equal.over_limit:>7.1%} {burst.peak:>5}",
        flush=True,
    )


async def main(args: argparse.Namespace) -> None:
    print(
        f"{'':<34} {'closed':>7} {'open':>7} {'wait ms':>12} {'equal':>7} {'full':>7} {'burst':>5}"
    )
    await column("1 process, round robin", args, processes=1, staleness=0.0, fairness=ROUND_ROBIN)
    await column("1 process, max-min", args, processes=1, staleness=0.0, fairness=MAX_MIN)
    await column(
        "3 processes, per process",
        args,
        processes=3,
        staleness=0.0,
        shared=False,
        fairness=ROUND_ROBIN,
    )
    await column("3 processes, pool-wide, fresh", args, processes=3, staleness=0.0)
    for staleness in (float(s) for s in args.staleness.split(",")):
        label = f"3 processes, pool-wide, {staleness * 1e3:g} ms old"
        await column(label, args, processes=3, staleness=staleness)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--light-rate", type=float, default=6.0)
    parser.add_argument("--staleness", default="0.02,0.05,0.2")
    asyncio.run(main(parser.parse_args()))
