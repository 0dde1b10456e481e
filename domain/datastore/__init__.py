"""The datastore: the pool's endpoints, kept current by an endpoint source."""

from domain.datastore.store import Datastore

__all__ = ["Datastore"]
