"""The datastore: the pool's endpoints (metadata, latest metrics, attributes) and
objectives, kept current by an endpoint source and the data layer."""

from domain.datastore.endpoint import Endpoint, EndpointMetrics
from domain.datastore.store import Datastore

__all__ = ["Datastore", "Endpoint", "EndpointMetrics"]
