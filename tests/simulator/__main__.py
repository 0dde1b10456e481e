"""Command-line mode: serve a simulator fleet until SIGINT or SIGTERM.

    python -m tests.simulator --instances 3 --base-ip 127.0.0.2 --port 8000
    python -m tests.simulator --preset h100-8b --time-scale 0.1 --num-gpu-blocks 4096
    python -m tests.simulator --instances 4 --preset h100-8b --slow-instances 1 --slowdown 2

Prints ``ready <name> <url>`` per instance once all of them listen. Without ``--preset``
the defaults are those of ``SimulatorConfig()`` (no simulated delays); flags given
explicitly override the preset.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any

from tests.simulator.config import DEFAULT_MODEL, SimulatorConfig
from tests.simulator.fleet import SimulatorFleet

PRESETS: dict[str, Callable[[], SimulatorConfig]] = {"h100-8b": SimulatorConfig.h100_8b}
"""Named base configurations for ``--preset``."""

_MILLIS = 1e-3


def _parser() -> argparse.ArgumentParser:
    defaults = SimulatorConfig()
    parser = argparse.ArgumentParser(
        prog="python -m tests.simulator",
        description="Serve simulated vLLM instances.",
        epilog=(
            "Timing: TTFT = queueing + (prefill overhead + uncached prompt tokens x per-token"
            " prefill) x load; later tokens take ITL x load; load = 1 + alpha x (running - 1)"
            " / max-num-seqs. Durations are simulated; real waits are multiplied by the time"
            " scale."
        ),
    )
    parser.add_argument("--instances", type=int, default=1, help="number of instances")
    parser.add_argument("--base-ip", default="127.0.0.2", help="address of the first instance")
    parser.add_argument("--port", type=int, default=8000, help="port of every instance; 0 = free")
    parser.add_argument("--name-prefix", default="sim", help="instances are named <prefix>-<i>")
    # every option below defaults to None: "not given", so that a preset value survives
    parser.add_argument(
        "--preset", choices=sorted(PRESETS), help="base configuration (default: no delays)"
    )
    parser.add_argument(
        "--model",
        action="append",
        dest="models",
        metavar="NAME",
        help=f"served model name, repeatable (default {DEFAULT_MODEL})",
    )
    parser.add_argument(
        "--lora", action="append", dest="loras", metavar="NAME", help="LoRA adapter, repeatable"
    )
    parser.add_argument(
        "--max-loras", type=int, help=f"adapters in use at once (default {defaults.max_loras})"
    )
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        help=f"running requests at most (default {defaults.max_num_seqs})",
    )
    parser.add_argument(
        "--prefill-overhead-ms", type=float, help="fixed prefill time (default 0; preset 30)"
    )
    parser.add_argument(
        "--prefill-per-token-ms",
        type=float,
        help="prefill time per uncached prompt token (default 0; preset 0.25)",
    )
    parser.add_argument(
        "--itl-ms", type=float, help="time per output token after the first (default 0; preset 12)"
    )
    parser.add_argument(
        "--load-alpha", type=float, help="slow-down at a full batch (default 0; preset 1.5)"
    )
    parser.add_argument(
        "--time-scale",
        type=float,
        help="real seconds per simulated second (default 1; 0 = never wait)",
    )
    parser.add_argument(
        "--default-max-tokens",
        type=int,
        help=f"tokens generated without max_tokens (default {defaults.default_max_tokens})",
    )
    parser.add_argument(
        "--block-size", type=int, help=f"KV-cache block size (default {defaults.block_size})"
    )
    parser.add_argument(
        "--num-gpu-blocks",
        type=int,
        help=f"KV-cache blocks (default {defaults.num_gpu_blocks})",
    )
    parser.add_argument(
        "--max-model-len", type=int, help="longest prompt + max_tokens (default: the cache size)"
    )
    parser.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        default=None,
        help="report usage.prompt_tokens_details.cached_tokens",
    )
    parser.add_argument(
        "--kv-events-port",
        type=int,
        help="publish KV-cache events (vLLM's ZMQ format) on this port; replay on port + 1",
    )
    parser.add_argument("--tokenizer", help="a tokenizer.json: tokenize and hash as vLLM does")
    parser.add_argument("--hash-seed", help="vLLM's PYTHONHASHSEED for block hashes")
    parser.add_argument(
        "--prefix-caching-hash-algo",
        choices=("sha256", "sha256_cbor", "xxhash", "xxhash_cbor"),
        help="default sha256",
    )
    parser.add_argument(
        "--slow-instances",
        type=int,
        default=0,
        help="the first N instances are --slowdown times slower in prefill and decode",
    )
    parser.add_argument(
        "--slowdown",
        type=float,
        default=2.0,
        help="how much slower the --slow-instances are (default 2)",
    )
    # earlier spellings, in seconds
    parser.add_argument("--ttft", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--itl", type=float, help=argparse.SUPPRESS)
    return parser


def config_from_args(args: argparse.Namespace) -> SimulatorConfig:
    """The configuration the parsed command line asks for (raises ``ValueError``)."""
    base = PRESETS[args.preset]() if args.preset else SimulatorConfig()
    overrides: dict[str, Any] = {}
    if args.models:
        overrides["served_model_names"] = tuple(args.models)
    if args.loras:
        overrides["lora_adapters"] = tuple(args.loras)
    millis = {
        "prefill_overhead": args.prefill_overhead_ms,
        "prefill_per_token": args.prefill_per_token_ms,
        "itl": args.itl_ms,
    }
    overrides.update({key: value * _MILLIS for key, value in millis.items() if value is not None})
    if args.ttft is not None and args.prefill_overhead_ms is None:
        overrides["prefill_overhead"] = args.ttft
    if args.itl is not None and args.itl_ms is None:
        overrides["itl"] = args.itl
    plain = {
        "max_loras": args.max_loras,
        "max_num_seqs": args.max_num_seqs,
        "load_alpha": args.load_alpha,
        "time_scale": args.time_scale,
        "default_max_tokens": args.default_max_tokens,
        "block_size": args.block_size,
        "num_gpu_blocks": args.num_gpu_blocks,
        "max_model_len": args.max_model_len,
        "enable_prompt_tokens_details": args.enable_prompt_tokens_details,
        "tokenizer_path": args.tokenizer,
        "hash_seed": args.hash_seed,
        "prefix_caching_hash_algo": args.prefix_caching_hash_algo,
    }
    if args.kv_events_port is not None:
        overrides.update(
            kv_events=True,
            kv_events_port=args.kv_events_port,
            kv_events_replay_port=args.kv_events_port + 1,
        )
    overrides.update({key: value for key, value in plain.items() if value is not None})
    resized = "num_gpu_blocks" in overrides or "block_size" in overrides
    if resized and "max_model_len" not in overrides and base.max_model_len is not None:
        capacity = overrides.get("block_size", base.block_size) * overrides.get(
            "num_gpu_blocks", base.num_gpu_blocks
        )
        overrides["max_model_len"] = min(base.max_model_len, capacity)
    return dataclasses.replace(base, **overrides)


def slow_overrides(args: argparse.Namespace, config: SimulatorConfig) -> dict[int, SimulatorConfig]:
    """The configurations of the ``--slow-instances`` (instance index -> config); raises
    ``ValueError`` for a bad count or factor."""
    if not 0 <= args.slow_instances <= args.instances:
        raise ValueError(
            f"--slow-instances must be within 0..{args.instances}, got {args.slow_instances}"
        )
    if args.slow_instances == 0:
        return {}
    slow = config.slowed(args.slowdown)
    return dict.fromkeys(range(args.slow_instances), slow)


def parse_config(argv: Sequence[str]) -> SimulatorConfig:
    """The configuration of a command line (exits with a usage error on bad input)."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))


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
        config = config_from_args(args)
        fleet = SimulatorFleet(
            args.instances,
            config=config,
            base_ip=args.base_ip,
            port=args.port,
            name_prefix=args.name_prefix,
            overrides=slow_overrides(args, config),
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
