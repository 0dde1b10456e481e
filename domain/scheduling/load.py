"""Token arithmetic shared by the load-aware plugins: how many tokens a request brings, and
how many of them an endpoint would still have to prefill.

The input estimate is the one the ``inflight-load-producer`` books: the request size in
bytes / 4 (at least 1) when the size is known, else the number of token ids of a
completions prompt given as token ids, else round(characters / 4) of the request's prefix
input. The uncached part on an endpoint subtracts the tokens of the prefix blocks the
endpoint is believed to hold (``PrefixCacheMatchInfo``: matched blocks x block size).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from domain.datalayer.attributes import PREFIX_CACHE_MATCH_INFO, PrefixCacheMatchInfo
from domain.datastore.endpoint import EndpointMetrics
from domain.plugins.state import StateKey
from domain.requesthandling.openai import ApiKind, ParsedRequest
from domain.scheduling.types import Candidate, InferenceRequest
from ports.codec import JsonCodec

__all__ = [
    "PREFIX_BLOCKS",
    "PREFIX_BLOCKS_OWNER",
    "PrefixBlocks",
    "check_reported_request_tokens",
    "input_tokens",
    "reported_excess_tokens",
    "round_half_up",
    "uncached_tokens",
]


@dataclass(frozen=True, slots=True)
class PrefixBlocks:
    """The request's prompt cut into prefix blocks by the prefix producer: one hash per
    full block of ``block_size_tokens`` tokens, in prompt order (a chain: equal hashes
    mean equal prefixes)."""

    hashes: Sequence[int]
    block_size_tokens: int


#: Where the prefix producer leaves the request's ``PrefixBlocks`` for other plugins (the
#: ``kv-capacity-gate``): ``request.state.get(PREFIX_BLOCKS_OWNER, PREFIX_BLOCKS)``.
PREFIX_BLOCKS_OWNER = "prefix-blocks"
PREFIX_BLOCKS: StateKey[PrefixBlocks] = StateKey("prefix-blocks")


def reported_excess_tokens(
    metrics: EndpointMetrics | None, own_requests: int, per_request: int
) -> int:
    """The load a server reports beyond what the EPP knows it sent there, in tokens: its
    scraped waiting plus running requests less ``own_requests`` (the requests in flight
    there from the EPP), when positive, times ``per_request``; 0 without metrics."""
    if metrics is None:
        return 0
    excess = metrics.waiting_queue_size + metrics.running_requests_size - own_requests
    return excess * per_request if excess > 0 else 0


def check_reported_request_tokens(value: object) -> None:
    """``reportedRequestTokens`` must be an integer >= 0."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"reportedRequestTokens: must be an integer >= 0, got {value!r}")


def round_half_up(value: float) -> int:
    return int(value + 0.5)


def _token_id_count(body: ParsedRequest) -> int:
    """The number of token ids of a completions prompt given as token ids, else 0."""
    if body.api is not ApiKind.COMPLETIONS or body.opaque:
        return 0
    prompt: Any = body.payload.get("prompt")
    if not isinstance(prompt, list) or not prompt:
        return 0
    first = prompt[0]
    if isinstance(first, list):
        return sum(len(item) for item in prompt if isinstance(item, list))
    if isinstance(first, int | float) and not isinstance(first, bool):
        return len(prompt)
    return 0


def input_tokens(request: InferenceRequest, codec: JsonCodec) -> int:
    """The estimated input tokens of ``request`` (see the module docstring)."""
    if request.request_size_bytes > 0:
        return max(1, request.request_size_bytes // 4)
    if request.body is None:
        return 0
    count = _token_id_count(request.body)
    if count == 0:
        text = request.body.prefix_input(codec).decode("utf-8", errors="replace")
        count = round_half_up(len(text) / 4)
    return count


def uncached_tokens(candidate: Candidate, tokens: int) -> int:
    """The part of ``tokens`` input tokens that ``candidate`` does not hold cached."""
    info = candidate.attributes.get(PREFIX_CACHE_MATCH_INFO)
    if isinstance(info, PrefixCacheMatchInfo) and info.match_blocks > 0:
        return max(0, tokens - info.match_blocks * info.block_size_tokens)
    return tokens
