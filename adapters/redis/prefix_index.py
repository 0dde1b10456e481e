"""``RedisPrefixIndex``: the ``PrefixIndex`` port on a Redis server or a Redis Cluster.

Keys (``P`` is the pool's key prefix; hashes are written as 16 lower-case hex digits):

- ``P:c:{<root>}``: a hash per chain, block hash -> the block's holders, one
  ``"<ms> <endpoint>\n"`` line each (the time it was last sent that block), in the order
  they first held it. ``<root>`` is the first hash of the sequence given to
  ``match``/``add``: a chain's hashes each cover the whole prefix before them, so every
  block of one chain shares its root, and the hash tag ``{<root>}`` puts a chain in one
  cluster slot. The field ``~`` keeps ``"<fields> <ms>"`` of the key's last sweep (see
  *Bounds*). An endpoint name may not contain a newline.
- ``P:claims:{P:claims}``: a hash, endpoint name -> ``"<count> <ms>"``: how many new chains were
  claimed for it lately (decayed by half every ``CLAIM_HALF_LIFE``); it expires 20
  half-lives after the last claim.
- ``P:choice:{P:claims}:<root>`` (cluster only, in the counts' slot): a hash, ``endpoint`` -> the
  endpoint chosen for the new chain ``<root>``; it expires six half-lives after the choice.
- ``P:lru:{<endpoint>}``: a sorted set of ``<root>:<hash>`` members, scored by an add
  sequence number (the set's highest score plus 1, 2, ... for the hashes of one add, in
  order), so the lowest score is the least recently added. A sequence number, not a clock:
  it orders the blocks within one add and does not depend on the processes' clocks.

Every key gets a TTL (``ttl`` seconds) each time it is written. ``match`` ignores an entry
older than the TTL (its ms value), so an endpoint whose recency set expired is not matched
through a chain that other endpoints kept alive.

*Bounds.* A chain's key lives as long as some endpoint is sent its blocks. A write drops
the stale entries of the blocks it touches, and evictions take their endpoint out; an
entry whose eviction was lost (a recency set expired or evicted, a cluster follow-up that
failed) is swept: a write to a key of more than 128 fields drops every stale entry, and
the blocks left without one, when the key has more than twice the fields the last sweep
left or that sweep is older than the TTL.

*Earlier layout.* Versions before 2026-11-29 kept one hash per block
(``P:b:{<root>}:<hash>``). Nothing reads those keys; they expire within the TTL. Their
recency-set members have this layout's form (``<root>:<hash>``): evicting one takes the
endpoint out of a block of ``P:c:{<root>}`` that does not hold it, which changes nothing.

One round trip per call on a single server:

- ``match``: one script: one ``HMGET`` of the chain's blocks (per 500), then the walk
  (stop at the first block nobody holds, count per endpoint);
- ``add``: one script: read and write the blocks (one ``HMGET`` and one ``HSET`` per 500,
  one ``PEXPIRE``), push them on the endpoint's recency set, pop what is beyond
  ``capacity`` and take the endpoint out of those blocks (one ``HMGET`` and one ``HSET``
  or ``HDEL`` per chain they belong to);
- ``claim``: one script: the chain's owner when its first block is held (the walk of
  ``match``, the endpoint counting the most), otherwise ``add``'s writes for the least
  claimed lately of the endpoint and its alternates (``P:claims:{P:claims}``); atomic, so of several
  processes claiming one new chain at once exactly one writes it, and processes placing
  different new chains at once spread them;
- ``remove_endpoint``: one script (takes the endpoint out of every block of its set, then
  deletes the set).

On a cluster the recency set is in another slot than the chain, so ``add`` sends
two scripts at once, one to each slot's node (the chain; the recency set, which returns
the evicted members), then takes the endpoint out of the evicted blocks with one script
per chain they belong to, sent together. A chain is one key, declared by every call on
it: while its slot migrates it is on the old node or the new one, never split, and the
calls follow ``ASK`` and ``MOVED``. ``claim`` sends the chain's node the walk-or-write
script, then,
when it wrote, the endpoint's node the recency push (two or three round trips on a cluster,
one on a single server). With alternates, a cluster first sends the claim counts' node
the choice (the counts are one key, in another slot than the chain): one more round trip.
The counts' node keeps the choice made for each new chain, so processes claiming one
chain at once get the first one's choice, counted once, and a claim whose chain was chosen
for endpoints it may not use counts its own choice only if it writes the chain; a claim
that finds the chain held by another endpoint than the one it counted takes its count
back: only the owner's claim counts, as on one server, also while claims are in flight.
``claim_owner`` (``StagedClaimingPrefixIndex``) returns the owner once the chain's node
answered and leaves the recency push and the count's correction to the caller, which
runs them after the reply to Envoy: a cluster's claim then delays its request by one
round trip, or two with alternates.
``remove_endpoint`` reads the set, then sends the removals, one script per chain.
Those follow-ups are not atomic with the add: an endpoint re-added to a block by another
process between the two steps can lose that block's entry (it is then matched a little
less until it is added again). The add runs after the reply to Envoy, off the routing path.

Semantics are the in-memory index's (``domain.prefixcache.InMemoryPrefixIndex``) for the
sequences the prefix plugin sends, which always start at the chain's root. A sequence that
starts elsewhere is keyed under its own first hash. ``size()`` is -1 (unknown).

Every failure (connection refused or lost, timeout, an error reply, a reply of the wrong
shape) is raised as ``ports.shared_state.SharedStateError``: ``SharedStateReplyError`` when
the server answered this call with an error or garbage, ``SharedStateWriteRefusedError`` when it
is out of memory (``OOM``, under ``noeviction``).
"""

