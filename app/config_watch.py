"""``--watch-config-file``: the EndpointPickerConfig reloaded when its file changes.

Every ``interval`` seconds the file is read (through symlinks, so a ConfigMap volume's
``..data`` swap is seen like an edit); when its text differs from the running config's, the
new text is loaded in full (YAML, schema, every plugin built with fresh state) before
anything changes. The YAML and the schema are checked in a worker thread (a large file
does not stall routing), within the size and depth limits of ``app.config.decoding``; the
plugins are built on the event loop. Only a config that loads replaces the running one, in
one assignment on the event loop: requests already routing finish with the plugins they
started with (the Director's exchanges keep their ``RequestControl``), new ones get the
new plugins. A config that does not load, whatever the exception, is logged as one line
with the entry at fault, and the running one stays; so does a file that cannot be read,
and an empty one (or one of only comments): it is refused, not taken as the built-in
default (a ConfigMap emptied by mistake must not silently reset every replica).

What a reload changes: the plugins and their parameters, the scheduling profiles, the
profile handler, the parser, the saturation detector, the data producers, admitters and
request/response hooks. What needs a restart: ``featureGates``, ``flowControl`` and
``dataLayer`` (the flow controller and the collectors are built once); a new config that
changes one of them is refused with a message naming it, and the running config stays.
The replaced plugins stop hearing of endpoint changes (their datastore subscriptions are
dropped) and are left to the garbage collector once their last request ends; those with
background work (``BackgroundPlugin``: the KV-event subscriptions) are stopped, then the
new ones started.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from app.config.decoding import MAX_CONFIG_BYTES
from app.config.loader import (
    ConfigError,
    LoadedConfig,
    ParsedConfig,
    build_config,
    parse_config,
)
from app.config.overrides import ConfigOverrides
from domain.datastore.store import Datastore
from domain.plugins.base import PluginRegistry
from domain.plugins.handle import Handle
from domain.plugins.hooks import BackgroundPlugin
from domain.requestcontrol.director import Director, RequestControl

__all__ = ["RESTART_SECTIONS", "ConfigWatcher"]

logger = logging.getLogger(__name__)

#: Sections a reload cannot apply: changing one needs a restart.
RESTART_SECTIONS = ("featureGates", "flowControl", "dataLayer")


def _sections(document: dict[str, Any] | None) -> dict[str, Any]:
    raw = document or {}
    return {name: raw.get(name) for name in RESTART_SECTIONS}


def _read(path: Path) -> str:
    """The file's text; past ``MAX_CONFIG_BYTES`` only that much and one byte more (the
    parse refuses it), so a huge file is never read whole every interval."""
    with path.open("rb") as file:
        data = file.read(MAX_CONFIG_BYTES + 1)
    return data.decode("utf-8", "surrogateescape")


def _one_line(exc: BaseException) -> str:
    """``exc`` as one log line: its message, prefixed with its type unless it is a config
    error (whose message already names the entry at fault)."""
    text = " ".join(str(exc).split())
    if isinstance(exc, ConfigError):
        return text
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class ConfigWatcher:
    """Watches ``path``; ``build_control`` turns a loaded config into the Director's
    ``RequestControl`` (the same wiring as at start-up)."""

    def __init__(
        self,
        path: Path,
        *,
        running_text: str | None,
        running: LoadedConfig,
        registry: PluginRegistry,
        handle: Handle,
        datastore: Datastore,
        director: Director,
        build_control: Callable[[LoadedConfig], RequestControl],
        interval: float = 1.0,
        overrides: ConfigOverrides | None = None,
    ) -> None:
        self._path = path
        self._text = running_text
        self._sections = _sections(parse_config(running_text).document)
        self._running = running
        self._registry = registry
        self._handle = handle
        self._datastore = datastore
        self._director = director
        self._build_control = build_control
        self._interval = interval
        self._overrides = overrides
        self._unreadable = False
        self.reloads = 0
        self.refusals = 0

    async def run(self) -> None:
        logger.info("watching %s for config changes every %gs", self._path, self._interval)
        while True:
            await asyncio.sleep(self._interval)
            try:
                await self.check()
            except Exception as exc:  # the watcher outlives anything one reload does
                logger.error(
                    "config %s: reload failed, keeping the running one: %s",
                    self._path,
                    _one_line(exc),
                )

    async def check(self) -> bool:
        """Reads the file once and applies it if it changed and loads; whether it did."""
        try:
            text = await asyncio.to_thread(_read, self._path)
        except OSError as exc:
            if not self._unreadable:
                self._unreadable = True
                logger.error("config %s unreadable, keeping the running one: %s", self._path, exc)
            return False
        self._unreadable = False
        old = self._running
        if not await self.offer(text):
            return False
        await _restart_background(old, self._running)
        return True

    @property
    def running(self) -> LoadedConfig:
        """The config in use."""
        return self._running

    async def offer(self, text: str) -> bool:
        """Applies ``text`` if it differs from the running config and loads; whether it did.
        Any exception refuses it: logged as one line, the running config kept."""
        if text == self._text:
            return False
        self._text = text  # a refused text is not retried until the file changes again
        try:
            parsed = await asyncio.to_thread(parse_config, text)
            if self._text is not text:
                return False  # a newer text was offered meanwhile
            loaded, control = self._load(parsed)
        except Exception as exc:
            self.refusals += 1
            logger.error(
                "config %s not reloaded, keeping the running one: %s", self._path, _one_line(exc)
            )
            return False
        old = self._running
        self._director.control = control  # the swap: new requests use the new plugins
        self._running = loaded
        self._datastore.unsubscribe_owned_by(list(old.plugins.values()))
        self.reloads += 1
        logger.info(
            "config %s reloaded: profiles %s; plugins %s",
            self._path,
            ", ".join(loaded.profiles),
            ", ".join(str(p.typed_name) for p in loaded.plugins.values()),
        )
        return True

    def _load(self, parsed: ParsedConfig) -> tuple[LoadedConfig, RequestControl]:
        """Builds ``parsed`` (on the event loop); raises when it must be refused."""
        if parsed.document is None:
            raise ConfigError(
                "the file is empty (or only comments): refused, not taken as the built-in "
                "default config"
            )
        sections = _sections(parsed.document)
        changed = [name for name in RESTART_SECTIONS if sections[name] != self._sections[name]]
        if changed:
            raise ConfigError(f"{', '.join(changed)}: changed, which needs a restart")
        handle = dataclasses.replace(self._handle, plugins={})
        try:
            loaded = build_config(
                parsed, registry=self._registry, handle=handle, overrides=self._overrides
            )
            return loaded, self._build_control(loaded)
        except BaseException:
            # the half-built plugins must not go on hearing of endpoints
            self._datastore.unsubscribe_owned_by(list(handle.plugins.values()))
            raise


async def _restart_background(old: LoadedConfig, new: LoadedConfig) -> None:
    """Stop the replaced plugins' background work, then start the new plugins' (stopping
    first lets the new shared KV-block index take the released writer leases at once)."""
    for plugin in old.plugins.values():
        if isinstance(plugin, BackgroundPlugin):
            try:
                await plugin.stop()
            except Exception:
                logger.exception("%s: stopping the replaced plugin failed", plugin.typed_name)
    for plugin in new.plugins.values():
        if isinstance(plugin, BackgroundPlugin):
            try:
                await plugin.start()
            except Exception as exc:
                logger.error("%s: starting failed: %s", plugin.typed_name, _one_line(exc))
