"""Building blocks for plugin and scheduler tests: candidates and requests."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

from domain.datastore.endpoint import Endpoint, EndpointMetrics
from domain.datastore.store import Datastore
from domain.plugins.handle import Handle
from domain.plugins.state import RequestStates
from domain.requesthandling.jsoncodec import StdlibJsonCodec
from domain.requesthandling.openai import OpenAIParser, ParsedRequest
from domain.scheduling.interfaces import CycleState
from domain.scheduling.types import Candidate, InferenceRequest
from ports.endpoints import EndpointAddress, EndpointInfo
from ports.prefix_index import BlockHasher, PrefixIndex

__all__ = ["candidate", "cycle", "endpoint", "inference_request", "plugin_handle"]

CODEC = StdlibJsonCodec()
STATES = RequestStates()


def endpoint(
    name: str,
    ip: str | None = None,
    port: int = 8000,
    labels: Mapping[str, str] | None = None,
    **metrics: Any,
) -> Endpoint:
    """An endpoint named ``name``; keyword arguments are ``EndpointMetrics`` fields.

    Without metric arguments the endpoint has no metrics at all (``metrics is None``).
    """
    address = EndpointAddress(ip=ip or f"10.0.0.{abs(hash(name)) % 250 + 1}", port=port)
    info = EndpointInfo(
        name=name, address=address, pod_name=name, labels=dict(labels or {}), metrics_host=""
    )
    return Endpoint(info=info, metrics=EndpointMetrics(**metrics) if metrics else None)


def candidate(name: str, **kwargs: Any) -> Candidate:
    return Candidate(endpoint(name, **kwargs))


def inference_request(
    body: Mapping[str, Any] | None = None,
    *,
    path: str = "/v1/completions",
    headers: Mapping[str, str] | None = None,
    priority: int = 0,
    request_id: str = "req-1",
) -> InferenceRequest:
    """A request whose body is parsed with the OpenAI parser (``None``: no body)."""
    all_headers = {":path": path, "x-request-id": request_id, **(headers or {})}
    parsed: ParsedRequest | None = None
    raw = b""
    if body is not None:
        raw = CODEC.dumps(dict(body))
        parsed = OpenAIParser(CODEC).parse(raw, all_headers)
    model = parsed.model if parsed else ""
    return InferenceRequest(
        request_id=request_id,
        target_model=model,
        incoming_model=model,
        body=parsed,
        headers=all_headers,
        priority=priority,
        request_size_bytes=len(raw),
        state=STATES.create(request_id),
    )


def cycle(request: InferenceRequest, profile: str = "default") -> CycleState:
    return CycleState(profile=profile, state=request.state)


class _NoHasher:
    """Stands in for a ``BlockHasher`` in tests that do not hash."""

    def chain(self, data: bytes, block_size: int, seed: bytes, max_blocks: int) -> list[int]:
        raise NotImplementedError("pass a hasher to plugin_handle()")


class _NoPrefixIndex:
    """Stands in for a ``PrefixIndex`` in tests that do not use one."""

    async def match(self, hashes: Sequence[int]) -> Mapping[str, int]:
        raise NotImplementedError("pass a prefix_index to plugin_handle()")

    async def add(self, hashes: Sequence[int], endpoint: str, capacity: int) -> None:
        raise NotImplementedError("pass a prefix_index to plugin_handle()")

    async def remove_endpoint(self, endpoint: str) -> None:
        raise NotImplementedError("pass a prefix_index to plugin_handle()")

    def size(self) -> int:
        return -1


def plugin_handle(
    seed: int = 0,
    *,
    hasher: BlockHasher | None = None,
    prefix_index: PrefixIndex | None = None,
    datastore: Datastore | None = None,
) -> Handle:
    """A plugin ``Handle`` with the stdlib codec and ``random.Random(seed)``.

    Without ``hasher`` / ``prefix_index`` those services raise when used.
    """
    return Handle(
        codec=CODEC,
        hasher=hasher or _NoHasher(),
        prefix_index=prefix_index or _NoPrefixIndex(),
        datastore=datastore or Datastore(),
        rng=random.Random(seed),
    )
