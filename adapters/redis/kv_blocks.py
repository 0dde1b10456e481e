"""``RedisKVBlockStore``: the ``KVBlockStore`` port on Redis (a single server or a cluster).

Per endpoint three keys sharing one hash tag, a 64-bit BLAKE2b of the endpoint's name
(``{<tag>}``), so one endpoint's keys are in one cluster slot and every call is one script
on one node:

- ``P:kv:{<tag>}:b``: a hash, block hash (decimal) → its tiers, comma-separated
  (``GPU``, ``GPU,CPU``);
- ``P:kv:{<tag>}:o``: a sorted set of the same block hashes scored by a store sequence
  number (oldest first): the cap pops the lowest;
- ``P:kv:{<tag>}:w``: the writer lease, a hash ``owner → <name>`` with the lease as its
  expiry; ``release`` swaps ``owner`` for ``released`` (free to claim, the copy still
  ``current`` until the key expires one lease later).

``apply`` sends one batch's events as one script (``S medium n h...``, ``R medium n h...``,
``C``); ``replace`` clears and re-stores in scripts of at most ``chunk`` hashes; ``blocks``
reads pages of ``chunk``; ``current`` is whether the lease key exists (``HLEN``);
``claim`` takes or renews the lease and renews the copy's TTL (``ttl``, so a copy
outlives its last writer by that long). Any failure raises
``SharedStateError`` (``guarded``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from adapters.redis.connection import RedisClient
from adapters.redis.script import LuaScript, guarded
from ports.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, StoredBlock
from ports.shared_state import SharedStateReplyError

__all__ = ["RedisKVBlockStore"]

DEFAULT_MEDIUM = "GPU"

_APPLY = LuaScript(
    "kv apply",
    """
