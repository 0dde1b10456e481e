"""``RedisSharedLoad``: the ``SharedLoad`` and ``SharedAdmission`` ports on Redis (a single
server or a cluster).

Keys (``P`` is the pool's key prefix; all share the hash tag ``{P}``, so one slot):

- ``P:load:{P}:p:<process-id>``: a hash, endpoint name -> ``"<requests> <tokens>"``, written
  by that process only (its id is random, per instance), with a lease (``PEXPIRE lease``);
- ``P:load:{P}:a:<process-id>``: a hash, ``"<priority> <flow key>"`` -> ``"<in flight>
  <waiting>"``, that process's flow-control counts (``domain.flowcontrol.pool``: at most
  ``MAX_PUBLISHED_FLOWS`` flows and one overflow entry per band), with the short lease
  ``ADMISSION_LEASE`` (1 s): a process that dies stops counting in the others' fairness and
  priority decisions within a second;
- ``P:load:{P}:k:<process-id>``: a hash, endpoint name -> the blocks that process's in-flight
  requests hold there and share with none (``kv-capacity-gate``'s count: the rest of each
  prompt, one output block each), and ``P:load:{P}:s:<process-id>:<endpoint>``, a set of the
  prefix block hashes (16 hex digits) its in-flight requests hold there, all with the
  admission lease: the pool's blocks on an endpoint are the union of the sets (shared
  prefix blocks counted once) plus the summed hash fields;
- ``P:load:{P}:live``: a sorted set of process ids scored by the end of their lease (ms, the
  server's clock), itself expiring one lease after the last renewal.

Between ``start()`` and ``stop()`` a background task runs one script, one round trip: it
writes this process's changed totals and flow counts (absolute values; an entry back at
zero is deleted), renews its leases, drops expired process ids, and returns the sums over
the other live processes, which become the local copies ``others()``, ``flows()`` and
``kv_blocks()`` return (the last two only while the last refresh is less than
``ADMISSION_LEASE`` old;
callbacks given to ``watch`` run when it changed). It runs every
``staleness`` seconds, and sooner when ``publish`` or ``remove_endpoint`` changed a total,
though at most once per ``staleness / 4``: under traffic the others see a booking, and
this process reads theirs, within about a quarter of ``staleness`` plus a round trip.
A process idle for a second (no ``publish``, ``remove_endpoint`` or ``refresh``) with
nothing booked and no flow counts runs it every ``idle_period`` (1 s, at most a quarter of
the lease and half the admission lease, so that its copy of the others' flow counts never
lapses) instead: its totals do not change, its lease is renewed, and its next decision
reads the others' load with ``refresh`` anyway; the first ``publish`` wakes the task again.
``publish``, ``publish_flow``, ``publish_blocks`` and ``remove_endpoint`` only change local
state and wake the task.

On a failure the task logs once, keeps the last copy (``others()`` returns it until it is
older than the lease, then nothing) and retries with backoff (up to one second). The first
success after a failure logs once and republishes every total (the store may have restarted
empty). Each failed round trip counts in ``..._shared_state_errors_total{operation="load_sync"}``.

Keys may vanish without an error (an ``allkeys-*`` eviction policy, a restart between two
round trips): the script checks that this process's hash holds as many entries as it should
and, when not, every total is written again at the next round trip. A server out of memory
under ``noeviction`` refuses writes (``OOM``), but only a script's first write command: the
script starts with a lease renewal (``PEXPIRE``, never refused), so its writes, a few hundred
bytes per process, still land and the pool's load stays right on a full server. Were a write
refused anyway, the script still reads the others' load, the task logs once (and once when
writes are accepted again), and each refused round trip counts in
``{operation="load_write"}``. Totals that do not parse or are negative are
skipped, so a garbage value can never make a load negative. ``on_degraded`` is told on each
change whether the load is degraded (failing, or its writes refused): the process's
``..._shared_state_degraded`` gauge.

``stop()`` cancels the task and deletes this process's hashes, sets and live entry (best effort,
bounded by the client's timeouts).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType

from adapters.redis.connection import RedisClient
from adapters.redis.script import LuaScript, guarded
from ports.metric_catalogue import SHARED_STATE_ERRORS
from ports.observer import NoopObserver, Observer
from ports.shared_state import (
    HASH_MASK,
    NO_POOL_FLOWS,
    SAMPLE_MASK,
    EndpointLoad,
    FlowCounts,
    PoolBlocks,
    PoolFlows,
    ProcessBlocks,
    SharedStateError,
    SharedStateReplyError,
    estimate_pool_blocks,
)

__all__ = [
    "ADMISSION_LEASE",
    "DEFAULT_LEASE",
    "DEFAULT_REFRESH_BUDGET",
    "DEFAULT_STALENESS",
    "IDLE_AFTER",
    "IDLE_PERIOD",
    "RedisSharedLoad",
]

logger = logging.getLogger(__name__)

_NO_BLOCKS: Mapping[str, PoolBlocks] = MappingProxyType({})

DEFAULT_LEASE = 10.0
#: Seconds a process's flow counts live without a renewal (at most the lease), and how long
#: this process uses its copy of the others' without a successful refresh.
ADMISSION_LEASE = 1.0
DEFAULT_STALENESS = 0.02
#: Seconds ``refresh`` waits for its round trip (the routing budget).
DEFAULT_REFRESH_BUDGET = 0.005
#: Seconds without activity after which a process with nothing booked is idle, and the
#: period of its round trips then (at most a quarter of the lease).
IDLE_AFTER = 1.0
IDLE_PERIOD = 1.0
_MAX_BACKOFF = 1.0
_SYNC_LOAD = {"operation": "load_sync"}
_WRITE_LOAD = {"operation": "load_write"}
#: Seconds ``stop()`` waits for the task to end, then for the withdrawal.
_STOP_TIMEOUT = 1.0

#: The Lua helpers of the processes' blocks (ARGV[9] and ARGV[10]: the block-hash and
#: block-set key prefixes). A process's block hash has, per endpoint, "<prefix blocks>
#: <blocks not shared>"; its set per endpoint the sampled prefix hashes (16 hex digits).
_BLOCK_FUNCTIONS = """
local function set_key(id, endpoint) return ARGV[10] .. id .. ':' .. endpoint end
-- Drop every block process ``id`` published (its sets and block hash).
local function withdraw(id)
  local key = ARGV[9] .. id
  for _, e in ipairs(redis.call('HKEYS', key)) do redis.call('DEL', set_key(id, e)) end
  redis.call('DEL', key)
