"""Lua scripts behind every lease operation.

Each operation is one script and one round trip. A script only touches the
keys passed in ``KEYS``, and those always share one hash tag, so every script
runs unchanged on Redis Cluster.

Key layout for a lease key ``K`` under prefix ``P`` (``T`` is the hash tag,
see :func:`dramatiq_leases.core.keys.hash_tag`):

* ``P:lease:{T}``: a hash holding the lease (``token``, ``fence``, ``ttl``,
  ``interval``, ``acquired_ms``, ``renewed_ms``, ``max_hold_until_ms`` and the
  holder's metadata). It always carries a TTL.
* ``P:fence:{T}``: a hash that outlives every grant: ``fence`` (the last
  fencing token handed out), ``released`` (the last fence released by its
  owner) and ``expired`` (the last fence seen ending by TTL).

Times are Redis server time (``TIME``) in milliseconds, so hosts with skewed
clocks agree on ages and heartbeats.
"""

from __future__ import annotations

#: Shared prelude: ``now`` in milliseconds, from the server clock.
_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

#: KEYS: lease, fence. ARGV: token, ttl_ms, max_hold_ms (0: none), interval_ms,
#: then field/value pairs of holder metadata.
#: Returns {1, fence, now, previous_fence_expired} or {0, pttl, holder_fence}.
ACQUIRE = (
    _NOW
    + """
if redis.call('EXISTS', KEYS[1]) == 1 then
  local holder_fence = 0
  if redis.call('TYPE', KEYS[1]).ok == 'hash' then
    holder_fence = tonumber(redis.call('HGET', KEYS[1], 'fence')) or 0
  end
  return {0, redis.call('PTTL', KEYS[1]), holder_fence}
end
local fence = redis.call('HINCRBY', KEYS[2], 'fence', 1)
local released = tonumber(redis.call('HGET', KEYS[2], 'released')) or 0
local expired = 0
if fence > 1 and released < fence - 1 then
  -- The previous grant was never released: it ended by TTL.
  expired = fence - 1
  redis.call('HSET', KEYS[2], 'expired', expired)
end
local ttl = tonumber(ARGV[2])
local max_hold = tonumber(ARGV[3])
local until_ms = 0
if max_hold > 0 then
  until_ms = now + max_hold
  if max_hold < ttl then ttl = max_hold end
end
redis.call('HSET', KEYS[1], 'token', ARGV[1], 'fence', fence, 'ttl', ARGV[2], 'interval', ARGV[4],
  'acquired_ms', now, 'renewed_ms', now, 'max_hold_until_ms', until_ms, unpack(ARGV, 5))
redis.call('PEXPIRE', KEYS[1], ttl)
return {1, fence, now, expired}
"""
)

#: KEYS: lease keys. ARGV: token and ttl_ms for each key, in order.
#: Returns one code per key: 1 renewed, 0 gone, -1 held by another token,
#: -2 maximum hold reached (not extended; it expires on its own).
#: The TTL is never extended past the lease's maximum hold.
RENEW_MANY = (
    _NOW
    + """
local out = {}
for i, key in ipairs(KEYS) do
  local cur = redis.pcall('HMGET', key, 'token', 'max_hold_until_ms')
  if cur.err then
    out[i] = -1
  elseif not cur[1] then
    out[i] = 0
  elseif cur[1] ~= ARGV[2 * i - 1] then
    out[i] = -1
  else
    local px = tonumber(ARGV[2 * i])
    local until_ms = tonumber(cur[2]) or 0
    if until_ms > 0 and until_ms - now < px then px = until_ms - now end
    if px <= 0 then
      out[i] = -2
    else
      redis.call('PEXPIRE', key, px)
      redis.call('HSET', key, 'renewed_ms', now)
      out[i] = 1
    end
  end
end
return out
"""
)

#: Marks ``fence`` as released in the fence hash (KEYS[2]) and deletes the lease.
#: The holder always has the newest fence of its key, so no comparison is needed.
_DELETE_AND_MARK = """
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[2], 'released', fence)
"""

#: KEYS: lease, fence. ARGV: token. Returns 1 if released, 0 if the token
#: did not hold the lease (nothing is touched then).
RELEASE = """
local cur = redis.pcall('HMGET', KEYS[1], 'token', 'fence')
if cur.err or cur[1] ~= ARGV[1] then return 0 end
local fence = tonumber(cur[2]) or 0
""" + _DELETE_AND_MARK + """
return 1
"""

#: KEYS: lease, fence. ARGV: stale_after_ms. Releases only a lease whose
#: heartbeat is older than ``stale_after_ms`` (or which has no TTL at all).
#: Returns {1, heartbeat_age_ms, fence}, {0, heartbeat_age_ms, fence} when the
#: holder is alive, or {-1} when there is no such lease.
RELEASE_IF_DEAD = (
    _NOW
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then return {-1} end
local cur = redis.pcall('HMGET', KEYS[1], 'renewed_ms', 'fence')
local renewed, fence = 0, 0
if not cur.err then
  renewed = tonumber(cur[1]) or 0
  fence = tonumber(cur[2]) or 0
end
local age = now - renewed
if redis.call('PTTL', KEYS[1]) ~= -1 and age <= tonumber(ARGV[1]) then return {0, age, fence} end
"""
    + _DELETE_AND_MARK
    + """
return {1, age, fence}
"""
)

#: KEYS: lease. ARGV: token, ttl_ms, interval_ms, then field/value pairs of
#: holder metadata. Takes over a lease acquired elsewhere (for example in a
#: web request) by proving its token. Returns {1, fence, acquired_ms,
#: max_hold_until_ms, now}, {0} when the lease is gone, or {-1, pttl,
#: holder_fence} when another token holds it.
ADOPT = (
    _NOW
    + """
local cur = redis.pcall('HMGET', KEYS[1], 'token', 'fence', 'acquired_ms', 'max_hold_until_ms')
if cur.err then return {-1, redis.call('PTTL', KEYS[1]), 0} end
if not cur[1] then return {0} end
if cur[1] ~= ARGV[1] then return {-1, redis.call('PTTL', KEYS[1]), tonumber(cur[2]) or 0} end
local px = tonumber(ARGV[2])
local until_ms = tonumber(cur[4]) or 0
if until_ms > 0 and until_ms - now < px then px = until_ms - now end
if px <= 0 then return {0} end
redis.call('HSET', KEYS[1], 'ttl', ARGV[2], 'interval', ARGV[3], 'renewed_ms', now, unpack(ARGV, 4))
redis.call('PEXPIRE', KEYS[1], px)
return {1, tonumber(cur[2]), tonumber(cur[3]), until_ms, now}
"""
)

#: KEYS: lease keys. Returns, per key, {pttl, fields...} with the fields of
#: :data:`INSPECT_FIELDS` (false where absent), plus the server time first.
INSPECT_MANY = (
    _NOW
    + """
local out = {now}
for i, key in ipairs(KEYS) do
  local pttl = redis.call('PTTL', key)
  local fields = redis.pcall('HGETALL', key)
  if fields.err then fields = {} end
  out[i + 1] = {pttl, fields}
end
return out
"""
)
