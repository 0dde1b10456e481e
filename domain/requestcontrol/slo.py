"""A request's latency SLOs, from its headers.

``x-llm-d-slo-ttft-ms`` and ``x-llm-d-slo-tpot-ms`` (the llm-d router's names), or their
older spellings ``x-slo-ttft-ms`` and ``x-slo-tpot-ms`` (the current name wins when both
are sent): the time to first token and the time per output token the client wants, in
milliseconds. The rule for a value: a decimal number (digits, optionally a point and more
digits: ``250``, ``12.5``) greater than 0 and at most one hour (3,600,000). Anything else
(empty, negative, zero, NaN, infinite, an exponent, text, 10^12) is refused with a 400
naming the header, by the plugins that read SLOs (``predicted-latency-producer``,
``latency-slo-admitter``); an absent header means no SLO on that dimension.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from domain.errors import BadRequestError

__all__ = [
    "MAX_SLO_MS",
    "NO_SLO",
    "TPOT_SLO_HEADERS",
    "TTFT_SLO_HEADERS",
    "RequestSlo",
    "request_slo",
]

TTFT_SLO_HEADERS = ("x-llm-d-slo-ttft-ms", "x-slo-ttft-ms")
TPOT_SLO_HEADERS = ("x-llm-d-slo-tpot-ms", "x-slo-tpot-ms")
#: The largest SLO accepted: one hour, in milliseconds.
MAX_SLO_MS = 3_600_000.0
_DECIMAL = re.compile(r"[0-9]{1,10}(?:\.[0-9]{1,6})?")


@dataclass(frozen=True, slots=True)
class RequestSlo:
    """The request's SLOs in milliseconds; 0 means none on that dimension."""

    ttft_ms: float = 0.0
    tpot_ms: float = 0.0

    @property
    def any(self) -> bool:
        return self.ttft_ms > 0.0 or self.tpot_ms > 0.0


NO_SLO = RequestSlo()


def request_slo(headers: Mapping[str, str]) -> RequestSlo:
    """The SLOs ``headers`` (lower-case names) carry; raises ``BadRequestError`` naming the
    header when a value breaks the rule of the module docstring."""
    ttft = _value(headers, TTFT_SLO_HEADERS)
    tpot = _value(headers, TPOT_SLO_HEADERS)
    if ttft == 0.0 and tpot == 0.0:
        return NO_SLO
    return RequestSlo(ttft, tpot)


def _value(headers: Mapping[str, str], names: tuple[str, ...]) -> float:
    for name in names:
        raw = headers.get(name)
        if raw is None:
            continue
        text = raw.strip()
        value = float(text) if _DECIMAL.fullmatch(text) else -1.0
        if not 0.0 < value <= MAX_SLO_MS:
            shown = text if len(text) <= 32 else text[:32] + "..."
            raise BadRequestError(
                f"{name}: must be a number of milliseconds greater than 0 and at most "
                f"{MAX_SLO_MS:.0f}, got {shown!r}"
            )
        return value
    return 0.0
