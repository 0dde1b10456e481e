"""What a user sees of the response path with Envoy's two response modes (decision 0028).

One EPP (with ``predicted-latency-producer``, whose TTFT samples come from the first response
chunk) behind two Envoys from the shipped config: the shipped one, sending the EPP response
bodies (``response_body_mode: FULL_DUPLEX_STREAMED``), and a lean one with
``response_body_mode: NONE``, which sends the EPP the response headers and then ends the
ext_proc stream when the response has ended. In both, every client gets its whole answer and
every request stops running when its response ends; only with bodies are token usage and
TTFT recorded. Each mode runs with and without Envoy's graceful-close runtime flag.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator

import pytest

from tests.simulator import DEFAULT_MODEL
from tests.support.stack import Stack, StackOptions, metric_sum, wait_for

pytestmark = pytest.mark.e2e

CONFIG = """
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: approx-prefix-cache-producer
- type: inflight-load-producer
- type: predicted-latency-producer
- type: prefix-cache-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: prefix-cache-scorer
  - pluginRef: max-score-picker
"""

RUNNING = "inference_objective_running_requests"
COMPLETED = "inference_objective_request_duration_seconds_count"
INPUT_TOKENS = "inference_objective_input_tokens_count"
TTFT = "inference_objective_request_ttft_seconds_count"
REQUESTS = 6


def _send(url: str, *, stream: bool, index: int) -> bytes:
    document: dict[str, object] = {
        "model": DEFAULT_MODEL,
        "prompt": f"Tell me about response modes, number {index}. " * 8,
        "max_tokens": 12,
    }
    if stream:
        document["stream"] = True
        document["stream_options"] = {"include_usage": True}
    request = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps(document).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status == 200
        return bytes(response.read())


def _whole(body: bytes, *, stream: bool) -> None:
    """The client got the complete answer: every event up to ``[DONE]``, or the JSON
    document with its usage."""
    if stream:
        events = [line for line in body.split(b"\n") if line.startswith(b"data: ")]
        assert events[-1] == b"data: [DONE]"
        usage = json.loads(events[-2].removeprefix(b"data: "))["usage"]
    else:
        usage = json.loads(body)["usage"]
    assert usage["completion_tokens"] == 12


@pytest.fixture(scope="module", params=[True, False], ids=["graceful-close", "stock-envoy"])
def stack(request: pytest.FixtureRequest) -> Iterator[tuple[Stack, str]]:
    options = StackOptions(
        simulators=2,
        simulator_args=["--itl-ms", "5"],
        epp_args=["--config-text", CONFIG],
        envoy_graceful_close=request.param,
    )
    with Stack.run(options) as running:
        _, lean_port = running.start_envoy(ext_proc=True, name="envoy-lean", response_body=False)
        yield running, f"http://127.0.0.1:{lean_port}"
        faults = {
            name: value
            for name, value in running.envoy_counters("envoy-lean").items()
            if name.rsplit(".", 1)[-1] in Stack.EXTPROC_FAULTS and value
        }
        assert not faults, f"the lean Envoy counted ext_proc faults: {faults}"


def _metrics(stack: Stack) -> dict[str, float]:
    url = stack.epp_metrics_url
    return {name: metric_sum(url, name) for name in (RUNNING, COMPLETED, INPUT_TOKENS, TTFT)}


def _settled(stack: Stack, completed: float) -> dict[str, float]:
    """The metrics once every request sent so far has ended (none running, all counted)."""

    def ended() -> dict[str, float] | None:
        metrics = _metrics(stack)
        return metrics if metrics[RUNNING] == 0 and metrics[COMPLETED] >= completed else None

    return wait_for(ended, timeout=15, what="every request to end in the EPP's metrics")


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "non-streamed"])
def test_with_response_bodies_usage_and_ttft_are_recorded(
    stack: tuple[Stack, str], stream: bool
) -> None:
    running, _ = stack
    before = _settled(running, 0)
    for index in range(REQUESTS):
        _whole(_send(running.url, stream=stream, index=index), stream=stream)
    after = _settled(running, before[COMPLETED] + REQUESTS)
    assert after[COMPLETED] == before[COMPLETED] + REQUESTS
    assert after[INPUT_TOKENS] == before[INPUT_TOKENS] + REQUESTS
    assert after[TTFT] == before[TTFT] + REQUESTS


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "non-streamed"])
def test_without_response_bodies_requests_end_with_their_response(
    stack: tuple[Stack, str], stream: bool
) -> None:
    running, lean_url = stack
    before = _settled(running, 0)
    for index in range(REQUESTS):
        _whole(_send(lean_url, stream=stream, index=index), stream=stream)
    # each request stops running and counts as completed when its response ends ...
    after = _settled(running, before[COMPLETED] + REQUESTS)
    assert after[COMPLETED] == before[COMPLETED] + REQUESTS
    # ... and nothing was read from a body the EPP never saw
    assert after[INPUT_TOKENS] == before[INPUT_TOKENS]
    assert after[TTFT] == before[TTFT]
    envoy = running.envoy_counters("envoy-lean", "ext_proc.stream_msgs_sent")
    assert sum(envoy.values()) > 0
