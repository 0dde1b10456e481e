"""List+watch of one resource collection in a worker thread, reported to the event loop.

A ``ListWatch`` lists the collection, then watches it from the list's resourceVersion with
bookmarks, restarting the watch when the server ends it (``timeoutSeconds``). It keeps the set
of objects it has reported, so that:

- a relist (after an ERROR event with code 410 Gone, or an HTTP 410 on the watch) reports only
  the differences: objects that vanished in the gap are reported deleted, changed ones updated,
  unchanged ones not at all;
- a failed or dropped watch is resumed from the last resourceVersion seen (events or
  bookmarks), after an exponential backoff, without reporting anything as gone.

Events reach the owner on the event loop thread, in order, through ``loop.call_soon_threadsafe``;
none is delivered once ``stop()`` has returned. ``stop()`` interrupts a blocked read at once
(the response socket is shut down), so the thread ends promptly.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import logging
import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import urllib3
from kubernetes.client.exceptions import ApiException

from adapters.kubernetes.api import KubeObject, ResourceApi

__all__ = ["ListWatch", "WatchEvent", "WatchEventKind", "WatchOptions", "stop_all"]

_LOG = logging.getLogger(__name__)

#: A clean end of a watch sooner than this, with nothing received, counts as a failure; so does
#: an expiry this soon after a list (both then back off instead of retrying at once).
_MIN_WATCH_SECONDS = 1.0
#: Added to the watch's timeoutSeconds for the socket read timeout (a dead peer is noticed).
_READ_TIMEOUT_MARGIN = 30.0


class WatchEventKind(enum.Enum):
    UPSERT = "upsert"
    """The object was added or changed (or first seen in a list)."""
    DELETE = "delete"
    """The object is gone (deleted, no longer selected, or missing from a relist)."""
    SYNCED = "synced"
    """A list has been reported completely (after the first list and every relist)."""
    ABSENT = "absent"
    """The API server does not serve the resource; the watch has ended."""


@dataclass(frozen=True, slots=True, kw_only=True)
class WatchEvent:
    kind: WatchEventKind
    object: KubeObject | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class WatchOptions:
    """Timing of a ``ListWatch``; all in seconds.

    ``watch_timeout`` is the server-side duration of one watch request (sent as
    ``timeoutSeconds``, randomly stretched up to 1.5x so that watches do not restart together).
    ``require_discovery`` first asks the discovery API whether the resource is served; if not,
    the ``ListWatch`` reports ``ABSENT`` once and ends.
    """

    backoff_initial: float = 0.5
    backoff_max: float = 30.0
    watch_timeout: float = 300.0
    connect_timeout: float = 10.0
    read_timeout: float = 60.0
    require_discovery: bool = False

    def __post_init__(self) -> None:
        if not 0 < self.backoff_initial <= self.backoff_max:
            raise ValueError("resync backoff: need 0 < initial <= max")
        if self.watch_timeout < 1:
            raise ValueError("watch timeout: must be >= 1s")


class _ExpiredError(Exception):
    """The resourceVersion is too old (410 Gone): relist."""


class _StoppedError(Exception):
    """``stop()`` was called."""


class _Backoff:
    def __init__(self, initial: float, maximum: float) -> None:
        self._initial = initial
        self._maximum = maximum
        self._next = initial

    def reset(self) -> None:
        self._next = self._initial

    def next(self) -> float:
        delay = self._next
        self._next = min(self._next * 2, self._maximum)
        return delay


class ListWatch:
    """Lists and watches one collection in a daemon thread; see the module docstring.

    Create, ``start()`` and ``stop()`` it on the event loop thread. ``on_event`` is called on
    that loop. ``finished`` resolves when the thread has ended.
    """

    def __init__(
        self,
        api: ResourceApi,
        on_event: Callable[[WatchEvent], None],
        *,
        loop: asyncio.AbstractEventLoop,
        options: WatchOptions,
    ) -> None:
        self._api = api
        self._on_event = on_event
        self._loop = loop
        self._options = options
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._response: urllib3.BaseHTTPResponse | None = None
        self._known: dict[str, KubeObject] = {}
        self._resource_version = ""
        self._listed_at = -_MIN_WATCH_SECONDS
        self.finished: asyncio.Future[None] = loop.create_future()
        self._thread = threading.Thread(
            target=self._main, name=f"kube-watch-{api.resource.plural}", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Ends the watch: no event is delivered after this returns; the thread ends soon."""
        self._stop.set()
        with self._lock:
            response = self._response
        if response is not None:
            _interrupt(response)

    # -- event loop side ------------------------------------------------------------------

    def _deliver(self, events: list[WatchEvent]) -> None:
        for event in events:
            if self._stop.is_set():
                return
            self._on_event(event)

    def _finish(self) -> None:
        if not self.finished.done():
            self.finished.set_result(None)

    # -- worker thread side ----------------------------------------------------------------

    def _post(self, *events: WatchEvent) -> None:
        try:
            self._loop.call_soon_threadsafe(self._deliver, list(events))
        except RuntimeError:  # the loop is closed: nobody listens any more
            self._stop.set()

    def _main(self) -> None:
        try:
            self._run()
        except _StoppedError:
            pass
        except Exception:  # a bug: say so rather than die silently
            _LOG.exception("watch of %s failed", self._api.describe())
        finally:
            with contextlib.suppress(RuntimeError):  # the loop is closed
                self._loop.call_soon_threadsafe(self._finish)

    def _run(self) -> None:
        options = self._options
        backoff = _Backoff(options.backoff_initial, options.backoff_max)
        if options.require_discovery and not self._discover(backoff):
            return
        while not self._stop.is_set():
            try:
                if not self._resource_version:
                    self._list()
                    backoff.reset()
                if self._watch():
                    backoff.reset()
            except _StoppedError:
                return
            except _ExpiredError:
                _LOG.info(
                    "watch of %s: resourceVersion %s expired; relisting",
                    self._api.describe(),
                    self._resource_version,
                )
                self._resource_version = ""
                # Expired right after a list: back off rather than hammer the server with lists.
                recent = time.monotonic() - self._listed_at < _MIN_WATCH_SECONDS
                if recent and self._stop.wait(backoff.next()):
                    return
            except Exception as error:
                if self._stop.is_set():
                    return
                delay = backoff.next()
                _LOG.warning(
                    "watch of %s interrupted (%s); retrying in %.1fs, keeping the known state",
                    self._api.describe(),
                    _describe_error(error),
                    delay,
                )
                if self._stop.wait(delay):
                    return

    def _discover(self, backoff: _Backoff) -> bool:
        while not self._stop.is_set():
            try:
                served = self._api.served(request_timeout=self._request_timeout())
            except Exception as error:
                delay = backoff.next()
                _LOG.warning(
                    "discovery of %s failed (%s); retrying in %.1fs",
                    self._api.resource,
                    _describe_error(error),
                    delay,
                )
                if self._stop.wait(delay):
                    return False
                continue
            backoff.reset()
            if not served:
                self._post(WatchEvent(kind=WatchEventKind.ABSENT))
            return served
        return False

    def _request_timeout(self, read: float | None = None) -> tuple[float, float]:
        return (self._options.connect_timeout, read or self._options.read_timeout)

    def _open(self, call: Callable[[], urllib3.BaseHTTPResponse]) -> urllib3.BaseHTTPResponse:
        response = call()
        with self._lock:
            if self._stop.is_set():
                response.close()
                raise _StoppedError
            self._response = response
        return response

    def _close(self, response: urllib3.BaseHTTPResponse, *, reuse: bool) -> None:
        with self._lock:
            self._response = None
        if reuse:
            response.release_conn()
        else:
            response.close()

    def _list(self) -> None:
        response = self._open(lambda: self._api.list(request_timeout=self._request_timeout()))
        reuse = False
        try:
            body = response.data
            reuse = True
        finally:
            self._close(response, reuse=reuse)
        if self._stop.is_set():
            raise _StoppedError
        document = json.loads(body)
        items = document.get("items") or []
        listed: dict[str, KubeObject] = {}
        for item in items:
            name = _name(item)
            if name:
                listed[name] = item
        events: list[WatchEvent] = [
            WatchEvent(kind=WatchEventKind.DELETE, object=gone)
            for name, gone in self._known.items()
            if name not in listed
        ]
        events.extend(
            WatchEvent(kind=WatchEventKind.UPSERT, object=item)
            for name, item in listed.items()
            if _version(self._known.get(name)) != _version(item) or not _version(item)
        )
        events.append(WatchEvent(kind=WatchEventKind.SYNCED))
        self._known = listed
        self._listed_at = time.monotonic()
        self._resource_version = str(document.get("metadata", {}).get("resourceVersion") or "")
        if not self._resource_version:
            raise ValueError("the list has no resourceVersion")
        _LOG.debug(
            "listed %s: %d objects at resourceVersion %s",
            self._api.describe(),
            len(listed),
            self._resource_version,
        )
        self._post(*events)

    def _watch(self) -> bool:
        """One watch request; returns whether anything arrived. Raises on failures."""
        timeout_seconds = max(1, round(self._options.watch_timeout * random.uniform(1.0, 1.5)))
        started = time.monotonic()
        try:
            response = self._open(
                lambda: self._api.watch(
                    resource_version=self._resource_version,
                    timeout_seconds=timeout_seconds,
                    request_timeout=self._request_timeout(timeout_seconds + _READ_TIMEOUT_MARGIN),
                )
            )
        except ApiException as error:
            if error.status == 410:
                raise _ExpiredError from error
            raise
        received = False
        reuse = False
        try:
            for line in _lines(response):
                if self._stop.is_set():
                    raise _StoppedError
                received = True
                self._handle(line)
            reuse = True
        finally:
            self._close(response, reuse=reuse)
        if self._stop.is_set():
            raise _StoppedError
        if not received and time.monotonic() - started < _MIN_WATCH_SECONDS:
            raise ConnectionError("the watch ended at once")
        return received

    def _handle(self, line: bytes) -> None:
        event = json.loads(line)
        kind = event.get("type")
        obj = event.get("object") or {}
        if kind in ("ADDED", "MODIFIED"):
            name = _name(obj)
            version = _version(obj)
            if name and (_version(self._known.get(name)) != version or not version):
                self._known[name] = obj
                self._post(WatchEvent(kind=WatchEventKind.UPSERT, object=obj))
            self._advance(version)
        elif kind == "DELETED":
            name = _name(obj)
            if self._known.pop(name, None) is not None:
                self._post(WatchEvent(kind=WatchEventKind.DELETE, object=obj))
            self._advance(_version(obj))
        elif kind == "BOOKMARK":
            self._advance(_version(obj))
        elif kind == "ERROR":
            if obj.get("code") == 410:
                raise _ExpiredError
            raise ConnectionError(
                f"watch error {obj.get('code')} {obj.get('reason', '')}: {obj.get('message', '')}"
            )
        else:
            _LOG.debug("watch of %s: ignoring event type %r", self._api.describe(), kind)

    def _advance(self, version: str) -> None:
        if version:
            self._resource_version = version