end
-- Add (``command`` SADD) or remove (SREM) ARGV[first..last] in ``key``, in chunks.
local function members(command, key, first, last)
  while first <= last do
    local stop = math.min(last, first + 999)
    redis.call(command, key, unpack(ARGV, first, stop))
    first = stop + 1
  end
end
"""

# KEYS = live set, own load hash, own flow hash, own block hash, the set of processes holding
# blocks (scored by the end of their admission lease); ARGV = own id, lease ms, load-hash key
# prefix, flow-hash key prefix, flow lease ms, clear (0/1), own load entries and own flow
# entries expected after the writes, block-hash key prefix, block-set key prefix,
# then for each table (load, flows): the number of pairs to set, the number of fields to
# delete, the pairs (field, "a b"), the fields to delete; then the blocks: own block-hash
# entries expected after the writes, the number of endpoints changed, and for each: its name,
# its prefix blocks, its blocks not shared, the number of sampled hashes added and removed,
# those hashes.
# Reply: a status, the number of load triples, the number of flow triples, the number of
# other live processes, two zeros (the header is two triples), the (endpoint,
# requests, tokens) triples of the other live processes, their ("<priority> <flow key>", in
# flight, waiting) triples, then for each other process holding blocks (in id order) and each
# endpoint: (endpoint, its prefix blocks there, "<process id> <blocks not shared> <its
# sampled hashes there> <those no process before it holds, concatenated>").
# Status: "ok"; "lost" when the own hash does not hold what was written (evicted keys, a
# server restarted empty): the caller writes everything again next time; or an OOM error's
# text if the server refused a write (it should not: see the first PEXPIRE): the read still
# runs.
_SYNC = LuaScript(
    "load-sync",
    """
local status = 'ok'
local function write(...)
  local r = redis.pcall(...)
  if type(r) == 'table' and r.err then
    if string.sub(r.err, 1, 3) ~= 'OOM' then error(r) end
    if status == 'ok' or status == 'lost' then status = r.err end
  end
end
-- First a write Redis never refuses: at maxmemory (noeviction) Redis refuses only a
-- script's first write, so this script's few hundred bytes still land on a full server.
redis.call('PEXPIRE', KEYS[1], ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease = tonumber(ARGV[2])
"""
    + _BLOCK_FUNCTIONS
    + """-- Processes whose blocks lapsed (no round trip for the admission lease): drop them.
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[5], '-inf', now)) do
  if id ~= ARGV[1] then withdraw(id) end
  redis.call('ZREM', KEYS[5], id)
end
if ARGV[6] == '1' then
  withdraw(ARGV[1])
  redis.call('DEL', KEYS[2], KEYS[3])
