"""destination-endpoint-served-verifier: served endpoint → conformance response header."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from domain.plugins.base import PluginRegistry
from domain.requestcontrol.interfaces import ResponseHeaderProcessor, ResponseInfo
from domain.requestcontrol.plugins import served_verifier
from domain.scheduling.types import InferenceRequest
from tests.support.scheduling import inference_request
from tests.unit.requestcontrol import make_handle


@pytest.fixture
def verifier() -> ResponseHeaderProcessor:
    registry = PluginRegistry()
    served_verifier.register(registry)
    plugin = registry.create(
        "destination-endpoint-served-verifier", "verifier", None, make_handle()
    )
    assert isinstance(plugin, ResponseHeaderProcessor)
    return plugin


def _request() -> InferenceRequest:
    return inference_request({"model": "m", "prompt": "p"})


def _response(metadata: Mapping[str, Mapping[str, object]]) -> ResponseInfo:
    return ResponseInfo(request_id="req-1", status=200, request_metadata=metadata)


async def test_served_endpoint_becomes_a_response_header(
    verifier: ResponseHeaderProcessor,
) -> None:
    request = _request()
    metadata = {"envoy.lb": {"x-gateway-destination-endpoint-served": "10.0.0.7:8000"}}
    await verifier.response_header(request, _response(metadata), None)
    assert request.response_headers == [("x-conformance-test-served-endpoint", "10.0.0.7:8000")]


async def test_headers_asked_for_by_other_plugins_are_kept(
    verifier: ResponseHeaderProcessor,
) -> None:
    request = _request()
    request.add_response_header("x-other", "1")
    metadata = {"envoy.lb": {"x-gateway-destination-endpoint-served": "[fd00::1]:8000"}}
    await verifier.response_header(request, _response(metadata), None)
    assert request.response_headers == [
        ("x-other", "1"),
        ("x-conformance-test-served-endpoint", "[fd00::1]:8000"),
    ]


@pytest.mark.parametrize(
    "metadata",
    [
        {},
        {"envoy.lb": {}},
        {"other": {"x-gateway-destination-endpoint-served": "10.0.0.7:8000"}},
        {"envoy.lb": {"x-gateway-destination-endpoint-served": ""}},
        {"envoy.lb": {"x-gateway-destination-endpoint-served": 7}},
    ],
)
async def test_nothing_added_without_a_served_endpoint(
    verifier: ResponseHeaderProcessor, metadata: Mapping[str, Mapping[str, object]]
) -> None:
    request = _request()
    await verifier.response_header(request, _response(metadata), None)
    assert request.response_headers is None
