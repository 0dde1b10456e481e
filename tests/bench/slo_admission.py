"""Benchmark (not a test): SLO attainment with ``latency-slo-admitter`` on and off, under an
overload.

Each column runs routing_quality's shared-prefix prompts open loop (Poisson arrivals) at
``--rate`` requests per simulated second (about twice what 4 simulators under cache pressure
serve) through Envoy and the EPP with the llm-d chart's latency-predictor config
(``tests.support.charts``): ``admitter-on`` as it ships, ``admitter-off`` without
``latency-slo-admitter``. Every request is sheddable (objective ``batch``, priority -1, from
``--static-objectives``) and carries ``x-slo-ttft-ms: --slo-ttft-ms`` (simulated; the EPP gets
real time). The first ``--warm`` requests teach the models and are not counted.

Prints per column: requests sent, answered, refused (429), SLO attainment of every request sent
(a refusal misses it), goodput (requests within the SLO per simulated second) and the client
TTFT p50/p90 of the answered ones.

    .venv/bin/python -m tests.bench.slo_admission [--rate 8] [--requests 600] [--seed 1]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import tempfile
from pathlib import Path

from tests.bench.routing_quality import (
    ClientRecord,
    build_workload,
    burst_schedule,
    drive_open_loop,
    percentile,
)
from tests.support.charts import LLMD_LATENCY_PREDICTOR_PLUGINS
from tests.support.stack import Stack, StackOptions, trusted_header

OBJECTIVES = """\
kind: InferenceObjective
metadata: {name: batch}
spec: {priority: -1}
"""
COLUMNS = {
    "admitter-on": LLMD_LATENCY_PREDICTOR_PLUGINS,
    "admitter-off": LLMD_LATENCY_PREDICTOR_PLUGINS.replace("- type: latency-slo-admitter\n", ""),
}


async def run(url: str, args: argparse.Namespace) -> tuple[ClientRecord, ClientRecord, float]:
    """The warm-up (closed to the count), then the measured overload; their records and the
    measured part's duration (real seconds)."""
    prompts = build_workload(groups=40, prompts_per_group=5, rounds=6, seed=args.seed)
    headers = {
        "x-slo-ttft-ms": f"{args.slo_ttft_ms * args.time_scale:g}",
        trusted_header("x-gateway-inference-objective"): "batch",
    }
    warm = prompts[: args.warm]
    rest = prompts[args.warm : args.warm + args.requests]
    warm_times = burst_schedule(len(warm), args.rate / 2, 0.0, 1.0, args.seed)
    warmed, _ = await drive_open_loop(
        url, warm, [t * args.time_scale for t in warm_times], args.max_tokens, headers=headers
    )
    times = burst_schedule(len(rest), args.rate, 0.0, 1.0, args.seed + 1)
    measured, elapsed = await drive_open_loop(
        url, rest, [t * args.time_scale for t in times], args.max_tokens, headers=headers
    )
    return warmed, measured, elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=8.0, help="requests per simulated second")
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--warm", type=int, default=120)
    parser.add_argument("--slo-ttft-ms", type=float, default=3000.0, help="simulated")
    parser.add_argument("--max-tokens", type=int, default=30)
    parser.add_argument("--time-scale", type=float, default=0.5)
    parser.add_argument("--num-gpu-blocks", type=int, default=240)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--columns", default=",".join(COLUMNS))
    args = parser.parse_args()
    print(f"load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}", flush=True)
    print(
        f"4 simulators ({args.num_gpu_blocks} KV blocks), {args.requests} sheddable requests at"
        f" {args.rate:g}/s (simulated) after {args.warm} to warm up, TTFT SLO"
        f" {args.slo_ttft_ms:g} ms (simulated), seed {args.seed}",
        flush=True,
    )
    rows: list[tuple[str, list[str]]] = []
    names = args.columns.split(",")
    results = []
    for name in names:
        with tempfile.TemporaryDirectory() as tmp:
            objectives = Path(tmp) / "objectives.yaml"
            objectives.write_text(OBJECTIVES)
            options = StackOptions(
                simulators=4,
                simulator_base_ip="127.0.0.210",
                simulator_args=[
                    "--preset",
                    "h100-8b",
                    "--time-scale",
                    str(args.time_scale),
                    "--num-gpu-blocks",
                    str(args.num_gpu_blocks),
                ],
                epp_args=[
                    "--config-text",
                    COLUMNS[name],
                    "--static-objectives",
                    str(objectives),
                ],
            )
            with Stack.run(options) as stack:
                _, rec, elapsed = asyncio.run(run(stack.url, args))
        results.append((name, rec, elapsed))
        print(f"  {name}: done", flush=True)
    scale = args.time_scale
    for name, rec, elapsed in results:
        met = sum(1 for ttfb, _ in rec.answered if ttfb / scale <= args.slo_ttft_ms)
        refused = rec.errors.get("HTTP 429", 0)
        ttft = [t / scale for t in rec.ttfb_ms]
        rows.append(
            (
                name,
                [
                    str(rec.sent),
                    str(len(rec.answered)),
                    str(refused),
                    f"{met / rec.sent:.1%}" if rec.sent else "nan",
                    f"{met / (elapsed / scale):.2f}" if elapsed > 0 else "nan",
                    f"{percentile(ttft, 0.5):.0f} / {percentile(ttft, 0.9):.0f}"
                    if ttft
                    else f"{math.nan}",
                ],
            )
        )
    labels = ["sent", "answered", "refused 429", "SLO attainment", "goodput /s", "TTFT p50/p90"]
    print()
    print(f"{'':<14}" + "".join(f"{label:>18}" for label in labels))
    for name, values in rows:
        print(f"{name:<14}" + "".join(f"{v:>18}" for v in values))


if __name__ == "__main__":
    main()
