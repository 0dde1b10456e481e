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
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import orjson

from ports.observer import REQUEST_ID

if TYPE_CHECKING:
    from app.settings import Settings

__all__ = ["LogOptions", "RequestIdFilter", "configure_logging"]

#: zap's level names as logging levels (the reference's ``--zap-log-level`` and
#: ``--zap-stacktrace-level``); dpanic, panic and fatal all log at CRITICAL here.
_ZAP_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warn": logging.WARNING,
    "error": logging.ERROR,
    "dpanic": logging.CRITICAL,
    "panic": logging.CRITICAL,
    "fatal": logging.CRITICAL,
}


def _verbosity_level(verbosity: int) -> int:
    """The reference's verbosity: 0-2 log at INFO, 3 and above at DEBUG."""
    return logging.DEBUG if verbosity >= 3 else logging.INFO


@dataclass(frozen=True, slots=True, kw_only=True)
class LogOptions:
    """How the process logs: the lowest level, the line format, the level from which a
    record carries the stack that logged it (``None``: never), and the time encoding."""

    level: int = logging.INFO
    format: Literal["text", "json"] = "text"
    stacktrace_level: int | None = None
    time_encoding: str = "iso8601"

    @classmethod
    def from_settings(cls, settings: Settings) -> LogOptions:
        """``-v``, ``--log-format`` and the zap flags: ``--zap-log-level`` wins over ``-v``
        (an integer there is a verbosity); ``--zap-devel`` puts stack traces on records from
        WARNING up unless ``--zap-stacktrace-level`` says otherwise."""
        level = _verbosity_level(settings.verbosity)
        zap_level = settings.zap_log_level
        if zap_level is not None:
            level = (
                _verbosity_level(int(zap_level)) if zap_level.isdigit() else _ZAP_LEVELS[zap_level]
            )
        stacktrace: int | None = logging.WARNING if settings.zap_devel else None
        if settings.zap_stacktrace_level is not None:
            stacktrace = _ZAP_LEVELS[settings.zap_stacktrace_level]
        return cls(
            level=level,
            format=settings.log_format,
            stacktrace_level=stacktrace,
            time_encoding=settings.zap_time_encoding or "iso8601",
        )


def _encode_time(created: float, encoding: str) -> str | float | int:
    """A record's time (``created``, seconds since the epoch) as zap's time encoders do."""
    if encoding == "epoch":
        return created
    if encoding == "millis":
        return created * 1e3
    if encoding == "nano":  # whole seconds apart: a float of 1e18 has 256 ns steps
        return int(created) * 1_000_000_000 + round(created % 1 * 1e9)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created))
    fraction = created % 1
    if encoding == "rfc3339":
        return stamp + "Z"
    if encoding == "rfc3339nano":
        return stamp + f".{int(fraction * 1e9):09d}".rstrip("0").rstrip(".") + "Z"
    return stamp + f".{int(fraction * 1e3):03d}Z"  # iso8601, milliseconds


def _stack(record: logging.LogRecord, stacktrace_level: int | None) -> str | None:
    """The stack that logged ``record`` when its level asks for one (and it has none)."""
    if record.stack_info:
        return record.stack_info
    if stacktrace_level is None or record.levelno < stacktrace_level or record.exc_info:
        return None
    frames = traceback.extract_stack()
    # drop the frames of logging and of this module at the top of the stack
    while frames and frames[-1].filename in (logging.__file__, __file__):
        frames.pop()
    return "".join(traceback.format_list(frames)).rstrip()


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
    def __init__(self, options: LogOptions | None = None) -> None:
        super().__init__()
        self._options = options or LogOptions()

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": _encode_time(record.created, self._options.time_encoding),
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
        stack = _stack(record, self._options.stacktrace_level)
        if stack:
            entry["stacktrace"] = stack
        return orjson.dumps(entry, default=str).decode()


class TextFormatter(logging.Formatter):
    def __init__(self, options: LogOptions | None = None) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")
        self._options = options or LogOptions()

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802 - logging's name
        if self._options.time_encoding == "iso8601":
            return super().formatTime(record, datefmt)  # local time, as before
        return str(_encode_time(record.created, self._options.time_encoding))

    def formatStack(self, stack_info: str) -> str:  # noqa: N802 - logging's name
        return stack_info

    def format(self, record: logging.LogRecord) -> str:
        stack = _stack(record, self._options.stacktrace_level)
        if stack and not record.stack_info:
            record.stack_info = stack
        return super().format(record)

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging's name
        text = super().formatMessage(record)
        request_id = getattr(record, "request_id", None)
        if request_id:
            text += f" request_id={request_id}"
        worker = getattr(record, "worker", "")
        if worker:
            text += f" worker={worker}"
        return text


def configure_logging(options: LogOptions, worker: str = "") -> None:
    """Logging as ``options`` say; ``worker`` tags every line (``--workers``)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RequestIdFilter(worker))
    if options.format == "json":
        handler.setFormatter(JsonFormatter(options))
    else:
        handler.setFormatter(TextFormatter(options))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(options.level)
    logging.getLogger("asyncio").setLevel(logging.WARNING)
