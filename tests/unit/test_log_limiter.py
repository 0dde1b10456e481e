"""LogLimiter: the first lines of each kind in a window are written, the rest counted and
reported on the next line of that kind."""

from __future__ import annotations

import logging

import pytest

from adapters.envoy.loglimit import LogLimiter


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def logger(caplog: pytest.LogCaptureFixture) -> logging.Logger:
    caplog.set_level(logging.INFO, logger="test.loglimit")
    return logging.getLogger("test.loglimit")


def test_a_flood_writes_the_burst_then_reports_what_it_left_out(
    logger: logging.Logger, caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock()
    limiter = LogLimiter(logger, burst=3, interval=1.0, clock=clock)
    for n in range(500):
        limiter.info("stream %d refused: %s", n, "one request per stream")
    assert caplog.messages == [f"stream {n} refused: one request per stream" for n in range(3)]
    caplog.clear()
    clock.now += 1.0
    limiter.info("stream %d refused: %s", 500, "one request per stream")
    limiter.info("stream %d refused: %s", 501, "one request per stream")
    assert caplog.messages == [
        "stream 500 refused: one request per stream (497 more like this left out before it)",
        "stream 501 refused: one request per stream",
    ]


def test_kinds_are_limited_apart(logger: logging.Logger, caplog: pytest.LogCaptureFixture) -> None:
    limiter = LogLimiter(logger, burst=1, interval=1.0, clock=Clock())
    for _ in range(10):
        limiter.info("closed idle after %gs", 30.0)
        limiter.info("refused: %s", "out of order")
    assert caplog.messages == ["closed idle after 30s", "refused: out of order"]


def test_nothing_is_counted_when_info_is_off(
    logger: logging.Logger, caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock()
    limiter = LogLimiter(logger, burst=1, interval=1.0, clock=clock)
    logger.setLevel(logging.WARNING)
    try:
        for _ in range(5):
            limiter.info("refused: %s", "x")
    finally:
        logger.setLevel(logging.INFO)
    limiter.info("refused: %s", "y")
    assert caplog.messages == ["refused: y"]


@pytest.mark.parametrize(("burst", "interval"), [(0, 1.0), (1, 0.0)])
def test_a_limit_that_writes_nothing_is_refused(burst: int, interval: float) -> None:
    with pytest.raises(ValueError, match="burst must be at least 1"):
        LogLimiter(logging.getLogger("test.loglimit"), burst=burst, interval=interval)
