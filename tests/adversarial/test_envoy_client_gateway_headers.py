"""Finding: the shipped Envoy config passed a client's ``x-gateway-model-name-rewrite``,
``x-gateway-inference-objective`` and ``x-gateway-inference-fairness-id`` on to the EPP,
which trusts them: any client could pick its own model rewrite, priority and fairness id.

Envoy now strips every client ``x-gateway-*`` request header before ext_proc; a trusted
filter placed after that (here the test stack's stand-in, ``trusted_header``) may set them.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import orjson
import pytest

from tests.simulator import BODY_SHA256_HEADER, DEFAULT_MODEL
from tests.simulator.server import RANK_SEEN_HEADER
from tests.support.stack import Stack, StackOptions, trusted_header

pytestmark = pytest.mark.e2e

OBJECTIVE = "x-gateway-inference-objective"
REWRITE = "x-gateway-model-name-rewrite"
FAIRNESS = "x-gateway-inference-fairness-id"

OBJECTIVES = """
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceObjective
metadata: {name: critical}
spec: {priority: 100}
"""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    objectives = Path(tmp_path_factory.mktemp("objectives")) / "objectives.yaml"
    objectives.write_text(OBJECTIVES)
    options = StackOptions(simulators=1, epp_args=["--static-objectives", str(objectives)])
    with Stack.run(options) as running:
        yield running


async def _post(stack: Stack, headers: dict[str, str]) -> tuple[int, str, bytes]:
    body = orjson.dumps({"model": DEFAULT_MODEL, "prompt": "hello", "max_tokens": 2})
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{stack.url}/v1/completions", data=body, headers=headers) as response,
    ):
        await response.read()
        return response.status, response.headers[BODY_SHA256_HEADER], body


async def _priorities(stack: Stack) -> dict[str, float]:
    async with aiohttp.ClientSession() as session, session.get(stack.epp_metrics_url) as r:
        text = await r.text()
    totals: dict[str, float] = {}
    for m in re.finditer(
        r'^inference_objective_request_total\{[^}]*priority="(-?\d+)"[^}]*\} (\S+)$',
        text,
        re.MULTILINE,
    ):
        totals[m.group(1)] = totals.get(m.group(1), 0.0) + float(m.group(2))
    return totals


async def test_a_clients_gateway_headers_change_nothing(stack: Stack) -> None:
    headers = {OBJECTIVE: "critical", REWRITE: "someone-elses-model", FAIRNESS: "me-first"}
    status, received_sha, sent = await _post(stack, headers)
    assert status == 200
    # before: the body reached the model server with "someone-elses-model"; after: as sent
    assert received_sha == hashlib.sha256(sent).hexdigest()
    # before: counted at priority 100 (the objective the client named); after: at 0
    assert await _priorities(stack) == {"0": 1.0}


async def test_a_clients_data_parallel_rank_never_reaches_the_model_server(stack: Stack) -> None:
    body = orjson.dumps({"model": DEFAULT_MODEL, "prompt": "hello", "max_tokens": 2})
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"{stack.url}/v1/completions", data=body, headers={"x-data-parallel-rank": "3"}
        ) as response,
    ):
        await response.read()
        assert response.status == 200
        assert RANK_SEEN_HEADER not in response.headers  # the EPP pinned no rank here


async def test_a_trusted_filter_may_still_set_them(stack: Stack) -> None:
    before = await _priorities(stack)
    status, received_sha, sent = await _post(stack, {trusted_header(OBJECTIVE): "critical"})
    assert status == 200
    assert received_sha == hashlib.sha256(sent).hexdigest()
    after = await _priorities(stack)
    assert after.get("100", 0.0) == before.get("100", 0.0) + 1
