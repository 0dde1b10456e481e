"""The EPP's own /metrics after real traffic through Envoy: reference names, sane values."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator

import orjson
import pytest
import urllib3
from prometheus_client.parser import text_string_to_metric_families

from tests.simulator import DEFAULT_MODEL, INSTANCE_HEADER
from tests.support.stack import Stack, StackOptions, wait_for

pytestmark = pytest.mark.e2e

PROMPTS = [f"Tell me about topic {i}. " * 40 for i in range(3)]
ROUNDS = 6

Samples = dict[str, list[tuple[dict[str, str], float]]]


def _scrape(stack: Stack) -> Samples:
    response = urllib3.request("GET", stack.epp_metrics_url, timeout=10)
    assert response.status == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples: Samples = {}
    for family in text_string_to_metric_families(response.data.decode()):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return samples


def _scrape_until(stack: Stack, holds: Callable[[Samples], bool], what: str) -> Samples:
    """Scrape until ``holds`` (gauges refresh on their own schedule); fail after 10 s."""

    found: list[Samples] = []

    def attempt() -> bool:
        found.append(_scrape(stack))
        return holds(found[-1])

    wait_for(attempt, timeout=10, what=what)
    return found[-1]


def _sum(samples: Samples, name: str, **labels: str) -> float:
    return sum(
        value
        for found, value in samples.get(name, [])
        if all(found.get(k) == v for k, v in labels.items())
    )


@pytest.fixture(scope="module")
def traffic() -> Iterator[tuple[Stack, Counter[str], int]]:
    """3 simulators behind Envoy and the EPP; repeated prompts, streamed and not, one bad."""
    options = StackOptions(
        simulators=3, epp_args=["--refresh-prometheus-metrics-interval", "100ms"]
    )
    with Stack.run(options) as stack:
        served: Counter[str] = Counter()
        ok = 0
        for round_ in range(ROUNDS):
            for i, prompt in enumerate(PROMPTS):
                stream = (round_ + i) % 2 == 1
                payload: dict[str, object] = {
                    "model": DEFAULT_MODEL,
                    "prompt": prompt,
                    "max_tokens": 4,
                    "stream": stream,
                }
                if stream:
                    payload["stream_options"] = {"include_usage": True}
                response = urllib3.request(
                    "POST",
                    f"{stack.url}/v1/completions",
                    body=orjson.dumps(payload),
                    headers={"content-type": "application/json"},
                    timeout=30,
                )
                assert response.status == 200, response.data
                served[response.headers[INSTANCE_HEADER]] += 1
                ok += 1
        bad = urllib3.request("POST", f"{stack.url}/v1/completions", body=b"{not json", timeout=30)
        assert bad.status == 400
        yield stack, served, ok


def test_requests_count_per_model_and_errors_per_code(
    traffic: tuple[Stack, Counter[str], int],
) -> None:
    stack, _, ok = traffic
    samples = _scrape(stack)
    model = {"model_name": DEFAULT_MODEL, "target_model_name": DEFAULT_MODEL}
    assert _sum(samples, "inference_objective_request_total", priority="0", **model) == ok
    assert _sum(samples, "inference_objective_request_error_total", error_code="BadRequest") == 1
    for histogram in (
        "inference_objective_request_duration_seconds",
        "inference_objective_request_sizes",
        "inference_objective_response_sizes",
        "inference_objective_output_tokens",
        "inference_objective_normalized_time_per_output_token_seconds",
    ):
        assert _sum(samples, f"{histogram}_count", **model) == ok, histogram
    assert _sum(samples, "inference_objective_output_tokens_sum", **model) == 4 * ok
    assert _sum(samples, "inference_objective_input_tokens_sum", **model) > 0
    assert _sum(samples, "inference_objective_running_requests", model_name=DEFAULT_MODEL) == 0


def test_scheduler_attempts_per_pod_sum_to_the_requests(
    traffic: tuple[Stack, Counter[str], int],
) -> None:
    stack, served, ok = traffic
    samples = _scrape(stack)
    attempts = samples["inference_extension_scheduler_attempts_total"]
    per_pod = {
        labels["pod_name"]: value for labels, value in attempts if labels["status"] == "success"
    }
    assert sum(per_pod.values()) == ok
    addresses = stack.simulator_addresses
    # the pods the EPP counted are the ones that served, as often
    assert per_pod == {addresses[name]: float(count) for name, count in served.items()}
    for labels, _ in attempts:
        assert labels["port"] == labels["pod_name"].rsplit(":", 1)[1]
        assert labels["target_model_name"] == DEFAULT_MODEL
    assert _sum(samples, "inference_extension_scheduler_e2e_duration_seconds_count") == ok


def test_plugin_durations_cover_every_extension_point(
    traffic: tuple[Stack, Counter[str], int],
) -> None:
    stack, _, ok = traffic
    samples = _scrape(stack)
    counts: Counter[tuple[str, str]] = Counter()
    for labels, value in samples["inference_extension_plugin_duration_seconds_count"]:
        counts[(labels["extension_point"], labels["plugin_type"])] += int(value)
    assert counts[("Filter", "prefix-cache-affinity-filter")] == ok
    assert counts[("Scorer", "token-load-scorer")] == ok
    assert counts[("Picker", "max-score-picker")] == ok
    assert counts[("ProfilePicker", "single-profile-handler")] >= ok
    assert counts[("ProcessProfilesResults", "single-profile-handler")] == ok


def test_the_prefix_indexer_fills_and_repeated_prompts_hit(
    traffic: tuple[Stack, Counter[str], int],
) -> None:
    stack, _, ok = traffic
    samples = _scrape_until(
        stack,
        lambda s: _sum(s, "inference_extension_prefix_indexer_size") > 0,
        "the prefix indexer size",
    )
    assert _sum(samples, "inference_extension_prefix_indexer_hit_ratio_count") == ok
    # every prompt after its first showing matched some blocks
    hits = ok - len(PROMPTS)
    hit_ratio_sum = _sum(samples, "inference_extension_prefix_indexer_hit_ratio_sum")
    assert hit_ratio_sum >= 0.5 * hits
    assert _sum(samples, "inference_extension_prefix_indexer_hit_bytes_sum") > 0


def test_pool_gauges_cover_the_fresh_endpoints(
    traffic: tuple[Stack, Counter[str], int],
) -> None:
    stack, _, _ = traffic
    samples = _scrape_until(
        stack, lambda s: _sum(s, "inference_pool_ready_pods") == 3, "3 ready pods"
    )
    for gauge in (
        "inference_pool_average_kv_cache_utilization",
        "inference_pool_average_queue_size",
        "inference_pool_average_running_requests",
    ):
        ((_, value),) = samples[gauge]
        assert value >= 0, gauge
    pods = {
        labels["model_server_pod"] for labels, _ in samples["inference_pool_per_pod_queue_size"]
    }
    assert pods == set(stack.simulator_addresses.values())
    ((info, _),) = samples["inference_extension_info"]
    assert info["build_ref"]
    assert "inference_extension_scrape_errors_total" not in samples  # all scrapes succeeded
