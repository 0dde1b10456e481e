"""Block hashing adapter (xxhash): the production ``BlockHasher``."""

from adapters.xxhash.block_hasher import XxhashBlockHasher

__all__ = ["XxhashBlockHasher"]