from __future__ import annotations

import asyncio
import functools
import struct
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from typing import Any

from redis.asyncio.cluster import RedisCluster

from adapters.redis.connection import RedisClient
from adapters.redis.script import LuaScript, guarded
from ports.prefix_index import CLAIM_HALF_LIFE
from ports.shared_state import SharedStateReplyError

__all__ = ["DEFAULT_PREFIX_TTL", "RedisPrefixIndex"]

#: Seconds a block or recency set lives after its last write.
DEFAULT_PREFIX_TTL = 3600.0

# Hashes travel as one argument, each hash as 16 hex digits (``packed``): a few µs of client
# CPU for a 256-block chain, where one argument per hash cost the client more than the round
# trip. Every block of a chain is a field of the chain's one key.
_SPLIT = """
local function split(packed)
  local out = {}
  for i = 1, #packed, 16 do out[#out + 1] = string.sub(packed, i, i + 15) end
  return out
end
"""

# A block's value lists its holders, one "<ms> <endpoint>\n" entry each, in the order they
# first held it. ``entries`` calls ``fn(ms, endpoint)`` for each; ``rewrite`` returns the
# value with the stale entries (older than ``cutoff``) dropped and ``ep``'s entry set to
# ``now`` (in place, or appended; ``now`` false: removed); '' when no entry is left.
# ``touch`` and ``without`` do the same for ``ep`` alone, without parsing the other
# entries when ``ep``'s is found as a whole 13-digit entry or not at all (the sweep drops
# the stale ones). The fields are read ``CHUNK`` at a time (``HMGET``'s arguments stay few).
_ENTRIES = """
local CHUNK = 500
local function entries(value, fn)
  for at, name in string.gmatch(value, '(%d+) ([^\\n]*)\\n') do fn(tonumber(at), name) end
end
local function rewrite(value, ep, now, cutoff)
  local out, seen = {}, false
  if value then
    entries(value, function(at, name)
      if name == ep then
        seen = true
        if now then out[#out + 1] = now .. ' ' .. ep .. '\\n' end
      elseif at >= cutoff then
        out[#out + 1] = at .. ' ' .. name .. '\\n'
      end
    end)
  end
  if now and not seen then out[#out + 1] = now .. ' ' .. ep .. '\\n' end
  return table.concat(out)
end
-- Where ``ep``'s entry starts in ``value``: nil when it has none, false when it cannot
-- tell without parsing (a name ending in " <ep>", a time not of 13 digits).
local function find(value, ep)
  local at = string.find(value, ' ' .. ep .. '\\n', 1, true)
  if at == nil then return nil end
  if at < 14 or (at > 14 and string.byte(value, at - 14) ~= 10) then return false end
  if string.find(string.sub(value, at - 13, at - 1), '%D') then return false end
  return at - 13
end
local function touch(value, ep, now, cutoff)
  if not value or value == '' then return now .. ' ' .. ep .. '\\n' end
  local at = find(value, ep)
  if at == nil then return value .. now .. ' ' .. ep .. '\\n' end
  if at == false then return rewrite(value, ep, now, cutoff) end
  return string.sub(value, 1, at - 1) .. now .. string.sub(value, at + 13)
end
local function without(value, ep, cutoff)
  local at = find(value, ep)
  if at == nil then return value end
  if at == false then return rewrite(value, ep, false, cutoff) end
  return string.sub(value, 1, at - 1) .. string.sub(value, at + 15 + #ep)
end
-- ``fn(i, value)`` for the fields ``hashes`` of ``key`` in order, until it returns false.
local function each_field(key, hashes, fn)
  local n = #hashes
  for first = 1, n, CHUNK do
    local last = math.min(n, first + CHUNK - 1)
    local values = redis.call('HMGET', key, unpack(hashes, first, last))
    for k = 1, last - first + 1 do
      if fn(first + k - 1, values[k]) == false then return end
    end
  end
end
"""

