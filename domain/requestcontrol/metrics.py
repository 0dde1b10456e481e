"""The per-request metrics, recorded in one place (entries of ``ports.metric_catalogue``).

A routed request counts in ``REQUEST_TOTAL`` and ``REQUEST_SIZES`` and is running
(``RUNNING_REQUESTS``) until its exchange closes; a refused one counts in
``REQUEST_ERROR_TOTAL`` with its error code, as does a response with a non-2xx status
(``ModelServerError``). A completed response records the duration, response size, token
counts and normalized time per output token; a model rewrite counts in
``MODEL_REWRITE_DECISIONS``.
"""

from __future__ import annotations

from collections.abc import Mapping

from domain.requesthandling.usage import Usage
from ports.errors import ErrorCode
from ports.metric_catalogue import (
    INPUT_TOKENS,
    MODEL_REWRITE_DECISIONS,
    NORMALIZED_TPOT,
    OUTPUT_TOKENS,
    PROMPT_CACHED_TOKENS,
    REQUEST_DURATION,
    REQUEST_ERROR_TOTAL,
    REQUEST_SIZES,
    REQUEST_TOTAL,
    RESPONSE_SIZES,
    RUNNING_REQUESTS,
)
from ports.observer import Observer

__all__ = ["RequestMetrics"]


class RequestMetrics:
    """Records what one request's way through the Director shows in metrics.

    ``labels`` are the request's ``model_name``, ``target_model_name``, ``fairness_id`` and
    ``priority`` (the reference's series show the first two, the llm-d router's all four).
    The running count per label set is kept here: ``routed`` adds the request, ``closed``
    removes it; a label set with nothing running is forgotten (its gauge keeps the 0).
    """

    def __init__(self, observer: Observer) -> None:
        self._observer = observer
        self._running: dict[tuple[str, ...], int] = {}
        self._running_labels: dict[tuple[str, ...], dict[str, str]] = {}

    def running(self, model: str) -> int:
        """Requests for ``model`` routed and not yet closed."""
        return sum(count for key, count in self._running.items() if key[0] == model)

    def rewritten(self, rule: str, model: str, target_model: str) -> None:
        self._observer.counter(
            MODEL_REWRITE_DECISIONS,
            {"model_rewrite_name": rule, "model_name": model, "target_model": target_model},
        )

    def routed(self, labels: Mapping[str, str], size_bytes: int) -> None:
        self._observer.counter(REQUEST_TOTAL, labels)
        self._observer.histogram(REQUEST_SIZES, labels, size_bytes)
        self._add_running(labels, 1)

    def closed(self, labels: Mapping[str, str]) -> None:
        """A routed request's exchange ended."""
        self._add_running(labels, -1)

    def failed(self, labels: Mapping[str, str], code: ErrorCode) -> None:
        self._observer.counter(REQUEST_ERROR_TOTAL, {**labels, "error_code": code.value})

    def completed(
        self,
        labels: Mapping[str, str],
        seconds: float,
        response_bytes: int | None,
        usage: Usage | None,
    ) -> None:
        """``response_bytes`` None: the size is not known (the body did not pass through
        the EPP and the response declared no ``content-length``); not recorded."""
        observer = self._observer
        observer.histogram(REQUEST_DURATION, labels, seconds)
        if response_bytes is not None:
            observer.histogram(RESPONSE_SIZES, labels, response_bytes)
        if usage is None:
            return
        observer.histogram(INPUT_TOKENS, labels, usage.prompt_tokens)
        observer.histogram(OUTPUT_TOKENS, labels, usage.completion_tokens)
        observer.histogram(PROMPT_CACHED_TOKENS, labels, usage.cached_tokens)
        if usage.completion_tokens > 0:
            observer.histogram(NORMALIZED_TPOT, labels, seconds / usage.completion_tokens)

    def _add_running(self, labels: Mapping[str, str], delta: int) -> None:
        key = (
            labels["model_name"],
            labels["target_model_name"],
            labels["fairness_id"],
            labels["priority"],
        )
        count = self._running.get(key, 0) + delta
        running_labels = self._running_labels.get(key)
        if running_labels is None:
            running_labels = self._running_labels[key] = dict(labels)
        if count:
            self._running[key] = count
        else:
            self._running.pop(key, None)
            self._running_labels.pop(key, None)
        self._observer.gauge(RUNNING_REQUESTS, running_labels, count)
