"""``latency-slo-admitter``: refuse a sheddable request no endpoint can serve within its
SLOs (the llm-d router's type).

Runs after the data producers, before scheduling, on the candidates' ``LatencyPredictionInfo``
(``predicted-latency-producer``). A request passes when its priority is >= 0, when it has no
SLO header (``x-slo-ttft-ms``, ``x-slo-tpot-ms``; a header breaking ``slo.py``'s rule is a
400 naming it), when no candidate has a prediction, or when some candidate is predicted
within its SLOs, has no running request (its scraped ``running`` 0: idle), or has under 2%
of its KV cache in use (cold: the prediction is not to be trusted). Otherwise the request is
refused with 429 and the reason, as flow control refuses for capacity.

``latencyPredictionInfoProducerName`` is accepted (this EPP has one producer of the key).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from domain.datalayer.attributes import LATENCY_PREDICTION_INFO, LatencyPredictionInfo
from domain.errors import ResourceExhaustedError
from domain.plugins.base import Plugin, PluginRegistry, TypedName
from domain.plugins.handle import Handle
from domain.plugins.hooks import ConsumerPlugin
from domain.requestcontrol.slo import request_slo
from domain.scheduling.types import Candidate, InferenceRequest

__all__ = ["TYPE", "LatencySloAdmitter", "LatencySloAdmitterParameters", "register"]

TYPE = "latency-slo-admitter"
#: Below this KV-cache usage an endpoint is cold: its prediction is not trusted.
COLD_KV_USAGE = 0.02


@dataclass(frozen=True, slots=True, kw_only=True)
class LatencySloAdmitterParameters:
    latency_prediction_info_producer_name: str = ""


class LatencySloAdmitter(ConsumerPlugin):
    """See the module docstring."""

    __slots__ = ("typed_name",)

    def __init__(self, typed_name: TypedName, parameters: LatencySloAdmitterParameters) -> None:
        self.typed_name = typed_name

    def consumes(self) -> Sequence[str]:
        return (LATENCY_PREDICTION_INFO,)

    async def admit_request(
        self, request: InferenceRequest, candidates: Sequence[Candidate]
    ) -> str | None:
        slo = request_slo(request.headers)  # a bad header is a 400 whatever the priority
        if request.priority >= 0 or not slo.any:
            return None
        predicted = False
        best = float("inf")
        for c in candidates:
            metrics = c.metrics
            if metrics is not None and (
                metrics.kv_cache_usage_percent < COLD_KV_USAGE or metrics.running_requests_size == 0
            ):
                return None
            info = c.attributes.get(LATENCY_PREDICTION_INFO)
            if isinstance(info, LatencyPredictionInfo):
                predicted = True
                if info.valid:
                    return None
                best = min(best, info.ttft_ms)
        if not predicted:
            return None
        raise ResourceExhaustedError(
            f"no endpoint is predicted to meet the request's SLO (ttft {slo.ttft_ms:g} ms, "
            f"tpot {slo.tpot_ms:g} ms; best predicted ttft {best:.0f} ms)"
        )


def _factory(name: str, parameters: LatencySloAdmitterParameters, handle: Handle) -> Plugin:
    return LatencySloAdmitter(TypedName(TYPE, name), parameters)


def register(registry: PluginRegistry) -> None:
    registry.register(
        TYPE,
        _factory,
        parameters=LatencySloAdmitterParameters,
        description="refuses sheddable requests no endpoint is predicted to serve within SLO",
    )