# Walk the chain's blocks in order, stop at the first block no fresh entry holds, count per
# endpoint: returns the endpoints in the order first seen and their counts.
_WALK = """
local function walk(key, hashes, cutoff)
  local counts, order = {}, {}
  each_field(key, hashes, function(_, value)
    local held = false
    if value then
      entries(value, function(at, ep)
        if at >= cutoff then
          held = true
          local c = counts[ep]
          if c then counts[ep] = c + 1 else counts[ep] = 1; order[#order + 1] = ep end
        end
      end)
    end
    return held
  end)
  return order, counts
end
local function best(order, counts)
  local top, most = false, 0
  for _, ep in ipairs(order) do
    if counts[ep] > most then top = ep; most = counts[ep] end
  end
  return top
end
"""

# Write ``ep`` into the blocks ``hashes`` of the chain ``key`` (one HMGET and one HSET per
# ``CHUNK`` blocks, one PEXPIRE), or take it out of them (``drop``). A chain's key holds the
# blocks any endpoint was sent lately; a block whose holders all went stale without being
# evicted (a recency set that expired or was lost) would stay while the chain is written.
# So a write to a key of more than ``SWEEP_FLOOR`` fields sweeps it (drops every stale
# entry, and the blocks left without one) when it has more fields than twice what the last
# sweep left, or the last sweep is older than the TTL; the field "~" keeps "<fields left>
# <ms>" of the last sweep. A sweep's cost is paid by as many writes, or once per TTL.
_WRITE_BLOCKS = """
local SWEEP_FLOOR = 128
local function apply(key, sets, dels)
  for j = 1, #dels, CHUNK do
    redis.call('HDEL', key, unpack(dels, j, math.min(#dels, j + CHUNK - 1)))
  end
  for j = 1, #sets, 2 * CHUNK do
    redis.call('HSET', key, unpack(sets, j, math.min(#sets, j + 2 * CHUNK - 1)))
  end
end
local function sweep(key, now, cutoff)
  local n = redis.call('HLEN', key)
  if n <= SWEEP_FLOOR then return end
  local last, at = string.match(redis.call('HGET', key, '~') or '', '^(%d+) (%d+)$')
  if last and n <= 2 * tonumber(last) and tonumber(at) >= cutoff then return end
  local flat = redis.call('HGETALL', key)
  local sets, dels, left = {}, {}, 0
  for j = 1, #flat, 2 do
    local field, value = flat[j], flat[j + 1]
    if field ~= '~' then
      local kept = rewrite(value, false, false, cutoff)
      if kept == '' then dels[#dels + 1] = field
      else
        left = left + 1
        if kept ~= value then sets[#sets + 1] = field; sets[#sets + 1] = kept end
      end
    end
  end
  apply(key, sets, dels)
  redis.call('HSET', key, '~', left .. ' ' .. now)
end
local function write_blocks(key, hashes, ep, now, ttl, cutoff)
  if #hashes == 0 then return end
  local batch = {}
  each_field(key, hashes, function(i, value)
    batch[#batch + 1] = hashes[i]
    batch[#batch + 1] = touch(value, ep, now, cutoff)
    if #batch >= 2 * CHUNK then redis.call('HSET', key, unpack(batch)); batch = {} end
  end)
  if #batch > 0 then redis.call('HSET', key, unpack(batch)) end
  sweep(key, now, cutoff)
  redis.call('PEXPIRE', key, ttl)
end
local function drop(key, hashes, ep, cutoff)
  local sets, dels = {}, {}
  each_field(key, hashes, function(i, value)
    if value then
      local kept = without(value, ep, cutoff)
      if kept == '' then dels[#dels + 1] = hashes[i]
      elseif kept ~= value then sets[#sets + 1] = hashes[i]; sets[#sets + 1] = kept end
    end
  end)
  apply(key, sets, dels)
end
-- Take ``ep`` out of the blocks named by recency-set members "<root>:<hash>", one chain at
-- a time (``prefix`` .. ':c:{' .. root .. '}').
local function forget(prefix, members, ep, cutoff)
  local by_root, roots = {}, {}
  for _, m in ipairs(members) do
    local r, h = string.match(m, '^(%x+):(%x+)$')
    if r then
      if by_root[r] == nil then by_root[r] = {}; roots[#roots + 1] = r end
      local hs = by_root[r]
      hs[#hs + 1] = h
    end
  end
  for _, r in ipairs(roots) do drop(prefix .. ':c:{' .. r .. '}', by_root[r], ep, cutoff) end
end
"""

