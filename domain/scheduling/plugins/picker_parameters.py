"""The parameters every in-tree picker takes."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PickerParameters"]


@dataclass(frozen=True, slots=True, kw_only=True)
class PickerParameters:
    """``maxNumOfEndpoints``: how many endpoints a picker returns, best first (default 1).

    The first is the target; the rest are fallbacks. Values <= 0 become 1, as in the
    reference.
    """

    max_num_of_endpoints: int = 1

    def __post_init__(self) -> None:
        value = self.max_num_of_endpoints
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"maxNumOfEndpoints: must be an integer, got {value!r}")
        if value <= 0:
            object.__setattr__(self, "max_num_of_endpoints", 1)