async def stop_all(watches: Iterable[ListWatch], *, grace: float = 2.0) -> None:
    """Stops the watches and waits (at most ``grace`` seconds) for their threads to end."""
    pending = []
    for watch in watches:
        watch.stop()
        if not watch.finished.done():
            pending.append(watch.finished)
    if pending:
        await asyncio.wait(pending, timeout=grace)


def _lines(response: urllib3.BaseHTTPResponse) -> Iterator[bytes]:
    """The newline-delimited records of a streamed body, as they arrive."""
    buffer = b""
    for chunk in _chunks(response):
        buffer += chunk
        start = 0
        while (end := buffer.find(b"\n", start)) >= 0:
            line = buffer[start:end].strip()
            if line:
                yield line
            start = end + 1
        buffer = buffer[start:]
    if buffer.strip():
        yield buffer.strip()


def _chunks(response: urllib3.BaseHTTPResponse) -> Iterator[bytes]:
    if response.chunked:
        yield from response.stream(amt=65536, decode_content=True)
        return
    while chunk := response.read1(65536):
        yield chunk


def _interrupt(response: urllib3.BaseHTTPResponse) -> None:
    """Makes a read blocked in another thread return now."""
    try:
        response.shutdown()
    except Exception:  # older urllib3, or already released: closing is the fallback
        try:
            response.close()
        except Exception:
            _LOG.debug("could not interrupt a watch response", exc_info=True)


def _name(obj: Any) -> str:
    metadata = obj.get("metadata") if isinstance(obj, dict) else None
    name = metadata.get("name") if isinstance(metadata, dict) else None
    return name if isinstance(name, str) else ""


def _version(obj: Any) -> str:
    metadata = obj.get("metadata") if isinstance(obj, dict) else None
    version = metadata.get("resourceVersion") if isinstance(metadata, dict) else None
    return str(version) if version else ""


def _describe_error(error: Exception) -> str:
    if isinstance(error, ApiException):
        return f"HTTP {error.status} {error.reason}"
    return f"{type(error).__name__}: {error}"