# KEYS = the chain key; ARGV = cutoff ms, packed hashes.
_MATCH = LuaScript(
    "prefix-match",
    _SPLIT
    + _ENTRIES
    + _WALK
    + """
local order, counts = walk(KEYS[1], split(ARGV[2]), tonumber(ARGV[1]))
local out = {}
for k = 1, #order do out[2 * k - 1] = order[k]; out[2 * k] = counts[order[k]] end
return out
""",
)

# Push "<root>:<hash>" members on a recency set, pop beyond capacity, return the popped ones.
_LRU_PUSH = """
local function lru_push(lru, capacity, ttl, root, hashes)
  if #hashes > 0 then
    local top = redis.call('ZRANGE', lru, -1, -1, 'WITHSCORES')
    local seq = 0
    if #top == 2 then seq = tonumber(top[2]) end
    local batch = {}
    for _, h in ipairs(hashes) do
      seq = seq + 1
      batch[#batch + 1] = seq
      batch[#batch + 1] = root .. ':' .. h
      if #batch >= 1000 then redis.call('ZADD', lru, unpack(batch)); batch = {} end
    end
    if #batch > 0 then redis.call('ZADD', lru, unpack(batch)) end
  end
  local evicted = {}
  local n = redis.call('ZCARD', lru)
  if n > capacity then
    local popped = redis.call('ZPOPMIN', lru, n - capacity)
    for i = 1, #popped, 2 do evicted[#evicted + 1] = popped[i] end
  end
  if n > 0 then redis.call('PEXPIRE', lru, ttl) end
  return evicted
end
"""

# Single server: KEYS = lru, the chain key; ARGV = endpoint, now ms, ttl ms, capacity, key
# prefix P, root, packed hashes.
_ADD_ONE_NODE = LuaScript(
    "prefix-add",
    _SPLIT
    + _ENTRIES
    + _LRU_PUSH
    + _WRITE_BLOCKS
    + """
local ep, now, ttl, capacity = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local hashes = split(ARGV[7])
write_blocks(KEYS[2], hashes, ep, now, ttl, now - ttl)
local evicted = lru_push(KEYS[1], capacity, ttl, ARGV[6], hashes)
forget(ARGV[5], evicted, ep, now - ttl)
return #evicted
""",
)

# Cluster, the chain's node: KEYS = the chain key; ARGV = endpoint, now ms, ttl ms, packed
# hashes. The chain is one key, declared: while its slot migrates, Redis
# answers ASK for it (moved already) or serves it (not yet), and never lets the script
# create, on the importing node, a key the old node still holds.
_ADD_BLOCKS = LuaScript(
    "prefix-add-blocks",
    _SPLIT
    + _ENTRIES
    + _WRITE_BLOCKS
    + """
local now, ttl = tonumber(ARGV[2]), tonumber(ARGV[3])
local hashes = split(ARGV[4])
write_blocks(KEYS[1], hashes, ARGV[1], now, ttl, now - ttl)
return #hashes
""",
)

# Cluster, the chain's node: KEYS = the chain key; ARGV = endpoint, cutoff ms, packed
# hashes: the endpoint taken out of those blocks (evicted from its recency set).
_DROP_BLOCKS = LuaScript(
    "prefix-drop-blocks",
    _SPLIT
    + _ENTRIES
    + _WRITE_BLOCKS
    + """
local hashes = split(ARGV[3])
drop(KEYS[1], hashes, ARGV[1], tonumber(ARGV[2]))
return #hashes
""",
)

# Cluster, the endpoint's node: KEYS = lru; ARGV = capacity, ttl ms, root, packed hashes.
_ADD_LRU = LuaScript(
    "prefix-add-lru",
    _SPLIT
    + _LRU_PUSH
    + """
return lru_push(KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3], split(ARGV[4]))
""",
)

