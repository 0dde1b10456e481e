"""The prefix-cache parameters shared by the producer, the scorer and the affinity filter."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CHARS_PER_TOKEN", "DEFAULT_BLOCK_SIZE_TOKENS", "PrefixCacheParameters"]

#: Characters assumed per token when turning token block sizes into byte block sizes.
CHARS_PER_TOKEN = 4
DEFAULT_BLOCK_SIZE_TOKENS = 16


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefixCacheParameters:
    """Parameters of the prefix producer, also accepted by ``prefix-cache-scorer``.

    - ``autoTune``: take the block size from the first candidate's ``cache_block_size``
      metric and each endpoint's LRU capacity from its ``cache_num_blocks``, when > 0.
    - ``blockSizeTokens``: block size in tokens (default 16).
    - ``blockSize``: deprecated block size in characters; only accepted together with
      ``blockSizeTokens``, which then wins (``blockSize`` is ignored).
    - ``maxPrefixBlocksToMatch``: at most this many blocks are hashed (default 256).
    - ``maxPrefixTokensToMatch``: when > 0, replaces the block limit with
      ``tokens // blockSizeTokens`` (at least 1), using the block size in effect.
    - ``lruCapacityPerServer``: hashes remembered per endpoint (default 31250).
    """

    auto_tune: bool = True
    block_size_tokens: int | None = None
    block_size: int | None = None
    max_prefix_blocks_to_match: int = 256
    max_prefix_tokens_to_match: int | None = None
    lru_capacity_per_server: int = 31250

    def __post_init__(self) -> None:
        if self.block_size_tokens is not None and self.block_size_tokens <= 0:
            raise ValueError("blockSizeTokens: must be > 0")
        if self.block_size is not None:
            if self.block_size_tokens is None:
                raise ValueError(
                    "blockSize: deprecated (a size in characters); set blockSizeTokens instead"
                )
            if self.block_size <= 0:
                raise ValueError("blockSize: must be > 0")
        if self.max_prefix_blocks_to_match <= 0:
            raise ValueError("maxPrefixBlocksToMatch: must be > 0")
        if self.lru_capacity_per_server <= 0:
            raise ValueError("lruCapacityPerServer: must be > 0")

    @property
    def tokens_per_block(self) -> int:
        """The configured block size in tokens (``blockSizeTokens`` or its default)."""
        if self.block_size_tokens is None:
            return DEFAULT_BLOCK_SIZE_TOKENS
        return self.block_size_tokens

    def max_blocks(self, block_size_tokens: int) -> int:
        """How many blocks to hash when blocks are ``block_size_tokens`` tokens long."""
        tokens = self.max_prefix_tokens_to_match
        if tokens is not None and tokens > 0:
            return max(1, tokens // block_size_tokens)
        return self.max_prefix_blocks_to_match
