"""How long one KV-event message holds the event loop (not a test, not run by the suite).

A real ZMQ PUB socket on loopback sends, to the EPP's ``KVEventSubscriptions`` feeding an
``InMemoryKVBlockIndex``, one large message of each kind below (each within the 16 MiB a
message may have), then a small marker batch. Meanwhile a task on the same event loop
sleeps 1 ms at a time and records how late it wakes: the longest delay is the longest the
loop was held. Printed per message: its size, the longest stall, the time until the marker
was applied (the whole message processed), and the index's entries after it. On a busy
machine the stalls include waiting for a core; "CPU held" does not: the most CPU time the
event loop's thread spent between two of the heartbeat's turns.
The garbage collector is tuned as the ``epp`` process tunes it (``app.runner``: start-up
objects frozen, young threshold 50,000).

    .venv/bin/python -m tests.bench.kv_events_stall [--repeat 3] [--only 1,3]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import time

import msgspec
import zmq
import zmq.asyncio

from adapters.kvevents import KVEventSubscriptions
from domain.prefixcache.kv_block_index import InMemoryKVBlockIndex

ENDPOINT = "bench"
MARKER = 7


def _payloads() -> dict[str, bytes]:
    rng = random.Random(1)
    hashes = [rng.getrandbits(64) | (1 << 63) for _ in range(1_500_000)]
    encode = msgspec.msgpack.encode
    return {
        "1 event, 1.5M hashes": encode([time.time(), [["BlockStored", hashes, None, [], 16]], 0]),
        "93,750 events of 16 hashes": encode(
            [
                time.time(),
                [
                    ["BlockStored", hashes[i : i + 16], None, [], 16]
                    for i in range(0, 1_500_000, 16)
                ],
                0,
            ]
        ),
        "900,000 AllBlocksCleared": encode([time.time(), [["AllBlocksCleared"]] * 900_000, 0]),
        "1 event, 16M token ids": encode(
            [time.time(), [["BlockStored", [1], None, [1] * 16_000_000, 16]], 0]
        ),
    }


async def _run(repeat: int, only: set[int] | None = None) -> None:
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind("tcp://127.0.0.1:*")
    address = str(pub.getsockopt_string(zmq.LAST_ENDPOINT))
    index = InMemoryKVBlockIndex(max_blocks_per_endpoint=1 << 21)
    subscriptions = KVEventSubscriptions(sink=index)
    subscriptions.add_address(ENDPOINT, address, None)
    seq = 0

    async def send(payload: bytes) -> None:
        nonlocal seq
        await pub.send_multipart((b"kv", seq.to_bytes(8, "big"), payload), copy=False)
        seq += 1

    def marker(block: int) -> bytes:
        return msgspec.msgpack.encode([time.time(), [["BlockStored", [block], None, [], 16]], 0])

    # until connected
    while not index.match([MARKER], [ENDPOINT]):
        await send(marker(MARKER))
        await asyncio.sleep(0.02)
    payloads = {
        name: payload
        for number, (name, payload) in enumerate(_payloads().items(), 1)
        if only is None or number in only
    }
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 50, 100)
    print(
        f"{'message':30} {'MB':>6} {'longest stall':>14} {'p99 stall':>10} {'CPU held':>9} "
        f"{'applied in':>11} {'entries':>9}"
    )
    try:
        for _ in range(repeat):
            for name, payload in payloads.items():
                await send(msgspec.msgpack.encode([time.time(), [["AllBlocksCleared"]], 0]))
                stalls: list[float] = []
                held: list[float] = []
                done = asyncio.Event()

                async def heartbeat(
                    stalls: list[float] = stalls,
                    held: list[float] = held,
                    done: asyncio.Event = done,
                ) -> None:
                    while not done.is_set():
                        before, cpu = time.perf_counter(), time.thread_time()
                        await asyncio.sleep(0.001)
                        stalls.append(time.perf_counter() - before - 0.001)
                        held.append(time.thread_time() - cpu)

                beat = asyncio.create_task(heartbeat())
                await asyncio.sleep(0.05)
                started = time.perf_counter()
                await send(payload)
                block = MARKER + seq
                await send(marker(block))
                while True:  # the marker comes after the message: it was processed
                    if index.match([block], [ENDPOINT]):
                        break
                    await asyncio.sleep(0.001)
                took = time.perf_counter() - started
                done.set()
                await beat
                stalls.sort()
                p99 = stalls[len(stalls) * 99 // 100]
                print(
                    f"{name:30} {len(payload) / 1e6:6.1f} {stalls[-1] * 1000:11.1f} ms "
                    f"{p99 * 1000:7.1f} ms {max(held) * 1000:6.1f} ms {took:9.2f} s "
                    f"{index.endpoint_size(ENDPOINT):9,}"
                )
    finally:
        await subscriptions.close()
        pub.close()
        ctx.term()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--only", default="", help="message numbers, e.g. 1,3")
    args = parser.parse_args()
    only = {int(n) for n in args.only.split(",")} if args.only else None
    asyncio.run(_run(args.repeat, only))


if __name__ == "__main__":
    main()