# Of ``ep`` and the newline-separated ``others``, the one with the lowest claim count in the
# hash ``counts`` (endpoint -> "<count> <ms>", halving every ``half_life`` ms; ``ep`` wins a
# tie within a thousandth), and that count (``least_of``); ``least_claimed`` also counts it
# as claimed once more. ``recount`` adds ``delta`` to an endpoint's count (at least 0).
_LEAST_CLAIMED = """
local function decayed(stored, now, half_life)
  local c, at = string.match(stored or '', '^(%S+) (%S+)$')
  if not c then return 0 end
  return tonumber(c) * 0.5 ^ (math.max(0, now - tonumber(at)) / half_life)
end
local function least_of(counts, ep, others, now, half_life)
  local choices = {ep}
  for name in string.gmatch(others, '[^\\n]+') do
    if name ~= ep then choices[#choices + 1] = name end
  end
  local stored = redis.call('HMGET', counts, unpack(choices))
  local pick, least = 1, nil
  for i, _ in ipairs(choices) do
    local count = decayed(stored[i], now, half_life)
    if least == nil or count < least - 0.001 then pick, least = i, count end
  end
  return choices[pick], least
end
local function store(counts, ep, count, now, half_life)
  redis.call('HSET', counts, ep, string.format('%.6f %d', math.max(0, count), now))
  redis.call('PEXPIRE', counts, 20 * half_life)
end
local function least_claimed(counts, ep, others, now, half_life)
  local pick, least = least_of(counts, ep, others, now, half_life)
  store(counts, pick, least + 1, now, half_life)
  return pick
end
local function recount(counts, ep, delta, now, half_life)
  local count = decayed(redis.call('HGET', counts, ep), now, half_life)
  store(counts, ep, count + delta, now, half_life)
end
"""

# Cluster, the claim counts' node: KEYS = claim counts, the chain's choice; ARGV = endpoint,
# now ms, half-life ms, alternates (newline-separated), the choice's lifetime ms. The chosen
# endpoint, and how:
# - 0: the choice made for this chain earlier (by any process), one of these endpoints:
#   not counted again;
# - 1: no choice made for this chain: the least claimed, counted, kept as its choice;
# - 2: a choice made for this chain, not one of these endpoints: the least claimed, not
#   counted (the chain is most likely held: count it only if its claim writes it).
_CHOOSE = LuaScript(
    "prefix-choose",
    _LEAST_CLAIMED
    + """
local ep, others, now, half_life = ARGV[1], ARGV[4], tonumber(ARGV[2]), tonumber(ARGV[3])
local chosen = redis.call('HGET', KEYS[2], 'endpoint')
if chosen then
  if chosen == ep then return {chosen, 0} end
  for name in string.gmatch(others, '[^\\n]+') do
    if name == chosen then return {chosen, 0} end
  end
  local pick = least_of(KEYS[1], ep, others, now, half_life)
  return {pick, 2}
end
local pick = least_claimed(KEYS[1], ep, others, now, half_life)
redis.call('HSET', KEYS[2], 'endpoint', pick)
redis.call('PEXPIRE', KEYS[2], tonumber(ARGV[5]))
return {pick, 1}
""",
)

# Cluster, the claim counts' node: KEYS = claim counts; ARGV = endpoint, now ms, half-life
# ms, delta (1 or -1). Counts one claim more or fewer for the endpoint: a claim that found
# the chain held by another endpoint than its counted choice takes it back; one whose
# choice was not counted (the chain had been chosen for another endpoint) and that wrote
# the chain counts it.
_RECOUNT = LuaScript(
    "prefix-recount",
    _LEAST_CLAIMED
    + """
recount(KEYS[1], ARGV[1], tonumber(ARGV[4]), tonumber(ARGV[2]), tonumber(ARGV[3]))
return 1
""",
)

# Single server: KEYS = lru, claim counts, the chain key; ARGV = endpoint, now ms, ttl ms,
# capacity, key prefix P, root, packed hashes, cutoff ms, half-life ms, alternates
# (newline-separated). The chain's owner if its first block is held, else the add for the
# least claimed of the endpoint and its alternates (a count per endpoint, "<count> <ms>",
# halving every half-life; the endpoint wins a tie).
_CLAIM_ONE_NODE = LuaScript(
    "prefix-claim",
    _SPLIT
    + _ENTRIES
    + _WALK
    + _LRU_PUSH
    + _WRITE_BLOCKS
    + _LEAST_CLAIMED
    + """
local ep, now, ttl, capacity = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local hashes = split(ARGV[7])
local owner = best(walk(KEYS[3], hashes, tonumber(ARGV[8])))
if owner then return owner end
local lru = KEYS[1]
ep = least_claimed(KEYS[2], ep, ARGV[10], now, tonumber(ARGV[9]))
if ep ~= ARGV[1] then lru = ARGV[5] .. ':lru:{' .. ep .. '}' end
write_blocks(KEYS[3], hashes, ep, now, ttl, now - ttl)
local evicted = lru_push(lru, capacity, ttl, ARGV[6], hashes)
forget(ARGV[5], evicted, ep, now - ttl)
return ep
""",
)

