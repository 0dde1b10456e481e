"""Kubernetes resource quantities (``10Gi``, ``500M``, ``1k``, ``100m``, ``1e3``, ``42``).

A quantity is a decimal number followed by an optional suffix: a binary multiple (``Ki``,
``Mi``, ``Gi``, ``Ti``, ``Pi``, ``Ei``: powers of 1024), a decimal multiple (``n``, ``u``,
``m``, ``k``, ``M``, ``G``, ``T``, ``P``, ``E``: powers of 1000) or a decimal exponent
(``e3``, ``E-2``). Values are computed exactly (``Fraction``), so ``1.5Gi`` is exactly
1,610,612,736 and ``100m`` is exactly 1/10.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

__all__ = ["parse_quantity", "quantity_value"]

_BINARY = {
    "Ki": 1024,
    "Mi": 1024**2,
    "Gi": 1024**3,
    "Ti": 1024**4,
    "Pi": 1024**5,
    "Ei": 1024**6,
}
_DECIMAL = {
    "n": Fraction(1, 10**9),
    "u": Fraction(1, 10**6),
    "m": Fraction(1, 10**3),
    "": Fraction(1),
    "k": Fraction(10**3),
    "M": Fraction(10**6),
    "G": Fraction(10**9),
    "T": Fraction(10**12),
    "P": Fraction(10**15),
    "E": Fraction(10**18),
}
_QUANTITY = re.compile(r"([+-]?)(\d+(?:\.\d*)?|\.\d+)([A-Za-z]*|[eE][+-]?\d+)")
# Exponents beyond this are refused rather than computed (10**10**9 would hang).
_MAX_EXPONENT = 100


def quantity_value(value: object) -> Fraction:
    """The exact value of a quantity given as a string, an int or an integral float.

    Raises ``ValueError`` saying why the value is not a quantity.
    """
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a quantity such as 10Gi, 500M or 1000")
    if isinstance(value, int):
        return Fraction(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{value!r} is not a finite quantity")
        return Fraction(value)
    if not isinstance(value, str):
        raise ValueError(f"{value!r} is not a quantity such as 10Gi, 500M or 1000")
    match = _QUANTITY.fullmatch(value.strip())
    if match is None:
        raise ValueError(f"{value!r} is not a quantity such as 10Gi, 500M or 1000")
    sign, digits, suffix = match.groups()
    number = Fraction(digits if not digits.endswith(".") else digits[:-1])
    if sign == "-":
        number = -number
    if suffix in _BINARY:
        return number * _BINARY[suffix]
    if suffix in _DECIMAL:
        return number * _DECIMAL[suffix]
    if suffix[:1] in ("e", "E") and suffix[1:].lstrip("+-").isdigit():
        exponent = int(suffix[1:])
        if abs(exponent) > _MAX_EXPONENT:
            raise ValueError(f"{value!r}: exponent out of range")
        return number * Fraction(10) ** exponent
    raise ValueError(f"{value!r}: unknown quantity suffix {suffix!r}")


def parse_quantity(value: object, *, allow_negative: bool = False) -> int:
    """A quantity as a whole number (bytes, requests, ...).

    Raises ``ValueError`` for anything that is not a quantity, for a fractional result
    (``100m``, ``1.5``) and, unless ``allow_negative``, for a negative one.
    """
    exact = quantity_value(value)
    if exact.denominator != 1:
        raise ValueError(f"{value!r} is not a whole number")
    if exact < 0 and not allow_negative:
        raise ValueError(f"{value!r}: must not be negative")
    return int(exact)
