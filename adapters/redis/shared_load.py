"""``RedisSharedLoad``: the ``SharedLoad`` port on Redis (a single server or a cluster).

Keys (``P`` is the pool's key prefix; all share the hash tag ``{P}``, so one slot):

- ``P:load:{P}:p:<process-id>``: a hash, endpoint name -> ``"<requests> <tokens>"``, written
  by that process only (its id is random, per instance), with a lease (``PEXPIRE lease``);
- ``P:load:{P}:live``: a sorted set of process ids scored by the end of their lease (ms, the
  server's clock), itself expiring one lease after the last renewal.

Between ``start()`` and ``stop()`` a background task runs one script, one round trip: it
writes this process's changed totals (absolute values; an endpoint back at zero is
deleted), renews its lease, drops expired process ids, and returns the sum over the other
live processes, which becomes the local copy ``others()`` returns. It runs every
``staleness`` seconds, and sooner when ``publish`` or ``remove_endpoint`` changed a total,
though at most once per ``staleness / 4``: under traffic the others see a booking, and
this process reads theirs, within about a quarter of ``staleness`` plus a round trip.
A process idle for a second (no ``publish``, ``remove_endpoint`` or ``refresh``) with
nothing booked runs it every ``idle_period`` (1 s, at most a quarter of the lease) instead:
its totals do not change, its lease is renewed, and its next decision reads the others'
load with ``refresh`` anyway; the first ``publish`` wakes the task again. ``publish`` and
``remove_endpoint`` only change local state and wake the task.

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

``stop()`` cancels the task and deletes this process's hash and live entry (best effort,
bounded by the client's timeouts).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable, Mapping

from adapters.redis.connection import RedisClient
from adapters.redis.script import LuaScript, guarded
from ports.metric_catalogue import SHARED_STATE_ERRORS
from ports.observer import NoopObserver, Observer
from ports.shared_state import EndpointLoad, SharedStateError, SharedStateReplyError

__all__ = [
    "DEFAULT_LEASE",
    "DEFAULT_REFRESH_BUDGET",
    "DEFAULT_STALENESS",
    "IDLE_AFTER",
    "IDLE_PERIOD",
    "RedisSharedLoad",
]

logger = logging.getLogger(__name__)

DEFAULT_LEASE = 10.0
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

# KEYS = live set, own hash; ARGV = own id, lease ms, process-hash key prefix, clear (0/1),
# number of own entries expected after the writes, number of pairs to set, pairs (endpoint,
# "r t"), then endpoints to delete.
# Reply: a status, then (endpoint, requests, tokens) triples of the other live processes.
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
if ARGV[4] == '1' then redis.call('DEL', KEYS[2]) end
local nset = tonumber(ARGV[6])
local i = 7
while nset > 0 do
  local n = math.min(nset, 500)
  write('HSET', KEYS[2], unpack(ARGV, i, i + 2 * n - 1))
  i = i + 2 * n
  nset = nset - n
end
while i <= #ARGV do
  local j = math.min(#ARGV, i + 999)
  redis.call('HDEL', KEYS[2], unpack(ARGV, i, j))
  i = j + 1
end
if status == 'ok' and redis.call('HLEN', KEYS[2]) ~= tonumber(ARGV[5]) then status = 'lost' end
redis.call('PEXPIRE', KEYS[2], lease)
write('ZADD', KEYS[1], now + lease, ARGV[1])
redis.call('PEXPIRE', KEYS[1], lease)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local ids = redis.call('ZRANGE', KEYS[1], 0, -1)
local req, tok, order = {}, {}, {}
for _, id in ipairs(ids) do
  if id ~= ARGV[1] then
    local flat = redis.call('HGETALL', ARGV[3] .. id)
    for j = 1, #flat, 2 do
      local r, k = string.match(flat[j + 1], '^(%d+) (%d+)$')
      if r then
        local ep = flat[j]
        if req[ep] == nil then req[ep] = 0; tok[ep] = 0; order[#order + 1] = ep end
        req[ep] = req[ep] + tonumber(r)
        tok[ep] = tok[ep] + tonumber(k)
      end
    end
  end
end
local out = {status}
for _, ep in ipairs(order) do
  out[#out + 1] = ep; out[#out + 1] = req[ep]; out[#out + 1] = tok[ep]
end
return out
""",
)