# Cluster, the chain's node: KEYS = the chain key; ARGV = endpoint, now ms, ttl ms, cutoff
# ms, packed hashes. The chain's owner and 0 if its first block is held (by that
# endpoint too), else the blocks' write and the endpoint and 1.
_CLAIM_BLOCKS = LuaScript(
    "prefix-claim-blocks",
    _SPLIT
    + _ENTRIES
    + _WALK
    + _WRITE_BLOCKS
    + """
local ep, now, ttl = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local hashes = split(ARGV[5])
local owner = best(walk(KEYS[1], hashes, tonumber(ARGV[4])))
if owner then return {owner, 0} end
write_blocks(KEYS[1], hashes, ep, now, ttl, now - ttl)
return {ep, 1}
""",
)

# Single server: KEYS = lru; ARGV = endpoint, key prefix P, cutoff ms.
_REMOVE_ONE_NODE = LuaScript(
    "prefix-remove",
    _SPLIT
    + _ENTRIES
    + _WRITE_BLOCKS
    + """
local members = redis.call('ZRANGE', KEYS[1], 0, -1)
forget(ARGV[2], members, ARGV[1], tonumber(ARGV[3]))
redis.call('DEL', KEYS[1])
return #members
""",
)

#: Chains whose evicted blocks one round of a cluster's eviction takes out at once.
_PIPELINE_CHUNK = 1000
_HALF_LIFE_MS = round(CLAIM_HALF_LIFE * 1000)
# How long a cluster remembers the choice made for a new chain: six half-lives, so a claim
# of a chain already placed (its first requests came together, or a process missed its
# match) does not count it again while the first count still weighs (1/64 after that).
_CHOICE_MS = 6 * _HALF_LIFE_MS
# How a cluster's choice was made (``_CHOOSE``).
_FOLLOWED, _COUNTED, _UNCOUNTED = 0, 1, 2
_CHOICE_KINDS = (_FOLLOWED, _COUNTED, _UNCOUNTED)


