"""Block hashing adapter (xxhash): the production ``BlockHasher``, and the XXH3-128
``Digest`` of the engine's ``xxhash`` block-hash algorithms."""

from adapters.xxhash.block_hasher import XxhashBlockHasher, xxh3_128

__all__ = ["XxhashBlockHasher", "xxh3_128"]