end
local i = 11
local function apply(key, expected, ttl)
  local nset, ndel = tonumber(ARGV[i]), tonumber(ARGV[i + 1])
  i = i + 2
  while nset > 0 do
    local n = math.min(nset, 500)
    write('HSET', key, unpack(ARGV, i, i + 2 * n - 1))
    i = i + 2 * n
    nset = nset - n
  end
  while ndel > 0 do
    local n = math.min(ndel, 1000)
    redis.call('HDEL', key, unpack(ARGV, i, i + n - 1))
    i = i + n
    ndel = ndel - n
  end
  if status == 'ok' and redis.call('HLEN', key) ~= tonumber(expected) then status = 'lost' end
  redis.call('PEXPIRE', key, ttl)
end
apply(KEYS[2], ARGV[7], lease)
apply(KEYS[3], ARGV[8], tonumber(ARGV[5]))
do
  local expected, changed = tonumber(ARGV[i]), tonumber(ARGV[i + 1])
  i = i + 2
  for _ = 1, changed do
    local e, prefix, unshared = ARGV[i], tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])
    local nadd, nrem = tonumber(ARGV[i + 3]), tonumber(ARGV[i + 4])
    i = i + 5
    local key = set_key(ARGV[1], e)
    if prefix + unshared > 0 then
      members('SADD', key, i, i + nadd - 1)
      members('SREM', key, i + nadd, i + nadd + nrem - 1)
      write('HSET', KEYS[4], e, prefix .. ' ' .. unshared)
    else
      redis.call('HDEL', KEYS[4], e)
      redis.call('DEL', key)
    end
    i = i + nadd + nrem
  end
  local held = redis.call('HKEYS', KEYS[4])
  if status == 'ok' and #held ~= expected then status = 'lost' end
  for _, e in ipairs(held) do redis.call('PEXPIRE', set_key(ARGV[1], e), lease) end
  redis.call('PEXPIRE', KEYS[4], lease)
  if #held > 0 then
    write('ZADD', KEYS[5], now + tonumber(ARGV[5]), ARGV[1])
    redis.call('PEXPIRE', KEYS[5], lease)
  else
    redis.call('ZREM', KEYS[5], ARGV[1])
  end