class RedisPrefixIndex:
    """A ``PrefixIndex`` shared by every EPP process using the same Redis and key prefix."""

    __slots__ = ("_client", "_cluster", "_prefix", "_ttl_ms")

    def __init__(
        self, client: RedisClient, *, key_prefix: str, ttl: float = DEFAULT_PREFIX_TTL
    ) -> None:
        if not key_prefix or "{" in key_prefix or "}" in key_prefix:
            raise ValueError(f"key prefix must be non-empty, without braces: {key_prefix!r}")
        if ttl <= 0:
            raise ValueError(f"ttl must be positive, got {ttl}")
        self._client = client
        self._cluster = isinstance(client, RedisCluster)
        self._prefix = key_prefix
        self._ttl_ms = max(1, round(ttl * 1000))

    # Keys
    def chain_key(self, root: int) -> str:
        """The hash of the chain whose first hash is ``root``: block hash -> its holders."""
        return self._chain_key(f"{root:016x}")

    def _chain_key(self, root: str) -> str:
        return f"{self._prefix}:c:{{{root}}}"

    def lru_key(self, endpoint: str) -> str:
        return f"{self._prefix}:lru:{{{endpoint}}}"

    def claims_key(self) -> str:
        return f"{self._prefix}:claims:{{{self._prefix}:claims}}"

    def choice_key(self, root: str) -> str:
        """The choice made for the new chain ``root`` (in the claim counts' slot)."""
        return f"{self._prefix}:choice:{{{self._prefix}:claims}}:{root}"

    # PrefixIndex port
    async def match(self, hashes: Sequence[int]) -> Mapping[str, int]:
        if not hashes:
            return {}
        key = self._chain_key(f"{hashes[0]:016x}")
        args = (_now_ms() - self._ttl_ms, _pack(hashes))
        reply = await guarded("prefix match", _MATCH.run(self._client, [key], args))
        return _parse_counts(reply)

    async def add(self, hashes: Sequence[int], endpoint: str, capacity: int) -> None:
        root = f"{hashes[0]:016x}" if hashes else "0" * 16
        await self._add(root, _pack(hashes), endpoint, capacity)

    async def add_tail(
        self, hashes: Sequence[int], held: int, endpoint: str, capacity: int
    ) -> None:
        if not 0 <= held < len(hashes):
            raise ValueError(f"held must be in [0, {len(hashes)}), got {held}")
        await self._add(f"{hashes[0]:016x}", _pack(hashes[held:]), endpoint, capacity)

    async def _add(self, root: str, packed: str, endpoint: str, capacity: int) -> None:
        """Write the blocks ``packed`` of the chain ``root`` for ``endpoint``."""
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        _check_name(endpoint)
        lru = self.lru_key(endpoint)
        chain = self._chain_key(root)
        now = _now_ms()
        if not self._cluster:
            args = (endpoint, now, self._ttl_ms, capacity, self._prefix, root, packed)
            reply = await guarded("prefix add", _ADD_ONE_NODE.run(self._client, [lru, chain], args))
            if not isinstance(reply, int):
                raise SharedStateReplyError(f"redis prefix add: unexpected reply {reply!r:.100}")
            return
        calls = [_ADD_LRU.run(self._client, [lru], (capacity, self._ttl_ms, root, packed))]
        if packed:
            write = (endpoint, now, self._ttl_ms, packed)
            calls.append(_ADD_BLOCKS.run(self._client, [chain], write))
        replies = await guarded("prefix add", _gather(calls))
        evicted = _members("prefix add", replies[0])
        if evicted:
            await self._forget(endpoint, evicted)

    async def claim(
        self,
        hashes: Sequence[int],
        endpoint: str,
        capacity: int,
        alternates: Sequence[str] = (),
    ) -> str:
        owner, rest = await self.claim_owner(hashes, endpoint, capacity, alternates)
        if rest is not None:
            await rest()
        return owner

    async def claim_owner(
        self,
        hashes: Sequence[int],
        endpoint: str,
        capacity: int,
        alternates: Sequence[str] = (),
    ) -> tuple[str, Callable[[], Awaitable[None]] | None]:
        if not hashes:
            raise ValueError("claim needs at least one hash")
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        _check_name(endpoint)
        root = f"{hashes[0]:016x}"
        chain = self._chain_key(root)
        packed = _pack(hashes)
        now = _now_ms()
        cutoff = now - self._ttl_ms
        others = "\n".join(a for a in alternates if a != endpoint and "\n" not in a)
        if not self._cluster:
            args = (
                endpoint,
                now,
                self._ttl_ms,
                capacity,
                self._prefix,
                root,
                packed,
                cutoff,
                _HALF_LIFE_MS,
                others,
            )
            keys = [self.lru_key(endpoint), self.claims_key(), chain]
            reply = await guarded("prefix claim", _CLAIM_ONE_NODE.run(self._client, keys, args))
            return _owner(reply), None
        # The claim counts are in another slot than the chain: with alternates the choice
        # is made first, then claimed; without, the choice (of the endpoint itself) goes
        # out with the claim. Processes claiming one new chain at once (its first requests
        # come together) get the first one's choice, counted once; a claim's count is then
        # set right for what it found: only the owner's claim counts, as on one server.
        choose = _CHOOSE.run(
            self._client,
            [self.claims_key(), self.choice_key(root)],
            (endpoint, now, _HALF_LIFE_MS, others, _CHOICE_MS),
        )
        if others:
            endpoint, how = _chosen(await guarded("prefix claim", choose))
        claim = _CLAIM_BLOCKS.run(
            self._client, [chain], (endpoint, now, self._ttl_ms, cutoff, packed)
        )
        if others:
            owner, won = _claimed(await guarded("prefix claim", claim))
        else:
            replies = await guarded("prefix claim", _gather([claim, choose]))
            owner, won = _claimed(replies[0])
            how = _chosen(replies[1])[1]  # the endpoint itself, the only choice
        delta = -1 if how == _COUNTED and owner != endpoint else 0
        if how == _UNCOUNTED and won:
            delta = 1
        if not delta and not won:
            return owner, None
        # What is left goes out after the owner is known (the request need not wait for
        # it): the count set right, and the won chain pushed on the recency set (on
        # another node; pushing it with the claim would count blocks of a lost claim
        # against the capacity), which returns what it evicts.
        rest = functools.partial(
            self._claim_rest, root, packed, endpoint, capacity if won else 0, delta
        )
        return owner, rest

    async def _claim_rest(
        self, root: str, packed: str, endpoint: str, capacity: int, delta: int
    ) -> None:
        """A cluster claim's last writes: ``delta`` added to the endpoint's claim count
        (unless 0), and, when it won (``capacity`` > 0), the chain's recency push and the
        evictions it makes."""
        calls: list[Coroutine[Any, Any, object]] = []
        if capacity:
            lru = self.lru_key(endpoint)
            calls.append(_ADD_LRU.run(self._client, [lru], (capacity, self._ttl_ms, root, packed)))
        if delta:
            args = (endpoint, _now_ms(), _HALF_LIFE_MS, delta)
            calls.append(_RECOUNT.run(self._client, [self.claims_key()], args))
        replies = await guarded("prefix claim", _gather(calls))
        if capacity:
            evicted = _members("prefix claim", replies[0])
            if evicted:
                await self._forget(endpoint, evicted)

    async def remove_endpoint(self, endpoint: str) -> None:
        lru = self.lru_key(endpoint)
        if not self._cluster:
            await guarded(
                "prefix remove",
                _REMOVE_ONE_NODE.run(
                    self._client, [lru], [endpoint, self._prefix, _now_ms() - self._ttl_ms]
                ),
            )
            return
        reply = await guarded("prefix remove", self._client.zrange(lru, 0, -1))
        members = _members("prefix remove", reply)
        await self._forget(endpoint, members)
        await guarded("prefix remove", self._client.delete(lru))

    def size(self) -> int:
        return -1

    # Internals
    async def _forget(self, endpoint: str, members: Sequence[bytes]) -> None:
        """Take ``endpoint`` out of the blocks named by recency-set ``members`` (cluster: one
        script per chain, sent together; a chain's blocks are one key)."""
        by_root: dict[str, list[str]] = {}
        for member in members:
            root, sep, block = member.decode("ascii", "replace").partition(":")
            if sep and len(block) == 16:
                by_root.setdefault(root, []).append(block)
        cutoff = _now_ms() - self._ttl_ms
        chains = list(by_root.items())
        for start in range(0, len(chains), _PIPELINE_CHUNK):
            calls = [
                _DROP_BLOCKS.run(
                    self._client, [self._chain_key(root)], (endpoint, cutoff, "".join(blocks))
                )
                for root, blocks in chains[start : start + _PIPELINE_CHUNK]
            ]
            await guarded("prefix evict", _gather(calls))