local b, o = KEYS[1], KEYS[2]
local cap = tonumber(ARGV[1])
local ttl = tonumber(ARGV[2])
local top = redis.call('ZRANGE', o, -1, -1, 'WITHSCORES')
local seq = 0
if top[2] then seq = tonumber(top[2]) end
local i, n = 3, #ARGV
while i <= n do
  local op = ARGV[i]
  if op == 'C' then
    redis.call('DEL', b, o)
    i = i + 1
  else
    local medium = ARGV[i + 1]
    local last = i + 2 + tonumber(ARGV[i + 2])
    for j = i + 3, last do
      local h = ARGV[j]
      local t = redis.call('HGET', b, h)
      if op == 'S' then
        if not t then
          redis.call('HSET', b, h, medium)
        else
          local found = false
          for m in string.gmatch(t, '[^,]+') do
            if m == medium then found = true end
          end
          if not found then redis.call('HSET', b, h, t .. ',' .. medium) end
        end
        seq = seq + 1
        redis.call('ZADD', o, seq, h)
      elseif t then
        local rest = {}
        for m in string.gmatch(t, '[^,]+') do
          if m ~= medium then rest[#rest + 1] = m end
        end
        if #rest == 0 then
          redis.call('HDEL', b, h)
          redis.call('ZREM', o, h)
        else
          redis.call('HSET', b, h, table.concat(rest, ','))
        end
      end
    end
    i = last + 1
  end
end
local over = redis.call('ZCARD', o) - cap
if over > 0 then
  local popped = redis.call('ZPOPMIN', o, over)
  for k = 1, #popped, 2 do redis.call('HDEL', b, popped[k]) end
end
if redis.call('ZCARD', o) > 0 then
  redis.call('PEXPIRE', b, ttl)
  redis.call('PEXPIRE', o, ttl)
end
return 1
""",
)

_CLAIM = LuaScript(
    "kv claim",
    """
local w, b, o = KEYS[1], KEYS[2], KEYS[3]
local current = redis.call('HGET', w, 'owner')
if current and current ~= ARGV[1] then return -1 end
redis.call('HDEL', w, 'released')
redis.call('HSET', w, 'owner', ARGV[1])
redis.call('PEXPIRE', w, ARGV[2])
local copy = redis.call('ZCARD', o)
if copy > 0 then
  redis.call('PEXPIRE', b, ARGV[3])
  redis.call('PEXPIRE', o, ARGV[3])
end
if current and copy > 0 then return 0 end
return 1
""",
)

_RELEASE = LuaScript(
    "kv release",
    """
local w = KEYS[1]
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then return 0 end
redis.call('HDEL', w, 'owner')
redis.call('HSET', w, 'released', ARGV[1])
redis.call('PEXPIRE', w, ARGV[2])
return 1
""",
)

_PAGE = LuaScript(
    "kv blocks",
    """
local b, o = KEYS[1], KEYS[2]
local limit, offset, count = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local card = redis.call('ZCARD', o)
local first = card - limit
if first < 0 then first = 0 end
first = first + offset
local last = first + count - 1
if last > card - 1 then last = card - 1 end
if first > last then return {} end
local hashes = redis.call('ZRANGE', o, first, last)
local out = {}
for k = 1, #hashes do
  out[#out + 1] = hashes[k]
  out[#out + 1] = redis.call('HGET', b, hashes[k]) or ''
end
return out
""",
)


class RedisKVBlockStore:
    """The pool's KV-block copy on Redis; see the module docstring."""

    def __init__(
        self, client: RedisClient, *, key_prefix: str, ttl: float = 3600.0, chunk: int = 4096
    ) -> None:
        if ttl <= 0 or chunk < 1:
            raise ValueError("ttl must be > 0, chunk >= 1")
        self._client = client
        self._prefix = f"{key_prefix}:kv:"
        self._ttl_ms = max(1, int(ttl * 1000))
        self._chunk = chunk

    def _keys(self, endpoint: str) -> tuple[str, str, str]:
        tag = hashlib.blake2b(endpoint.encode(), digest_size=8).hexdigest()
        base = f"{self._prefix}{{{tag}}}:"
        return base + "b", base + "o", base + "w"

    async def claim(self, endpoint: str, owner: str, lease: float) -> bool | None:
        b, o, w = self._keys(endpoint)
        reply = await guarded(
            "kv claim",
            _CLAIM.run(self._client, [w, b, o], [owner, max(1, int(lease * 1000)), self._ttl_ms]),
        )
        if reply == -1:
            return None
        return reply == 1

    async def apply(self, endpoint: str, events: Sequence[KVEvent], cap: int) -> None:
        args: list[str | int] = []
        for event in events:
            if isinstance(event, BlockStored):
                args += ["S", _medium(event.medium), len(event.block_hashes)]
                args += [str(h) for h in event.block_hashes]
            elif isinstance(event, BlockRemoved):
                args += ["R", _medium(event.medium), len(event.block_hashes)]
                args += [str(h) for h in event.block_hashes]
            elif isinstance(event, AllBlocksCleared):
                args.append("C")
        if args:
            await self._send(endpoint, args, cap)

    async def replace(self, endpoint: str, blocks: Sequence[StoredBlock], cap: int) -> None:
        blocks = blocks[max(0, len(blocks) - cap) :]
        args: list[str | int] = ["C"]
        sent = 0
        start = 0
        while start < len(blocks):
            run = blocks[start : start + self._chunk]
            start += len(run)
            # consecutive blocks with the same tiers go as one run per tier
            i = 0
            while i < len(run):
                media = run[i][1]
                j = i
                while j < len(run) and run[j][1] == media:
                    j += 1
                hashes = [str(h) for h, _ in run[i:j]]
                for medium in media:
                    args += ["S", _medium(medium), len(hashes), *hashes]
                i = j
            await self._send(endpoint, args, cap)
            sent += 1
            args = []
        if not sent:
            await self._send(endpoint, args, cap)

    async def blocks(self, endpoint: str, limit: int) -> list[StoredBlock]:
        if limit <= 0:
            return []
        b, o, _ = self._keys(endpoint)
        out: list[StoredBlock] = []
        offset = 0
        while offset < limit:
            count = min(self._chunk, limit - offset)
            reply = await guarded(
                "kv blocks", _PAGE.run(self._client, [b, o], [limit, offset, count])
            )
            if not isinstance(reply, list):
                raise _garbage("kv blocks", reply)
            try:
                for k in range(0, len(reply) - 1, 2):
                    media = _text(reply[k + 1])
                    if media:
                        out.append((int(_text(reply[k])), tuple(media.split(","))))
            except ValueError:
                raise _garbage("kv blocks", reply) from None
            if len(reply) < 2 * count:
                break
            offset += count
        return out

    async def forget(self, endpoint: str) -> None:
        await guarded("kv forget", self._client.delete(*self._keys(endpoint)))

    async def release(self, endpoint: str, owner: str, lease: float) -> None:
        _, _, w = self._keys(endpoint)
        await guarded(
            "kv release", _RELEASE.run(self._client, [w], [owner, max(1, int(lease * 1000))])
        )

    async def current(self, endpoint: str) -> bool:
        _, _, w = self._keys(endpoint)
        return bool(await guarded("kv current", self._client.hlen(w)))

    async def _send(self, endpoint: str, args: Sequence[str | int], cap: int) -> None:
        b, o, _ = self._keys(endpoint)
        await guarded("kv apply", _APPLY.run(self._client, [b, o], [cap, self._ttl_ms, *args]))


def _medium(medium: str | None) -> str:
    """A tier as stored: commas would split it, so they become underscores."""
    return (medium or DEFAULT_MEDIUM).replace(",", "_")


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _garbage(operation: str, reply: object) -> Exception:
    return SharedStateReplyError(f"redis {operation}: unexpected reply {reply!r:.80}")
