"""The data layer: endpoints, their metrics and attributes, and what keeps them current."""

from domain.datalayer.endpoint import Endpoint, EndpointMetrics

__all__ = ["Endpoint", "EndpointMetrics"]