class RedisSharedLoad:
    """This process's in-flight totals published to Redis; the other processes' read back."""

    __slots__ = (
        "_active_at",
        "_client",
        "_copy",
        "_copy_at",
        "_degraded",
        "_dirty",
        "_idle_after",
        "_idle_period",
        "_lease",
        "_live_key",
        "_observer",
        "_on_degraded",
        "_own",
        "_own_key",
        "_process_id",
        "_process_prefix",
        "_refresh_budget",
        "_refused",
        "_republish",
        "_staleness",
        "_sync",
        "_task",
        "_wake",
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
        self._live_key = f"{key_prefix}:load:{{{key_prefix}}}:live"
        self._own: dict[str, EndpointLoad] = {}
        self._dirty: set[str] = set()
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
        self._idle_period = max(staleness, min(IDLE_PERIOD, lease / 4))
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
            pipe = self._client.pipeline(transaction=False)
            pipe.delete(self._own_key)
            pipe.zrem(self._live_key, self._process_id)
            await guarded("load withdraw", asyncio.wait_for(pipe.execute(), _STOP_TIMEOUT))
        except SharedStateError as error:
            logger.warning("could not withdraw this process's load from redis: %s", error)

    # Internals
    async def sync_once(self) -> None:
        """One round trip: write what changed, renew the lease, read the others' sum.
        Raises ``SharedStateError``; the background task calls it every ``staleness``.
        A refused write (out of memory) or a lost own hash (evicted) does not raise: the
        others' sum is still used, and everything is written again at the next call."""
        republish = self._republish
        dirty = list(self._own) if republish else list(self._dirty)
        self._dirty = set()
        self._republish = False
        pairs: list[str] = []
        deleted: list[str] = []
        for endpoint in dirty:
            load = self._own.get(endpoint)
            if load is None or (load.requests == 0 and load.tokens == 0):
                deleted.append(endpoint)
            else:
                pairs += (endpoint, f"{load.requests} {load.tokens}")
        held = sum(1 for load in self._own.values() if load.requests or load.tokens)
        args: list[str | int] = [
            self._process_id,
            max(1, round(self._lease * 1000)),
            self._process_prefix,
            1 if republish else 0,
            held,
            len(pairs) // 2,
            *pairs,
            *deleted,
        ]
        try:
            reply = await guarded(
                "load sync", _SYNC.run(self._client, [self._live_key, self._own_key], args)
            )
            status, copy = _parse_loads(reply)
        except BaseException:
            # Not written: write it again next time (everything, the store may be empty).
            self._republish = True
            raise
        self._copy = copy
        self._copy_at = time.monotonic()
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
        if not self._dirty:
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


def _parse_loads(reply: object) -> tuple[bytes, dict[str, EndpointLoad]]:
    """The script's status and the others' load; anything malformed is an error."""
    if not isinstance(reply, list) or len(reply) % 3 != 1 or not isinstance(reply[0], bytes):
        raise SharedStateReplyError(f"redis load sync: unexpected reply {reply!r:.100}")
    result: dict[str, EndpointLoad] = {}
    for i in range(1, len(reply), 3):
        name, requests, tokens = reply[i : i + 3]
        if not isinstance(name, bytes) or not isinstance(requests, int):
            raise SharedStateReplyError(f"redis load sync: unexpected reply {reply!r:.100}")
        if not isinstance(tokens, int) or requests < 0 or tokens < 0:
            raise SharedStateReplyError(f"redis load sync: unexpected reply {reply!r:.100}")
        try:
            result[name.decode()] = EndpointLoad(requests=requests, tokens=tokens)
        except UnicodeDecodeError as error:
            raise SharedStateReplyError(f"redis load sync: endpoint name {error}") from error
    return reply[0], result
