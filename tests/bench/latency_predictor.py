"""Benchmark (not a test): the CPU ``predicted-latency-producer`` adds, in process.

- **per routed request**: its PrepareData (every candidate's features, TTFT and TPOT
  predictions and ``LatencyPredictionInfo``) for ``--candidates`` (8) candidates with
  prefix matches, in-flight load and scraped metrics, the models warm (per-endpoint
  level);
- **per sample**: one observation taught to the TTFT model (the pool's level and the
  endpoint's, with the periodic refit amortised), as each response's first chunk does;
- **whole request**: PrepareData, PreRequest and the response hooks of one streamed
  request (three chunks), as the Director calls them.

The issue's budget is 50 µs of CPU per routed request with 8 candidates. Each figure is
the lowest of ``--repeat`` (5) rounds of ``--requests`` (5,000): other processes only ever
add time.

    .venv/bin/python -m tests.bench.latency_predictor [--candidates 8] [--repeat 5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import time

from domain.datalayer.attributes import (
    IN_FLIGHT_LOAD,
    PREFIX_CACHE_MATCH_INFO,
    InFlightLoad,
    PrefixCacheMatchInfo,
)
from domain.plugins.base import TypedName
from domain.requestcontrol.interfaces import ResponseInfo, ResponseOutcome
from domain.requestcontrol.plugins.predicted_latency_producer import (
    TYPE,
    PredictedLatencyParameters,
    PredictedLatencyProducer,
)
from domain.scheduling.types import Candidate, ProfileRunResult, SchedulingResult
from tests.support.scheduling import candidate, inference_request, plugin_handle


def candidates(count: int, rng: random.Random) -> list[Candidate]:
    found = []
    for index in range(count):
        c = candidate(
            f"pod-{index}",
            waiting_queue_size=rng.randrange(10),
            running_requests_size=rng.randrange(30),
            kv_cache_usage_percent=rng.random(),
        )
        c.attributes[PREFIX_CACHE_MATCH_INFO] = PrefixCacheMatchInfo(rng.randrange(60), 64, 16)
        c.attributes[IN_FLIGHT_LOAD] = InFlightLoad(rng.randrange(20), rng.randrange(40_000))
        found.append(c)
    return found


async def main_async(args: argparse.Namespace) -> None:
    rng = random.Random(1)
    handle = plugin_handle()
    producer = PredictedLatencyProducer(
        TypedName(TYPE, TYPE), PredictedLatencyParameters(streaming_mode=True), handle
    )
    pool = candidates(args.candidates, rng)
    for _ in range(400):  # warm every endpoint's level
        for c in pool:
            x = (1.0, rng.random() * 2, rng.random() * 40, rng.random(), rng.random(), 0.2, 0.5)
            producer.ttft.observe(c.name, x, 100 + 500 * x[1] + 300 * x[2])
            producer.tpot.observe(c.name, x, 12 + 3 * x[5])
    body = {"model": "m", "prompt": "p" * 4096, "stream": True}
    requests = [inference_request(body, request_id=f"r{i}") for i in range(args.requests)]
    prepare = sample = whole = float("inf")
    x = (1.0, 0.5, 3.0, 0.4, 0.2, 0.3, 0.6)
    for _ in range(args.repeat):
        started = time.process_time()
        for request in requests:
            await producer.prepare_request_data(request, pool)
        prepare = min(prepare, (time.process_time() - started) / len(requests))
        started = time.process_time()
        for i in range(args.requests):
            producer.ttft.observe(pool[i % len(pool)].name, x, 900.0 + i % 7)
        sample = min(sample, (time.process_time() - started) / args.requests)
        result = SchedulingResult(
            profile_results={"default": ProfileRunResult(target_endpoints=(pool[0],))},
            primary_profile_name="default",
        )
        headers = {":status": "200", "content-type": "text/event-stream"}
        started = time.process_time()
        for request in requests:
            await producer.prepare_request_data(request, pool)
            await producer.pre_request(request, result)
            for end, chunk in ((False, b"data: {}\n\n"), (False, b"data: {}\n\n"), (True, b"")):
                response = ResponseInfo(
                    request_id=request.request_id,
                    headers=headers,
                    status=200,
                    end_of_stream=end,
                    chunk=chunk,
                    outcome=ResponseOutcome.COMPLETED if end else ResponseOutcome.PENDING,
                )
                await producer.response_body(request, response, pool[0].info)
        whole = min(whole, (time.process_time() - started) / len(requests))
    print(f"load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    print(f"{args.candidates} candidates, lowest of {args.repeat} rounds of {args.requests}")
    print(f"  PrepareData (predict every candidate): {prepare * 1e6:7.1f} us per routed request")
    print(f"  one TTFT sample learnt:                 {sample * 1e6:7.1f} us")
    print(f"  a whole streamed request (all hooks):   {whole * 1e6:7.1f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--candidates", type=int, default=8)
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--repeat", type=int, default=5)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
