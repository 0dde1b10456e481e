"""A hostile or careless config file, at start-up and under ``--watch-config-file``.

Before: a 10 KB file of 5,000 nested YAML lists raised a ``RecursionError`` that nothing
caught: at start-up a traceback and exit 1, and written over a watched file, the watcher
task died and took the process down with it (exit 1; with a ConfigMap every replica at
once). An emptied file was silently reloaded as the built-in default config, and a large
file was parsed on the event loop. Now the text has a depth and a size limit, checked
before anything is built, a reload keeps the running config on any exception (one log
line), an empty file is refused, and the YAML is parsed in a worker thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import pytest

from app.config.decoding import MAX_CONFIG_BYTES, MAX_CONFIG_DEPTH
from app.config_watch import ConfigWatcher
from app.container import Container, build_container
from app.runner import serve
from app.settings import Settings
from domain.plugins.base import Plugin
from domain.plugins.handle import Handle
from tests.support.extproc import completion, response_body, response_headers, set_headers
from tests.support.kube_api import wait_until
from tests.support.stack import wait_for

from .test_extproc_protocol import EnvoyStream
from .test_process import Epp

NESTED = "plugins: " + "[" * 5000 + "]" * 5000 + "\n"  # 10 KB


def _config(profile: str, scorer: str = "queue-scorer") -> str:
    return f"""
plugins:
- type: {scorer}
- type: max-score-picker
schedulingProfiles:
- name: {profile}
  plugins:
  - pluginRef: {scorer}
  - pluginRef: max-score-picker
"""


def _write(path: Path, text: str) -> None:
    path.write_text(text)


class _Epp(Epp):
    """The ``epp`` process on loopback with ``--config-file``."""

    def __init__(self, tmp_path: Path, config: Path, *extra: str) -> None:
        super().__init__(tmp_path, "--config-file", str(config), *extra)

    def lines(self, text: str) -> list[str]:
        return [line for line in self.child.log().splitlines() if text in line]


@pytest.fixture
def config_path(tmp_path: Path) -> Path:
    return tmp_path / "config.yaml"


def test_a_deeply_nested_config_stops_start_up_with_one_line(
    tmp_path: Path, config_path: Path
) -> None:
    config_path.write_text(NESTED)
    epp = _Epp(tmp_path, config_path)
    epp.child.start()
    try:
        assert epp.child.wait(30) == 1
    finally:
        epp.child.stop()
    log = epp.child.log()
    assert "Traceback" not in log, log[-2000:]
    errors = epp.lines("invalid configuration")
    assert len(errors) == 1, log[-2000:]
    assert f"nested deeper than {MAX_CONFIG_DEPTH} levels" in errors[0]
    assert "line 1" in errors[0]


def test_an_oversized_config_stops_start_up_naming_the_limit(
    tmp_path: Path, config_path: Path
) -> None:
    config_path.write_text(_config("alpha") + "#" * MAX_CONFIG_BYTES + "\n")
    epp = _Epp(tmp_path, config_path)
    epp.child.start()
    try:
        assert epp.child.wait(30) == 1
    finally:
        epp.child.stop()
    errors = epp.lines("invalid configuration")
    assert len(errors) == 1, epp.child.log()[-2000:]
    assert f"more than the {MAX_CONFIG_BYTES} bytes" in errors[0]


async def _decision(port: int) -> str:
    """One whole request through the EPP; the x-epp-decision header it answered."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stream = EnvoyStream(channel)
        await stream.route(completion())
        await stream.send(response_headers([(":status", "200"), ("content-type", "text/plain")]))
        reply = await stream.read()
        await stream.send(response_body(b"ok", end_of_stream=True))
        await stream.read()
        await stream.finish()
    return dict(set_headers(reply.response_headers.response))["x-epp-decision"]


