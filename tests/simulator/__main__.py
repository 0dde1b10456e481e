"""Command-line mode: serve a simulator fleet until SIGINT or SIGTERM.

    python -m tests.simulator --instances 3 --base-ip 127.0.0.2 --port 8000

Prints ``ready <name> <url>`` per instance once all of them listen.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Sequence

from tests.simulator.config import DEFAULT_MODEL, SimulatorConfig
from tests.simulator.fleet import SimulatorFleet


def _parser() -> argparse.ArgumentParser:
    defaults = SimulatorConfig()
    parser = argparse.ArgumentParser(
        prog="python -m tests.simulator", description="Serve simulated vLLM instances."
    )
    parser.add_argument("--instances", type=int, default=1, help="number of instances")
    parser.add_argument("--base-ip", default="127.0.0.2", help="address of the first instance")
    parser.add_argument("--port", type=int, default=8000, help="port of every instance; 0 = free")
    parser.add_argument("--name-prefix", default="sim", help="instances are named <prefix>-<i>")
    parser.add_argument(
        "--model",
        action="append",
        dest="models",
        metavar="NAME",
        help=f"served model name, repeatable (default {DEFAULT_MODEL})",
    )
    parser.add_argument(
        "--lora", action="append", dest="loras", default=[], metavar="NAME", help="LoRA adapter"
    )
    parser.add_argument("--max-loras", type=int, default=defaults.max_loras)
    parser.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs)
    parser.add_argument("--ttft", type=float, default=defaults.ttft, help="seconds")
    parser.add_argument("--itl", type=float, default=defaults.itl, help="seconds per token")
    parser.add_argument("--default-max-tokens", type=int, default=defaults.default_max_tokens)
    parser.add_argument("--block-size", type=int, default=defaults.block_size)
    parser.add_argument("--num-gpu-blocks", type=int, default=defaults.num_gpu_blocks)
    return parser


def _config(args: argparse.Namespace) -> SimulatorConfig:
    return SimulatorConfig(
        served_model_names=tuple(args.models or (DEFAULT_MODEL,)),
        lora_adapters=tuple(args.loras),
        max_loras=args.max_loras,
        max_num_seqs=args.max_num_seqs,
        ttft=args.ttft,
        itl=args.itl,
        default_max_tokens=args.default_max_tokens,
        block_size=args.block_size,
        num_gpu_blocks=args.num_gpu_blocks,
    )


async def _serve(fleet: SimulatorFleet) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    async with fleet:
        for instance in fleet:
            print(f"ready {instance.name} {instance.url}", flush=True)
        await stop.wait()


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        fleet = SimulatorFleet(
            args.instances,
            config=_config(args),
            base_ip=args.base_ip,
            port=args.port,
            name_prefix=args.name_prefix,
        )
    except ValueError as exc:
        parser.error(str(exc))
    try:
        asyncio.run(_serve(fleet))
    except OSError as exc:  # typically the address is already in use
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
