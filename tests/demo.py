"""``make demo``: the EPP behind a real Envoy in front of three simulated model servers.

Starts everything on loopback, sends a few dozen requests through Envoy, prints where
each one went and why, then a summary, and stops everything it started (also on Ctrl-C).
"""

from __future__ import annotations

import asyncio
import sys
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families

from tests.simulator import DEFAULT_MODEL, DESTINATION_SEEN_HEADER, INSTANCE_HEADER
from tests.support.stack import Stack, StackOptions

DECISION_HEADER = "x-epp-decision"

# Four "conversations", each with a long shared system prompt: the EPP's prefix-cache
# affinity sends a conversation back to the server that already holds its prefix.
SYSTEMS = [
    "You are a support agent for a Kubernetes platform team. " * 12,
    "You are a poet who writes about distributed systems. " * 12,
    "You are a terse reviewer of gateway configurations. " * 12,
    "You are a tutor explaining LLM inference to students. " * 12,
]
QUESTIONS = [
    "Explain KV-cache reuse in two sentences.",
    "Write a haiku about load balancing.",
    "What is an endpoint picker?",
    "Summarise the Gateway API Inference Extension.",
]
SHORT_NAMES = {
    "queue-scorer": "queue",
    "kv-cache-utilization-scorer": "kv",
    "prefix-cache-scorer": "prefix",
}


def _why(decision: str) -> str:
    """The chosen endpoint's total and scores from the EPP's ``x-epp-decision`` header."""
    _, _, ranked = decision.partition("; ")
    best, _, _ = ranked.partition("), ")
    endpoint, _, rest = best.partition("=")
    total, _, scores = rest.partition(" (")
    for name, short in SHORT_NAMES.items():
        scores = scores.replace(f"{name}=", f"{short}=")
    runners = ranked.count("), ")
    return f"score {total} ({scores.rstrip(')')}), best of {runners + 1}" if endpoint else ""


@dataclass(frozen=True)
class Outcome:
    number: int
    kind: str
    status: int
    instance: str
    destination: str
    millis: float
    detail: str


def _request(i: int) -> tuple[str, str, bytes]:
    prompt = SYSTEMS[i % len(SYSTEMS)] + QUESTIONS[(i // len(SYSTEMS)) % len(QUESTIONS)]
    stream = i % 3 == 2
    if i == 31:
        return "completions", "invalid JSON", b"{this is not json"
    if i % 2:
        api = "chat/completions"
        payload: dict[str, object] = {"messages": [{"role": "user", "content": prompt}]}
    else:
        api = "completions"
        payload = {"prompt": prompt}
    payload.update(model=DEFAULT_MODEL, max_tokens=8, stream=stream)
    if stream:
        payload["stream_options"] = {"include_usage": True}
    kind = f"{api}{' stream' if stream else ''}"
    return api, kind, orjson.dumps(payload)


async def _send(session: aiohttp.ClientSession, stack: Stack, i: int) -> Outcome:
    api, kind, body = _request(i)
    started = time.perf_counter()
    async with session.post(f"{stack.url}/v1/{api}", data=body) as response:
        text = await response.text()
        millis = (time.perf_counter() - started) * 1000
        if response.status != 200:
            detail = text.strip().splitlines()[0][:70]
        else:
            detail = _why(response.headers.get(DECISION_HEADER, ""))
        return Outcome(
            number=i,
            kind=kind,
            status=response.status,
            instance=response.headers.get(INSTANCE_HEADER, "-"),
            destination=response.headers.get(DESTINATION_SEEN_HEADER, "-"),
            millis=millis,
            detail=detail,
        )


async def _traffic(stack: Stack, count: int) -> list[Outcome]:
    async with aiohttp.ClientSession() as session:
        outcomes = []
        for wave in range(0, count, 8):  # a few at a time, so the output reads in order
            outcomes += await asyncio.gather(
                *(_send(session, stack, i) for i in range(wave, min(wave + 8, count)))
            )
        return outcomes


def _print_epp_metrics(stack: Stack) -> None:
    """A few of the EPP's own Prometheus metrics, as a dashboard would show them."""
    with urllib.request.urlopen(stack.epp_metrics_url, timeout=10) as response:
        text = response.read().decode()
    samples = [s for family in text_string_to_metric_families(text) for s in family.samples]

    def total(name: str) -> float:
        return sum(s.value for s in samples if s.name == name)

    print(f"EPP metrics (scraped from {stack.epp_metrics_url})")
    for s in samples:
        if s.name == "inference_extension_scheduler_attempts_total":
            labels = s.labels
            print(
                f"  scheduler_attempts_total{{status={labels['status']}, "
                f"pod={labels['pod_name']}}} {s.value:.0f}"
            )
    attempts = total("inference_extension_scheduler_e2e_duration_seconds_count")
    if attempts:
        mean = total("inference_extension_scheduler_e2e_duration_seconds_sum") / attempts
        print(f"  scheduler e2e latency: mean {mean * 1000:.3f} ms over {attempts:.0f} attempts")
    lookups = total("inference_extension_prefix_indexer_hit_ratio_count")
    if lookups:
        ratio = total("inference_extension_prefix_indexer_hit_ratio_sum") / lookups
        print(f"  prefix cache hit ratio: mean {ratio:.2f} over {lookups:.0f} lookups")
    errors = [s for s in samples if s.name == "inference_objective_request_error_total"]
    for s in errors:
        print(f"  request_error_total{{error_code={s.labels['error_code']}}} {s.value:.0f}")


def main() -> int:
    print("Starting 3 simulated model servers, the EPP and Envoy on loopback ...", flush=True)
    with Stack.run(StackOptions(simulators=3, epp_args=["--explain-decisions"])) as stack:
        print(f"  Envoy listening on {stack.url}")
        print(
            f"  EPP ext_proc on 127.0.0.1:{stack.epp_port} (TLS), health on {stack.epp_health_port}"
        )
        for name, address in stack.simulator_addresses.items():
            print(f"  model server {name} at {address}")
        print()
        outcomes = asyncio.run(_traffic(stack, 36))
        print(
            f"{'#':>3}  {'request':<24} {'status':>6}  {'served by':<10} "
            f"{'EPP chose':<16} {'ms':>6}  why"
        )
        for o in outcomes:
            why = o.detail
            print(
                f"{o.number:>3}  {o.kind:<24} {o.status:>6}  {o.instance:<10} "
                f"{o.destination:<16} {o.millis:>6.1f}  {why}"
            )
        print()
        served = Counter(o.instance for o in outcomes if o.status == 200)
        statuses = Counter(o.status for o in outcomes)
        agree = sum(
            1
            for o in outcomes
            if o.status == 200 and stack.simulator_addresses.get(o.instance) == o.destination
        )
        ok = [o.millis for o in outcomes if o.status == 200]
        print("Summary")
        print(f"  requests: {len(outcomes)}; statuses: {dict(sorted(statuses.items()))}")
        for name in stack.simulator_addresses:
            print(f"  {name}: {served.get(name, 0)} request(s)")
        print(f"  served where the EPP chose: {agree} of {len(ok)}")
        if ok:
            ok.sort()
            print(f"  latency through Envoy: median {ok[len(ok) // 2]:.1f} ms, max {ok[-1]:.1f} ms")
        print()
        _print_epp_metrics(stack)
        print("Stopping everything ...")
    print("Done.")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("\nInterrupted; everything started has been stopped.")
        sys.exit(130)
