"""Logging configured once for the process: text or JSON lines on stderr.

Every record logged while a request is served carries that request's id (``REQUEST_ID``,
set by the gateway adapter per stream): ``"request_id"`` in JSON lines, a trailing
``request_id=<id>`` in text lines. A record logged with ``extra={"fields": {...}}`` has those
fields as JSON values of their own in JSON lines (a ``"msg"`` among them replaces the
message there); text lines show only the message. Under ``--workers`` every line names its
process: ``"worker": "<id>"`` (``"supervisor"`` for the supervisor) in JSON lines, a trailing
``worker=<id>`` in text lines.
"""

from __future__ import annotations

import logging
import sys
import time

import orjson

from ports.observer import REQUEST_ID

__all__ = ["RequestIdFilter", "configure_logging"]


class RequestIdFilter(logging.Filter):
    """Sets ``record.request_id`` from ``REQUEST_ID`` unless the caller passed one, and
    ``record.worker`` to the process's worker tag (empty when it serves alone)."""

    def __init__(self, worker: str = "") -> None:
        super().__init__()
        self._worker = worker

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "request_id", None):
            record.request_id = REQUEST_ID.get()
        record.worker = self._worker
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None)
        if request_id:
            entry["request_id"] = request_id
        worker = getattr(record, "worker", "")
        if worker:
            entry["worker"] = worker
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):  # structured data a record carries (e.g. a span)
            for key, value in fields.items():
                if key == "msg" or key not in entry:  # a shorter message may replace msg
                    entry[key] = value
        if record.exc_info:
            entry["error"] = self.formatException(record.exc_info)
        return orjson.dumps(entry, default=str).decode()


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging's name
        text = super().formatMessage(record)
        request_id = getattr(record, "request_id", None)
        if request_id:
            text += f" request_id={request_id}"
        worker = getattr(record, "worker", "")
        if worker:
            text += f" worker={worker}"
        return text


def configure_logging(verbosity: int, log_format: str, worker: str = "") -> None:
    """Verbosity 0-2 logs at INFO, 3 and above at DEBUG (as the reference's levels);
    ``worker`` tags every line (``--workers``)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RequestIdFilter(worker))
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbosity >= 3 else logging.INFO)
    logging.getLogger("asyncio").setLevel(logging.WARNING)