async def test_a_watched_file_rewritten_nested_or_empty_keeps_the_process_and_its_config(
    tmp_path: Path, config_path: Path
) -> None:
    _write(config_path, _config("alpha"))
    epp = _Epp(tmp_path, config_path, "--watch-config-file", "--explain-decisions")
    epp.child.start()
    try:
        await asyncio.to_thread(wait_for, epp.serving, timeout=30, what="SERVING")
        assert (await _decision(epp.grpc_port)).startswith("alpha:")

        _write(config_path, NESTED)  # rewritten in place, as an editor or a script does
        await asyncio.to_thread(
            wait_for, lambda: epp.lines("not reloaded"), timeout=15, what="the refusal"
        )
        epp.child.check_alive()
        assert (await _decision(epp.grpc_port)).startswith("alpha:")

        _write(config_path, "")
        await asyncio.to_thread(
            wait_for, lambda: len(epp.lines("not reloaded")) == 2, timeout=15, what="refusal 2"
        )
        assert (await _decision(epp.grpc_port)).startswith("alpha:")

        _write(config_path, _config("beta"))
        await asyncio.to_thread(
            wait_for, lambda: epp.lines("reloaded: profiles beta"), timeout=15, what="reload"
        )
        epp.child.check_alive()
        assert (await _decision(epp.grpc_port)).startswith("beta:")
    finally:
        epp.child.stop()
    log = epp.child.log()
    assert "Traceback" not in log, log[-3000:]
    nested, empty = epp.lines("not reloaded")
    assert f"nested deeper than {MAX_CONFIG_DEPTH} levels" in nested
    assert "empty" in empty


# --- in process: the watcher against any exception, and the event loop while it parses ---


class _Exploding:
    """A plugin type whose factory fails with something no config error class covers."""

    def __call__(self, name: str, parameters: object, handle: Handle) -> Plugin:
        raise RuntimeError("the factory broke")


def _settings(path: Path) -> Settings:
    return Settings(
        static_endpoints="127.0.0.250:9,127.0.0.251:9",
        metrics_endpoint_auth=False,
        bind_address="127.0.0.1",
        grpc_port=0,
        grpc_health_port=0,
        metrics_port=0,
        secure_serving=False,
        config_file=path,
        watch_config_file=True,
        tracing=False,
    )


@contextlib.asynccontextmanager
async def _running(container: Container) -> AsyncIterator[ConfigWatcher]:
    stop = asyncio.Event()
    task = asyncio.create_task(serve(container, stop))
    try:
        watcher = container.config_watcher()
        assert watcher is not None
        servers = container.servers()
        await wait_until(lambda: servers.bound_grpc_port > 0, what="the EPP to serve")
        yield watcher
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


def _profiles(watcher: ConfigWatcher) -> list[str]:
    return list(watcher.running.profiles)


async def _until(condition: Callable[[], object], what: str, within: float = 15.0) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def test_any_exception_while_building_keeps_the_running_config(
    config_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _write(config_path, _config("alpha"))
    container = build_container(_settings(config_path))
    container.registry().register("exploding-scorer", _Exploding())
    caplog.set_level(logging.INFO, logger="app.config_watch")
    async with _running(container) as watcher:
        _write(config_path, _config("beta", "exploding-scorer"))
        await _until(lambda: watcher.refusals == 1, "the refusal")
        assert _profiles(watcher) == ["alpha"]
        _write(config_path, _config("gamma"))  # the watcher is still watching
        await _until(lambda: watcher.reloads == 1, "the next reload")
        assert _profiles(watcher) == ["gamma"]
    refused = [r for r in caplog.records if "not reloaded" in r.getMessage()]
    assert len(refused) == 1
    assert "RuntimeError: the factory broke" in refused[0].getMessage()
    assert refused[0].exc_info is None  # one line, no traceback
    assert "\n" not in refused[0].getMessage()


async def test_a_large_config_is_parsed_while_the_event_loop_goes_on(config_path: Path) -> None:
    """A config near the size limit, mostly comments: PyYAML takes a second or more to scan
    it. The loop's longest stall while it is reloaded is a small part of that."""
    _write(config_path, _config("alpha"))
    container = build_container(_settings(config_path))
    async with _running(container) as watcher:
        gaps: list[float] = []
        done = asyncio.Event()

        async def heartbeat() -> None:
            last = time.monotonic()
            while not done.is_set():
                await asyncio.sleep(0.005)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        beat = asyncio.create_task(heartbeat())
        padding = "# padding\n" * ((MAX_CONFIG_BYTES - 1024) // 10)
        started = time.monotonic()
        _write(config_path, _config("big") + padding)
        await _until(lambda: watcher.reloads == 1, "the large config's reload", within=60)
        took = time.monotonic() - started
        done.set()
        await beat
    assert _profiles(watcher) == ["big"]
    # before: the whole parse in one stall (the longest gap near the reload's duration)
    assert max(gaps) < took / 3, (max(gaps), took)
