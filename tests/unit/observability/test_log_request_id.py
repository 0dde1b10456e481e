"""Every log record written while a request is served names the request."""

from __future__ import annotations

import contextvars
import json
import logging
from collections.abc import Iterator

import pytest

from app.logsetup import LogOptions, configure_logging
from ports.observer import REQUEST_ID


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def _in_request(request_id: str, message: str) -> None:
    def log() -> None:
        REQUEST_ID.set(request_id)
        logging.getLogger("domain.requestcontrol.director").debug(message)

    contextvars.copy_context().run(log)


def test_json_lines_carry_the_request_id(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging(LogOptions(level=logging.DEBUG, format="json"))
    _in_request("req-42", "routed")
    logging.getLogger("app.runner").info("not a request")
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert [(line["msg"], line.get("request_id")) for line in lines] == [
        ("routed", "req-42"),
        ("not a request", None),
    ]


def test_text_lines_end_with_the_request_id(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging(LogOptions(level=logging.DEBUG, format="text"))
    _in_request("req-7", "routed")
    logging.getLogger("app.runner").info("not a request")
    first, second = capsys.readouterr().err.splitlines()
    assert first.endswith("domain.requestcontrol.director: routed request_id=req-7")
    assert second.endswith("app.runner: not a request")


def test_an_explicit_request_id_wins(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging(LogOptions(format="json"))
    REQUEST_ID.set("from-context")
    try:
        logging.getLogger("x").info("hello", extra={"request_id": "explicit"})
    finally:
        REQUEST_ID.set("")
    (line,) = capsys.readouterr().err.splitlines()
    assert json.loads(line)["request_id"] == "explicit"
