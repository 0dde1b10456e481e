"""Go-style durations (``50ms``, ``2s``, ``1m30s``, ``1.5h``) as seconds."""

from __future__ import annotations

import re

__all__ = ["parse_duration"]

_UNITS = {
    "ns": 1e-9,
    "us": 1e-6,
    "µs": 1e-6,
    "μs": 1e-6,
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
}
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")


def parse_duration(text: str) -> float:
    """Seconds in a Go duration string. Raises ``ValueError`` with the reason.

    As Go's ``time.ParseDuration``: an optional sign, then one or more
    number-unit pairs; a bare ``0`` is allowed; negative durations are refused here.
    """
    value = text.strip()
    if value in ("0", "+0", "-0"):
        return 0.0
    if value.startswith("-"):
        raise ValueError(f"{text!r}: durations cannot be negative")
    value = value.removeprefix("+")
    if not value:
        raise ValueError("empty duration")
    total = 0.0
    position = 0
    for match in _PART.finditer(value):
        if match.start() != position:
            break
        total += float(match.group(1)) * _UNITS[match.group(2)]
        position = match.end()
    if position != len(value):
        raise ValueError(f"{text!r} is not a duration such as 50ms, 2s or 1m30s")
    return total