async def _gather(calls: list[Coroutine[Any, Any, object]]) -> list[object]:
    return list(await asyncio.gather(*calls))


def _check_name(endpoint: str) -> None:
    """An endpoint name is stored as one line of a block's value."""
    if "\n" in endpoint:
        raise ValueError(f"endpoint name must not contain a newline: {endpoint!r:.100}")


def _pack(hashes: Sequence[int]) -> str:
    """The hashes as one string, 16 hex digits each."""
    return struct.pack(f">{len(hashes)}Q", *hashes).hex()


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def _members(operation: str, reply: object) -> list[bytes]:
    """A list of recency-set members, or ``SharedStateError``."""
    if isinstance(reply, list):
        members = [m for m in reply if isinstance(m, bytes)]
        if len(members) == len(reply):
            return members
    raise SharedStateReplyError(f"redis {operation}: unexpected reply {reply!r:.100}")


def _claimed(reply: object) -> tuple[str, bool]:
    """A cluster claim's reply: the chain's owner, and whether this claim wrote it."""
    if isinstance(reply, list) and len(reply) == 2 and reply[1] in (0, 1):
        return _owner(reply[0]), reply[1] == 1
    raise SharedStateReplyError(f"redis prefix claim: unexpected reply {reply!r:.100}")


def _chosen(reply: object) -> tuple[str, int]:
    """A cluster choice's reply: the endpoint chosen, and how (``_CHOOSE``)."""
    if isinstance(reply, list) and len(reply) == 2 and reply[1] in _CHOICE_KINDS:
        return _owner(reply[0]), reply[1]
    raise SharedStateReplyError(f"redis prefix claim: unexpected reply {reply!r:.100}")


def _owner(reply: object) -> str:
    """A claim's reply: the endpoint name that owns the chain."""
    if isinstance(reply, bytes) and reply:
        try:
            return reply.decode()
        except UnicodeDecodeError as error:
            raise SharedStateReplyError(f"redis prefix claim: endpoint name {error}") from error
    raise SharedStateReplyError(f"redis prefix claim: unexpected reply {reply!r:.100}")


def _parse_counts(reply: object) -> dict[str, int]:
    """``[name, count, name, count, ...]`` → ``{name: count}``; anything else is an error."""
    if not isinstance(reply, list) or len(reply) % 2:
        raise SharedStateReplyError(f"redis prefix match: unexpected reply {reply!r:.100}")
    result: dict[str, int] = {}
    for i in range(0, len(reply), 2):
        name, count = reply[i], reply[i + 1]
        if not isinstance(name, bytes) or not isinstance(count, int) or count <= 0:
            raise SharedStateReplyError(f"redis prefix match: unexpected reply {reply!r:.100}")
        try:
            result[name.decode()] = count
        except UnicodeDecodeError as error:
            raise SharedStateReplyError(f"redis prefix match: endpoint name {error}") from error
    return result
