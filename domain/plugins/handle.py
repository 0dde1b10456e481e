"""What a plugin factory gets: the shared services and the other plugins."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from domain.datastore.store import Datastore
from domain.plugins.plugin import Plugin, PluginConfigError
from domain.sharedstate.degraded import DegradedGauge
from domain.sharedstate.load import LocalSharedLoad
from domain.sharedstate.sessions import InMemorySessionStore
from ports.codec import JsonCodec
from ports.kv_events import KVBlockStore
from ports.observer import NoopObserver, Observer
from ports.prefix_index import BlockHasher, PrefixIndex
from ports.sessions import SessionStore
from ports.shared_state import SharedKVBlocks, SharedLoad

__all__ = ["Handle"]


@dataclass(slots=True, kw_only=True)
class Handle:
    """Services shared by all plugins, and the plugins built so far (by name).

    Built once at start-up by the app; plugins keep what they need from it. ``observer``
    receives the plugins' metrics and spans (a no-op unless the app wires one). A factory
    finds the plugins configured before it in ``plugins``. ``shared_load`` is the in-flight
    load the pool's other EPP processes booked (``LocalSharedLoad``, none, unless the app
    wires a shared store). ``sessions`` holds the session bindings of the ``session_id``
    session-affinity strategy (in memory unless the app wires a shared store), each read or
    write of which may take ``shared_state_deadline`` seconds on the request path.
    ``kv_block_store`` is the pool's shared copy of the KV-block index (``None``: no shared
    store; ``precise-prefix-cache-producer`` then keeps its index in memory only).
    ``shared_kv_blocks`` carries the KV blocks each process's ``kv-capacity-gate`` counts
    (``None``: not shared; the gate counts the other processes' ``shared_load`` instead).
    ``shared_degraded`` is the process's shared-state degraded gauge, which every component
    on the shared store reports to (``None``: a plugin reports to ``observer`` alone).
    """

    codec: JsonCodec
    hasher: BlockHasher
    prefix_index: PrefixIndex
    datastore: Datastore
    rng: random.Random = field(default_factory=random.Random)
    clock: Callable[[], float] = time.monotonic
    observer: Observer = field(default_factory=NoopObserver)
    shared_load: SharedLoad = field(default_factory=LocalSharedLoad)
    sessions: SessionStore = field(default_factory=InMemorySessionStore)
    #: Seconds a shared store may take per call on the request path (``--redis-deadline``).
    shared_state_deadline: float = 0.005
    kv_block_store: KVBlockStore | None = None
    shared_kv_blocks: SharedKVBlocks | None = None
    shared_degraded: DegradedGauge | None = None
    plugins: dict[str, Plugin] = field(default_factory=dict)

    def add_plugin(self, plugin: Plugin) -> None:
        name = plugin.typed_name.name
        if name in self.plugins:
            raise PluginConfigError(f"duplicate plugin name {name!r}")
        self.plugins[name] = plugin
