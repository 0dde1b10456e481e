"""``destination-endpoint-served-verifier``: echoes the served endpoint in a response header.

A test plugin for the Gateway API Inference Extension conformance suite. On the response
headers, Envoy reports the endpoint that actually served the request in the request's
metadata, ``envoy.lb`` / ``x-gateway-destination-endpoint-served`` (``ip:port``). This
plugin makes the response carry that value as the header
``x-conformance-test-served-endpoint``.

It asks for the header with ``request.add_response_header``; once the response-header hooks
have run, the Director adds every header asked for to the response it sends back to Envoy.
When the metadata does not carry the served endpoint (or it is not a non-empty string),
nothing is added.
"""

from __future__ import annotations

from domain.plugins.base import PluginRegistry, TypedName, class_factory
from domain.requestcontrol.interfaces import ResponseInfo
from domain.scheduling.types import InferenceRequest
from ports.endpoints import EndpointInfo

__all__ = [
    "SERVED_ENDPOINT_HEADER",
    "SERVED_ENDPOINT_KEY",
    "TYPE",
    "DestinationEndpointServedVerifier",
    "register",
]

TYPE = "destination-endpoint-served-verifier"

#: The metadata namespace and key Envoy reports the served endpoint under.
LB_NAMESPACE = "envoy.lb"
SERVED_ENDPOINT_KEY = "x-gateway-destination-endpoint-served"
#: The response header the served endpoint is written to.
SERVED_ENDPOINT_HEADER = "x-conformance-test-served-endpoint"


class DestinationEndpointServedVerifier:
    """ResponseHeaderProcessor copying the served endpoint into a response header."""

    def __init__(self, typed_name: TypedName, parameters: object) -> None:
        self._typed_name = typed_name

    @property
    def typed_name(self) -> TypedName:
        return self._typed_name

    async def response_header(
        self, request: InferenceRequest, response: ResponseInfo, target: EndpointInfo | None
    ) -> None:
        lb = response.request_metadata.get(LB_NAMESPACE)
        if lb is None:
            return
        served = lb.get(SERVED_ENDPOINT_KEY)
        if not isinstance(served, str) or not served:
            return
        request.add_response_header(SERVED_ENDPOINT_HEADER, served)


def register(registry: PluginRegistry) -> None:
    registry.register(
        TYPE,
        class_factory(TYPE, DestinationEndpointServedVerifier),
        description="conformance: echoes the served endpoint in a response header",
    )
