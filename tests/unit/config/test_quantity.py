"""Kubernetes quantities as the config accepts them."""

from __future__ import annotations

from fractions import Fraction

import pytest

from app.config.quantity import parse_quantity, quantity_value


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("10Gi", 10 * 1024**3),
        ("1Ki", 1024),
        ("1.5Gi", 1610612736),
        ("3Mi", 3 * 1024**2),
        ("2Ti", 2 * 1024**4),
        ("1Pi", 1024**5),
        ("1Ei", 1024**6),
        ("500M", 500_000_000),
        ("1k", 1000),
        ("2G", 2 * 10**9),
        ("1T", 10**12),
        ("1P", 10**15),
        ("1E", 10**18),
        ("1e3", 1000),
        ("1E3", 1000),
        ("12e0", 12),
        ("5000", 5000),
        ("+7", 7),
        (" 42 ", 42),
        ("0", 0),
        ("1000m", 1),
        ("2000000u", 2),
        ("0.5k", 500),
        (".5k", 500),
        ("1.k", 1000),
        (5000, 5000),
        (0, 0),
        (1024.0, 1024),
    ],
)
def test_whole_quantities(text: object, expected: int) -> None:
    assert parse_quantity(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [("100m", Fraction(1, 10)), ("1n", Fraction(1, 10**9)), ("-2k", Fraction(-2000))],
)
def test_exact_values_may_be_fractional_or_negative(text: str, expected: Fraction) -> None:
    assert quantity_value(text) == expected


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("100m", "not a whole number"),
        ("1.5", "not a whole number"),
        ("1e-3", "not a whole number"),
        (0.5, "not a whole number"),
        ("-1", "must not be negative"),
        ("-1Gi", "must not be negative"),
        ("10GB", "unknown quantity suffix 'GB'"),
        ("10gi", "unknown quantity suffix 'gi'"),
        ("Gi", "not a quantity"),
        ("", "not a quantity"),
        ("1 Gi", "not a quantity"),
        ("1e400", "exponent out of range"),
        (True, "not a quantity"),
        (None, "not a quantity"),
        ([1], "not a quantity"),
        (float("inf"), "not a finite quantity"),
    ],
)
def test_rejected_quantities(value: object, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        parse_quantity(value)


def test_negative_allowed_when_asked() -> None:
    assert parse_quantity("-2k", allow_negative=True) == -2000