end
write('ZADD', KEYS[1], now + lease, ARGV[1])
redis.call('PEXPIRE', KEYS[1], lease)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local ids = redis.call('ZRANGE', KEYS[1], 0, -1)
local function sum(prefix)
  local a, b, order = {}, {}, {}
  for _, id in ipairs(ids) do
    if id ~= ARGV[1] then
      local flat = redis.call('HGETALL', prefix .. id)
      for j = 1, #flat, 2 do
        local x, y = string.match(flat[j + 1], '^(%d+) (%d+)$')
        if x then
          local f = flat[j]
          if a[f] == nil then a[f] = 0; b[f] = 0; order[#order + 1] = f end
          a[f] = a[f] + tonumber(x)
          b[f] = b[f] + tonumber(y)
        end
      end
    end
  end
  return a, b, order
end
local others = 0
for _, id in ipairs(ids) do
  if id ~= ARGV[1] then others = others + 1 end
end
local out = {status, 0, 0, others, 0, 0}
local a, b, order = sum(ARGV[3])
out[2] = #order
for _, f in ipairs(order) do
  out[#out + 1] = f; out[#out + 1] = a[f]; out[#out + 1] = b[f]
end
a, b, order = sum(ARGV[4])
out[3] = #order
for _, f in ipairs(order) do
  out[#out + 1] = f; out[#out + 1] = a[f]; out[#out + 1] = b[f]
end
-- The other processes' blocks per endpoint, in process id order; each sampled hash goes
-- out once, with the first process that holds it, each process with its sample's size.
local holders = {}
for _, id in ipairs(redis.call('ZRANGE', KEYS[5], 0, -1)) do
  if id ~= ARGV[1] then holders[#holders + 1] = id end
end
table.sort(holders)
local seen = {}
for _, id in ipairs(holders) do
  local flat = redis.call('HGETALL', ARGV[9] .. id)
  for j = 1, #flat, 2 do
    local e = flat[j]
    local prefix, unshared = string.match(flat[j + 1], '^(%d+) (%d+)$')
    if prefix then
      local union = seen[e]
      if union == nil then union = {}; seen[e] = union end
      local sample = redis.call('SMEMBERS', set_key(id, e))
      local first = {}
      for _, h in ipairs(sample) do
        if not union[h] then union[h] = true; first[#first + 1] = h end
      end
      out[#out + 1] = e; out[#out + 1] = tonumber(prefix)
      out[#out + 1] = id .. ' ' .. unshared .. ' ' .. #sample .. ' ' .. table.concat(first)
    end
  end
end
return out
""",
)


# KEYS = the set of processes holding blocks; ARGV = own id, block-hash key prefix, block-set
# key prefix: drops this process's blocks (at stop).
_WITHDRAW_BLOCKS = LuaScript(
    "blocks-withdraw",
    """
local ARGV = {ARGV[1], '', '', '', '', '', '', '', ARGV[2], ARGV[3]}
"""
    + _BLOCK_FUNCTIONS
    + """
withdraw(ARGV[1])
redis.call('ZREM', KEYS[1], ARGV[1])
return 1
""",
)


class RedisSharedLoad:
    """This process's in-flight totals and flow counts published to Redis; the other
    processes' read back."""

    __slots__ = (
        "_active_at",
        "_admission_lease",
        "_block_prefix",
        "_blocks",
        "_blocks_added",
        "_blocks_dirty",
        "_blocks_removed",
        "_client",
        "_copy",
        "_copy_at",
        "_degraded",
        "_dirty",
        "_dirty_flows",
        "_flow_prefix",
        "_flows",
        "_flows_raw",
        "_holders_key",
        "_idle_after",
        "_idle_period",
        "_kv_blocks",
        "_kv_blocks_stale",
        "_lease",
        "_live_key",
        "_observer",
        "_on_degraded",
        "_others_blocks",
        "_own",
        "_own_block_key",
        "_own_blocks",
        "_own_flow_key",
        "_own_flows",
        "_own_key",
        "_own_sampled",
        "_process_id",
        "_process_prefix",
        "_refresh_budget",
        "_refused",
        "_republish",
        "_round_trip",
        "_sampled_raw",
        "_set_prefix",
        "_staleness",
        "_sync",
        "_task",
        "_wake",
        "_watchers",
    )

    def __init__(
        self,
        client: RedisClient,
        *,
        key_prefix: str,
        lease: float = DEFAULT_LEASE,
        staleness: float = DEFAULT_STALENESS,
        refresh_budget: float = DEFAULT_REFRESH_BUDGET,
        observer: Observer | None = None,
        idle_after: float = IDLE_AFTER,
        on_degraded: Callable[[bool], None] | None = None,
    ) -> None:
        if not key_prefix or "{" in key_prefix or "}" in key_prefix:
            raise ValueError(f"key prefix must be non-empty, without braces: {key_prefix!r}")
        if lease <= 0 or staleness <= 0 or staleness >= lease:
            raise ValueError(f"need 0 < staleness < lease, got {staleness} and {lease}")
        self._client = client
        self._lease = lease
        self._staleness = staleness
        self._process_id = secrets.token_hex(8)
        self._process_prefix = f"{key_prefix}:load:{{{key_prefix}}}:p:"
        self._own_key = self._process_prefix + self._process_id
        self._flow_prefix = f"{key_prefix}:load:{{{key_prefix}}}:a:"
        self._own_flow_key = self._flow_prefix + self._process_id
        self._live_key = f"{key_prefix}:load:{{{key_prefix}}}:live"
        self._block_prefix = f"{key_prefix}:load:{{{key_prefix}}}:k:"
        self._own_block_key = self._block_prefix + self._process_id
        self._set_prefix = f"{key_prefix}:load:{{{key_prefix}}}:s:"
        self._holders_key = f"{key_prefix}:load:{{{key_prefix}}}:holders"
        #: per endpoint: the prefix blocks held (taken modulo 2**64), the sampled ones, the
        #: blocks not shared; what changed since the last round trip (sampled hashes added,
        #: removed; endpoints)
        self._blocks: dict[str, set[int]] = {}
        self._own_sampled: dict[str, set[int]] = {}
        self._own_blocks: dict[str, int] = {}
        self._blocks_added: dict[str, set[int]] = {}
        self._blocks_removed: dict[str, set[int]] = {}
        self._blocks_dirty: set[str] = set()
        self._kv_blocks: Mapping[str, PoolBlocks] = _NO_BLOCKS
        #: the other processes' blocks as of the last round trip (in process id order), and
        #: the endpoints where this process's sample changed since ``_kv_blocks`` was
        #: estimated
        self._others_blocks: list[dict[str, ProcessBlocks]] = []
        self._kv_blocks_stale: set[str] = set()
        #: (process id, endpoint) -> the raw sample last parsed, and its hashes
        self._sampled_raw: dict[tuple[str, str], tuple[bytes, frozenset[int]]] = {}
        self._admission_lease = min(ADMISSION_LEASE, lease)
        self._own: dict[str, EndpointLoad] = {}
        self._dirty: set[str] = set()
        self._own_flows: dict[str, FlowCounts] = {}
        self._dirty_flows: set[str] = set()
        self._flows: PoolFlows = NO_POOL_FLOWS
        self._round_trip = 0.0  # seconds: the load sync's, recent slowest
        self._flows_raw: dict[tuple[int, str], FlowCounts] = {}
        self._watchers: list[Callable[[], None]] = []
        self._republish = True
        self._copy: dict[str, EndpointLoad] = {}
        self._copy_at = -float("inf")
        self._degraded = False
        self._refused = False
        self._on_degraded = on_degraded
        self._observer = observer or NoopObserver()
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._refresh_budget = refresh_budget
        # Less than half the admission lease: an idle process's copy of the others' flow
        # counts never lapses between two round trips, so a burst finds it current.
        self._idle_period = max(staleness, min(IDLE_PERIOD, lease / 4, self._admission_lease / 2))
        self._idle_after = idle_after
        self._active_at = time.monotonic()
        #: The round trip under way, shared by the background task and ``refresh``.
        self._sync: asyncio.Future[None] | None = None

    @property
    def process_id(self) -> str:
        return self._process_id

    @property
    def degraded(self) -> bool:
        """True from the first failed round trip to the next successful one."""
        return self._degraded

    @property
    def writes_refused(self) -> bool:
        """True while the server answers but refuses this process's writes (out of memory):
        the others' load is still read; this process's is not published."""
        return self._refused

    # SharedLoad port
    @property
    def staleness(self) -> float:
        return self._staleness

    @property
    def idle(self) -> bool:
        """No publish, removal or refresh for ``idle_after`` seconds (``IDLE_AFTER``), and
        nothing booked: the background round trips are ``idle_period`` apart."""
        if time.monotonic() - self._active_at < self._idle_after:
            return False
        if self._own_flows or self._own_blocks:
            return False
        return not any(load.requests or load.tokens for load in self._own.values())

    def publish(self, endpoint: str, load: EndpointLoad) -> None:
        self._active_at = time.monotonic()
        if self._own.get(endpoint) != load:
            self._own[endpoint] = load
            self._dirty.add(endpoint)
            self._wake.set()

    def others(self) -> Mapping[str, EndpointLoad]:
        if time.monotonic() - self._copy_at > self._lease:
            return {}
        return self._copy

    def remove_endpoint(self, endpoint: str) -> None:
        self._active_at = time.monotonic()
        if self._own.pop(endpoint, None) is not None:
            self._dirty.add(endpoint)
            self._wake.set()
        held = self._blocks.get(endpoint)
        if held or self._own_blocks.get(endpoint):
            self.publish_blocks(endpoint, (), list(held or ()), 0)

    # SharedAdmission port
    def publish_flow(self, priority: int, flow: str, counts: FlowCounts) -> None:
        self._active_at = time.monotonic()
        field = f"{priority} {flow}"
        if counts.in_flight > 0 or counts.waiting > 0:
            if self._own_flows.get(field) == counts:
                return
            self._own_flows[field] = counts
        elif self._own_flows.pop(field, None) is None:
            return
        self._dirty_flows.add(field)
        self._wake.set()

    def flows(self) -> PoolFlows:
        if time.monotonic() - self._copy_at > self._admission_lease:
            return NO_POOL_FLOWS
        return self._flows

    def visible_after(self) -> float:
        # Under traffic a changed count is written at most a quarter of ``staleness`` after
        # the change (the other's round trip), and this copy read at most a quarter after
        # this process's own last change (its round trip): half of ``staleness`` and two
        # round trips, which a busy machine stretches (a burst slows the round trips
        # before they are measured, hence the whole ``staleness``). At most
        # ``_MAX_VISIBLE_AFTER`` staleness: a slow Redis must not make flow control count
        # seconds of this process's dispatches again for every other process.
        return min(self._staleness + 2 * self._round_trip, _MAX_VISIBLE_AFTER * self._staleness)

    def watch(self, callback: Callable[[], None]) -> None:
        self._watchers.append(callback)

    # SharedKVBlocks port
    def publish_blocks(
        self, endpoint: str, added: Iterable[int], removed: Iterable[int], own: int
    ) -> None:
        self._active_at = time.monotonic()
        held = self._blocks.setdefault(endpoint, set())
        sampled = self._own_sampled.setdefault(endpoint, set())
        pending_add = self._blocks_added.setdefault(endpoint, set())
        pending_remove = self._blocks_removed.setdefault(endpoint, set())
        for block in added:
            block &= HASH_MASK
            if block not in held:
                held.add(block)
                if block & SAMPLE_MASK:
                    continue
                sampled.add(block)
                self._kv_blocks_stale.add(endpoint)
                if block in pending_remove:
                    pending_remove.discard(block)
                else:
                    pending_add.add(block)
        for block in removed:
            block &= HASH_MASK
            if block in held:
                held.discard(block)
                if block & SAMPLE_MASK:
                    continue
                sampled.discard(block)
                self._kv_blocks_stale.add(endpoint)
                if block in pending_add:
                    pending_add.discard(block)
                else:
                    pending_remove.add(block)
        if not held:
            del self._blocks[endpoint]
        if not sampled:
            del self._own_sampled[endpoint]
        own = max(0, own)
        if own:
            self._own_blocks[endpoint] = own
        else:
            self._own_blocks.pop(endpoint, None)
        self._blocks_dirty.add(endpoint)
        self._wake.set()

    def kv_blocks(self) -> Mapping[str, PoolBlocks]:
        if time.monotonic() - self._copy_at > self._admission_lease:
            return _NO_BLOCKS
        if self._kv_blocks_stale:
            # Against this process's sample as it is now: a prefix it stopped holding since
            # the round trip counts again where the others hold it, one it took on stops.
            self._estimate(self._kv_blocks_stale)
        return self._kv_blocks

    async def refresh(self) -> None:
        self._active_at = time.monotonic()
        if self._task is None or self._degraded:
            return  # not started, or failing: the background task retries on its own
        call = self._sync_shared()
        try:
            async with asyncio.timeout(self._refresh_budget):
                await asyncio.shield(call)
        except (TimeoutError, SharedStateError):
            pass  # the copy as it was; the background task logs failures

    def _sync_shared(self) -> asyncio.Future[None]:
        """The round trip under way, or a new one: never two at once."""
        call = self._sync
        if call is None or call.done():
            call = self._sync = asyncio.ensure_future(self.sync_once())
            call.add_done_callback(_retrieve)
        return call

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name=f"redis-shared-load-{self._process_id}"
            )

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            done, _ = await asyncio.wait({task}, timeout=_STOP_TIMEOUT)
            if not done:
                logger.warning("shared load: the background task did not stop in time")
        call = self._sync
        if call is not None and not call.done():
            # A round trip under way would write this process's totals after the withdrawal.
            await asyncio.wait({call}, timeout=_STOP_TIMEOUT)
        try:
            if self._own_blocks:
                await guarded(
                    "blocks withdraw",
                    asyncio.wait_for(
                        _WITHDRAW_BLOCKS.run(
                            self._client,
                            [self._holders_key],
                            [
                                self._process_id,
                                self._block_prefix,
                                self._set_prefix,
                            ],
                        ),
                        _STOP_TIMEOUT,
                    ),
                )
            pipe = self._client.pipeline(transaction=False)
            pipe.delete(self._own_key, self._own_flow_key)
            pipe.zrem(self._live_key, self._process_id)
            await guarded("load withdraw", asyncio.wait_for(pipe.execute(), _STOP_TIMEOUT))
        except SharedStateError as error:
            logger.warning("could not withdraw this process's load from redis: %s", error)

    # Internals
    def _take_blocks(self, blocks: list[tuple[str, str, int, int, int, bytes]]) -> None:
        """The others' blocks from a reply, (process id, endpoint, prefix blocks, blocks not
        shared, sample size, the raw hashes of its sample no process before it holds)
        each; a sample is parsed again only when it changed."""
        cache = self._sampled_raw
        fresh_cache: dict[tuple[str, str], tuple[bytes, frozenset[int]]] = {}
        processes: dict[str, dict[str, ProcessBlocks]] = {}
        for process_id, endpoint, prefix, unshared, size, raw in blocks:
            key = (process_id, endpoint)
            parsed = cache.get(key)
            if parsed is None or parsed[0] != raw:
                parsed = (raw, frozenset(int(raw[j : j + 16], 16) for j in range(0, len(raw), 16)))
            fresh_cache[key] = parsed
            processes.setdefault(process_id, {})[endpoint] = ProcessBlocks(
                prefix, unshared, parsed[1], size
            )
        self._sampled_raw = fresh_cache
        self._others_blocks = [processes[p] for p in sorted(processes)]
        self._estimate()

    def _estimate(self, endpoints: set[str] | None = None) -> None:
        """``_kv_blocks`` from the others' last blocks and this process's sample now: for
        ``endpoints`` only (the rest kept), or for every endpoint (``None``)."""
        self._kv_blocks_stale = set()
        if endpoints is None:
            estimate = estimate_pool_blocks(self._own_sampled, self._others_blocks)
        else:
            others = [
                {e: process[e] for e in endpoints if e in process}
                for process in self._others_blocks
            ]
            estimate = {e: b for e, b in self._kv_blocks.items() if e not in endpoints}
            estimate.update(estimate_pool_blocks(self._own_sampled, others))
        if estimate != self._kv_blocks:
            self._kv_blocks = MappingProxyType(estimate) if estimate else _NO_BLOCKS

    def _set_key(self, endpoint: str) -> str:
        return f"{self._set_prefix}{self._process_id}:{endpoint}"

    def _block_args(self, republish: bool) -> list[str | int]:
        """The script's block table: what changed since the last round trip (all of it
        when republishing), the pending changes cleared."""
        held = set(self._own_blocks) | set(self._blocks)
        endpoints = held if republish else self._blocks_dirty
        added, removed = self._blocks_added, self._blocks_removed
        self._blocks_added, self._blocks_removed, self._blocks_dirty = {}, {}, set()
        args: list[str | int] = [len(held), len(endpoints)]
        for endpoint in endpoints:
            if republish:
                plus: Iterable[int] = self._own_sampled.get(endpoint, ())
                minus: Iterable[int] = ()
            else:
                plus, minus = added.get(endpoint, ()), removed.get(endpoint, ())
            plus_hex = [_hex(block) for block in plus]
            minus_hex = [_hex(block) for block in minus]
            args += (
                endpoint,
                len(self._blocks.get(endpoint, ())),
                self._own_blocks.get(endpoint, 0),
                len(plus_hex),
                len(minus_hex),
                *plus_hex,
                *minus_hex,
            )
        return args

    async def sync_once(self) -> None:
        """One round trip: write what changed, renew the lease, read the others' sum.
        Raises ``SharedStateError``; the background task calls it every ``staleness``.
        A refused write (out of memory) or a lost own hash (evicted) does not raise: the
        others' sum is still used, and everything is written again at the next call."""
        republish = self._republish
        dirty = list(self._own) if republish else list(self._dirty)
        dirty_flows = list(self._own_flows) if republish else list(self._dirty_flows)
        self._dirty = set()
        self._dirty_flows = set()
        self._republish = False
        pairs: list[str] = []
        deleted: list[str] = []
        for endpoint in dirty:
            load = self._own.get(endpoint)
            if load is None or (load.requests == 0 and load.tokens == 0):
                deleted.append(endpoint)
            else:
                pairs += (endpoint, f"{load.requests} {load.tokens}")
        flow_pairs: list[str] = []
        flow_deleted: list[str] = []
        for field in dirty_flows:
            counts = self._own_flows.get(field)
            if counts is None:
                flow_deleted.append(field)
            else:
                flow_pairs += (field, f"{counts.in_flight} {counts.waiting}")
        held = sum(1 for load in self._own.values() if load.requests or load.tokens)
        args: list[str | int] = [
            self._process_id,
            max(1, round(self._lease * 1000)),
            self._process_prefix,
            self._flow_prefix,
            max(1, round(self._admission_lease * 1000)),
            1 if republish else 0,
            held,
            len(self._own_flows),
            self._block_prefix,
            self._set_prefix,
            len(pairs) // 2,
            len(deleted),
            *pairs,
            *deleted,
            len(flow_pairs) // 2,
            len(flow_deleted),
            *flow_pairs,
            *flow_deleted,
            *self._block_args(republish),
        ]
        started = time.monotonic()
        try:
            reply = await guarded(
                "load sync",
                _SYNC.run(
                    self._client,
                    [
                        self._live_key,
                        self._own_key,
                        self._own_flow_key,
                        self._own_block_key,
                        self._holders_key,
                    ],
                    args,
                ),
            )
            status, copy, flows, blocks, processes = _parse_reply(reply)
        except BaseException:
            # Not written: write it again next time (everything, the store may be empty).
            self._republish = True
            raise
        self._copy = copy
        self._copy_at = now = time.monotonic()
        # the slowest of the recent round trips, decaying by a tenth a round trip
        self._round_trip = max(now - started, 0.9 * self._round_trip)
        self._take_blocks(blocks)
        if flows != self._flows_raw or processes != self._flows.processes:
            self._flows_raw = flows
            self._flows = PoolFlows.of(flows, processes)
            for callback in self._watchers:
                callback()
        if status == b"ok":
            if self._refused:
                self._refused = False
                logger.info("shared load: redis accepts writes again, load republished")
                self._republish = True
                self._report()
            return
        self._republish = True  # evicted or refused: write every total next time
        if status == b"lost":
            return
        self._observer.counter(SHARED_STATE_ERRORS, _WRITE_LOAD)
        if not self._refused:
            self._refused = True
            self._report()
            logger.warning(
                "shared load: redis refuses writes, reading the others' load only: %s",
                status.decode(errors="replace")[:200],
            )

    async def _run(self) -> None:
        delay = self._staleness
        me = asyncio.current_task()
        while True:
            started = time.monotonic()
            try:
                await asyncio.shield(self._sync_shared())
            except SharedStateError as error:
                # redis-py can turn a cancellation inside a command into an error.
                if me is not None and me.cancelling():
                    raise asyncio.CancelledError from error
                self._observer.counter(SHARED_STATE_ERRORS, _SYNC_LOAD)
                if not self._degraded:
                    self._degraded = True
                    logger.warning("shared load: redis failed, using local state: %s", error)
                    self._report()
                delay = min(max(delay * 2, self._staleness), _MAX_BACKOFF)
            else:
                if self._degraded:
                    self._degraded = False
                    logger.info("shared load: redis answers again, load republished")
                    self._report()
                delay = self._idle_period if self.idle else self._staleness
            if me is not None and me.cancelling():
                raise asyncio.CancelledError
            await self._pause(started, delay)

    def _report(self) -> None:
        """Tell ``on_degraded`` whether the shared load is degraded: failing, or its writes
        refused (the others' load is read, this process's is not shared)."""
        if self._on_degraded is not None:
            self._on_degraded(self._degraded or self._refused)

    async def _pause(self, started: float, delay: float) -> None:
        """Until ``delay`` after ``started``; healthy, a change ends it once a quarter of
        ``staleness`` has passed."""
        if self._degraded:
            await asyncio.sleep(max(0.0, delay - (time.monotonic() - started)))
            return
        await asyncio.sleep(max(0.0, self._staleness / 4 - (time.monotonic() - started)))
        if not (self._dirty or self._dirty_flows or self._blocks_dirty):
            self._wake.clear()
            left = delay - (time.monotonic() - started)
            if left > 0:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(left):
                        await self._wake.wait()
        self._wake.clear()


def _retrieve(call: asyncio.Future[None]) -> None:
    """Mark a round trip's failure as seen (whoever awaited it handled it, or nobody did)."""
    if not call.cancelled():
        call.exception()


def _hex(block: int) -> str:
    """A block hash as the store keeps it: 16 lower-case hex digits."""
    return f"{block & HASH_MASK:016x}"


#: ``visible_after`` is at most this many times the staleness.
_MAX_VISIBLE_AFTER = 4
#: The reply's header: status, load triples, flow triples, other live processes, 0, 0.
_HEADER = 6


def _parse_reply(
    reply: object,
) -> tuple[
    bytes,
    dict[str, EndpointLoad],
    dict[tuple[int, str], FlowCounts],
    list[tuple[str, str, int, int, int, bytes]],
    int,
]:
    """The script's status, the others' load, their flow counts, their blocks per
    endpoint and how many other processes are live; anything malformed is an error (a flow
    field that does not parse is skipped, as a total that does not)."""
    if (
        not isinstance(reply, list)
        or len(reply) < _HEADER
        or len(reply) % 3 != 0
        or not isinstance(reply[0], bytes)
        or not isinstance(reply[1], int)
        or not isinstance(reply[2], int)
        or not isinstance(reply[3], int)
        or reply[1] < 0
        or reply[2] < 0
        or reply[3] < 0
        or reply[1] + reply[2] > (len(reply) - _HEADER) // 3
    ):
        raise SharedStateReplyError(f"redis load sync: unexpected reply {reply!r:.100}")
    loads: dict[str, EndpointLoad] = {}
    flows: dict[tuple[int, str], FlowCounts] = {}
    blocks: list[tuple[str, str, int, int, int, bytes]] = []
    end_of_loads = _HEADER + 3 * reply[1]
    end_of_flows = end_of_loads + 3 * reply[2]
    for i in range(_HEADER, len(reply), 3):
        name, first, second = reply[i : i + 3]
        if not isinstance(name, bytes) or not isinstance(first, int):
            raise SharedStateReplyError(f"redis load sync: unexpected reply {reply!r:.100}")
        if i >= end_of_flows and isinstance(second, bytes) and first >= 0:
            pass  # blocks: (endpoint, prefix blocks, "<process> <not shared> <size> <sample>")
        elif not isinstance(second, int) or first < 0 or second < 0:
            raise SharedStateReplyError(f"redis load sync: unexpected reply {reply!r:.100}")
        try:
            text = name.decode()
        except UnicodeDecodeError as error:
            raise SharedStateReplyError(f"redis load sync: field name {error}") from error
        if i < end_of_loads:
            loads[text] = EndpointLoad(requests=first, tokens=second)
            continue
        if i >= end_of_flows:
            if isinstance(second, bytes):
                process_id, _, rest = second.partition(b" ")
                unshared, _, rest = rest.partition(b" ")
                size, _, sample = rest.partition(b" ")
                if (
                    process_id.isascii()
                    and unshared.isdigit()
                    and size.isdigit()
                    and len(sample) % 16 == 0
                ):
                    blocks.append(
                        (process_id.decode(), text, first, int(unshared), int(size), sample)
                    )
            continue
        priority, space, flow = text.partition(" ")
        try:
            band = int(priority)
        except ValueError:
            continue
        if space:
            flows[(band, flow)] = FlowCounts(in_flight=first, waiting=second)
    return reply[0], loads, flows, blocks, reply[3]
