"""Approximate prefix-cache affinity: block hashing and the in-memory prefix index."""

from domain.prefixcache.hasher import StdlibBlockHasher
from domain.prefixcache.index import InMemoryPrefixIndex, SupportsSyncEndpointRemoval

__all__ = ["InMemoryPrefixIndex", "StdlibBlockHasher", "SupportsSyncEndpointRemoval"]
