"""Lua scripts behind every lease operation.

Each operation is one script and one round trip. A script only touches the
keys passed in ``KEYS``, and those always share one hash tag, so every script
runs unchanged on Redis Cluster.

Key layout for a lease key ``K`` under prefix ``P`` (``T`` is the hash tag,
see :func:`dramatiq_leases.core.keys.hash_tag`):

* ``P:lease:{T}``: a hash holding the lease: ``token``, ``fence``, ``ttl``,
  ``interval``, ``margin_ms``, ``acquired_ms``, ``renewed_ms``,
  ``max_hold_until_ms`` (0: none), ``adopted_ms`` (set once a handed-over lease
  was adopted) and the holder's metadata. It always carries a TTL.
* ``P:fence:{T}``: a hash that outlives every grant: ``fence`` (the last
  fencing token handed out), ``released`` (the last fence released) and
  ``expired`` (the last fence seen ending by TTL).

The holder's deadline. A holder stops trusting its lease ``margin_ms`` before
the key can expire: at ``min(renewed_ms + ttl, max_hold_until_ms) - margin_ms``
in server time, or earlier (it counts from when it *sent* the renewal), and the
margin is the time its interrupted actor has to stop. Those are facts the
holder wrote itself, so a script that finds the deadline *and* the margin past
knows no holder can still be running under the lease: that, and only that, is
what :data:`RELEASE_IF_DEAD` calls dead. It is the instant the key would have
expired by itself had nobody changed its TTL.

Lua scripts are not transactions: a command that fails midway keeps the writes
before it. So every script checks all of its arguments before its first write,
and a lease hash gets its TTL in the command right after the one that creates
it, which cannot fail (``PEXPIRE`` of a valid integer on a key just written).

Times are Redis server time (``TIME``) in milliseconds, so hosts with skewed
clocks agree on ages and deadlines.
"""

from __future__ import annotations

#: The largest number of milliseconds any argument may carry (about 31 years):
#: sums of such numbers stay exact in Lua's doubles and valid for ``PEXPIRE``.
MAX_MS = 10**12

#: Functions shared by the scripts. Each takes what it needs as arguments.
_PRELUDE = (
    """
local MAX_MS = """
    + str(MAX_MS)
    + """
local function server_now()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
-- A whole number in [lo, hi], or nil.
local function whole(value, lo, hi)
  local n = tonumber(value)
  if n == nil or n ~= math.floor(n) or n < lo or n > hi then return nil end
  return n
end
local function bad(name, value)
  return redis.error_reply('ERR dramatiq-leases: invalid ' .. name .. ' ' .. tostring(value))
end
-- The instant this lease ends by its holder's own facts (server ms): its holder's deadline plus the
-- margin its actor has to stop. Nil if the hash does not say (a key written by someone else).
local function lease_end(renewed, ttl, until_ms)
  renewed, ttl = tonumber(renewed), tonumber(ttl)
  if renewed == nil or ttl == nil or ttl <= 0 then return nil end
  local ends = renewed + ttl
  until_ms = tonumber(until_ms) or 0
  if until_ms > 0 and until_ms < ends then ends = until_ms end
  return ends
end
"""
)

#: KEYS: lease, fence. ARGV: token, ttl_ms, max_hold_ms (0: none), interval_ms
#: (0: nobody renews it), margin_ms, then field/value pairs of holder metadata.
#: Returns {1, fence, now, previous_fence_expired} or {0, pttl, holder_fence, now}.
#: With a maximum hold, the key lives at most ``max_hold + margin`` ms.
ACQUIRE = (
    _PRELUDE
    + """
local token = ARGV[1]
local ttl = whole(ARGV[2], 1, MAX_MS)
local max_hold = whole(ARGV[3], 0, MAX_MS)
local interval = whole(ARGV[4], 0, MAX_MS)
if token == nil or token == '' then return bad('token', token) end
if ttl == nil then return bad('ttl', ARGV[2]) end
if max_hold == nil then return bad('max_hold', ARGV[3]) end
if interval == nil then return bad('interval', ARGV[4]) end
local margin = whole(ARGV[5], 0, ttl - 1)
if margin == nil then return bad('margin', ARGV[5]) end
if (#ARGV - 5) % 2 ~= 0 then return bad('metadata count', #ARGV - 5) end
local now = server_now()
if redis.call('EXISTS', KEYS[1]) == 1 then
  local holder_fence = 0
  if redis.call('TYPE', KEYS[1]).ok == 'hash' then
    local cur = redis.call('HMGET', KEYS[1], 'fence', 'token', 'acquired_ms')
    holder_fence = tonumber(cur[1]) or 0
    if cur[2] == token then
      -- Our own grant, asked again (a client retry after a lost reply): the same answer.
      return {1, holder_fence, tonumber(cur[3]) or now, 0}
    end
  end
  return {0, redis.call('PTTL', KEYS[1]), holder_fence, now}
end
-- The counter first: if it fails (a foreign value), nothing else was written.
local fence = redis.call('HINCRBY', KEYS[2], 'fence', 1)
local released = tonumber(redis.call('HGET', KEYS[2], 'released')) or 0
local expired = 0
if fence > 1 and released < fence - 1 then
  -- The previous grant was never released: it ended by TTL.
  expired = fence - 1
  redis.call('HSET', KEYS[2], 'expired', expired)
end
local px, until_ms = ttl, 0
if max_hold > 0 then
  until_ms = now + max_hold + margin
  if max_hold + margin < px then px = max_hold + margin end
end
redis.call('HSET', KEYS[1], 'token', token, 'fence', fence, 'ttl', ttl, 'interval', interval, 'margin_ms', margin,
  'acquired_ms', now, 'renewed_ms', now, 'max_hold_until_ms', until_ms, unpack(ARGV, 6))
redis.call('PEXPIRE', KEYS[1], px)
return {1, fence, now, expired}
"""
)

#: KEYS: lease keys. ARGV: token and ttl_ms for each key, in order.
#: Returns one code per key: 1 renewed, 0 gone, -1 held by another token,
#: -2 maximum hold reached (not extended; it expires on its own).
#: The TTL is never extended past the lease's maximum hold.
RENEW_MANY = (
    _PRELUDE
    + """
if #ARGV ~= 2 * #KEYS then return bad('argument count', #ARGV) end
for i = 1, #KEYS do
  if whole(ARGV[2 * i], 1, MAX_MS) == nil then return bad('ttl', ARGV[2 * i]) end
end
local now = server_now()
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

#: KEYS: lease, fence. ARGV: token. Returns 1 if released, 0 if the token
#: did not hold the lease (nothing is touched then). The holder always has the
#: newest fence of its key, so it is recorded as the last one released.
RELEASE = """
local cur = redis.pcall('HMGET', KEYS[1], 'token', 'fence')
if cur.err or not cur[1] or cur[1] ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
local fence = tonumber(cur[2]) or 0
if fence > 0 then redis.call('HSET', KEYS[2], 'released', fence) end
return 1
"""

#: KEYS: lease, fence. No ARGV. Releases the lease only if no holder can still
#: be running under it: its holder's deadline and safety margin have passed (the
#: key outlived them: its TTL was changed by hand), or the hash does not say and
#: the key has no TTL (a key written by hand).
#: Returns {1, ms_past_end, fence}, {0, ms_to_end, fence} (-1: the key expires
#: by itself and its hash does not say when its holder stops), or {-1} if there
#: is no such key.
RELEASE_IF_DEAD = (
    _PRELUDE
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then return {-1} end
local now = server_now()
local pttl = redis.call('PTTL', KEYS[1])
local cur = redis.pcall('HMGET', KEYS[1], 'renewed_ms', 'ttl', 'max_hold_until_ms', 'fence')
local deadline, fence = nil, 0
if not cur.err then
  deadline = lease_end(cur[1], cur[2], cur[3])
  fence = tonumber(cur[4]) or 0
end
if deadline == nil then
  if pttl ~= -1 then return {0, -1, fence} end
elseif now < deadline then
  return {0, deadline - now, fence}
end
redis.call('DEL', KEYS[1])
if fence > 0 then redis.call('HSET', KEYS[2], 'released', fence) end
return {1, deadline and now - deadline or 0, fence}
"""
)

#: KEYS: lease. ARGV: handed-over token, new token, ttl_ms, interval_ms,
#: margin_ms, max_hold_ms (0: none), then field/value pairs of holder metadata.
#: Takes over a lease acquired elsewhere (a web request) by proving its token,
#: and replaces the token, so a lease is adopted once: a second delivery
#: carrying the same token finds another owner. The fence stays the grant's.
#: The maximum hold becomes the earlier of the grant's and ``now + max_hold``.
#: Returns {1, fence, acquired_ms, max_hold_until_ms, now}, {0} when the lease
#: is gone (or its maximum hold is over), or {-1, pttl, holder_fence, now} when
#: another token holds it.
ADOPT = (
    _PRELUDE
    + """
local handed, token = ARGV[1], ARGV[2]
local ttl = whole(ARGV[3], 1, MAX_MS)
local interval = whole(ARGV[4], 0, MAX_MS)
local max_hold = whole(ARGV[6], 0, MAX_MS)
if handed == nil or handed == '' then return bad('handed-over token', handed) end
if token == nil or token == '' or token == handed then return bad('token', token) end
if ttl == nil then return bad('ttl', ARGV[3]) end
if interval == nil then return bad('interval', ARGV[4]) end
if max_hold == nil then return bad('max_hold', ARGV[6]) end
local margin = whole(ARGV[5], 0, ttl - 1)
if margin == nil then return bad('margin', ARGV[5]) end
if (#ARGV - 6) % 2 ~= 0 then return bad('metadata count', #ARGV - 6) end
local now = server_now()
local cur = redis.pcall('HMGET', KEYS[1], 'token', 'fence', 'acquired_ms', 'max_hold_until_ms')
if cur.err then return {-1, redis.call('PTTL', KEYS[1]), 0, now} end
if not cur[1] then return {0} end
if cur[1] == token then
  -- Adopted by us already (a client retry after a lost reply): the same answer.
  return {1, tonumber(cur[2]) or 0, tonumber(cur[3]) or now, tonumber(cur[4]) or 0, now}
end
if cur[1] ~= handed then return {-1, redis.call('PTTL', KEYS[1]), tonumber(cur[2]) or 0, now} end
local until_ms = tonumber(cur[4]) or 0
if max_hold > 0 and (until_ms == 0 or now + max_hold + margin < until_ms) then until_ms = now + max_hold + margin end
local px = ttl
if until_ms > 0 and until_ms - now < px then px = until_ms - now end
if px <= margin then return {0} end
redis.call('HSET', KEYS[1], 'token', token, 'ttl', ttl, 'interval', interval, 'margin_ms', margin,
  'renewed_ms', now, 'max_hold_until_ms', until_ms, 'adopted_ms', now, unpack(ARGV, 7))
redis.call('PEXPIRE', KEYS[1], px)
return {1, tonumber(cur[2]) or 0, tonumber(cur[3]) or now, until_ms, now}
"""
)

#: KEYS: lease keys. No ARGV. Returns the server time, then for each key
#: {pttl, flat field/value list} (an empty list for a key that is not a hash).
INSPECT_MANY = (
    _PRELUDE
    + """
local out = {server_now()}
for i, key in ipairs(KEYS) do
  local pttl = redis.call('PTTL', key)
  local fields = redis.pcall('HGETALL', key)
  if fields.err then fields = {} end
  out[i + 1] = {pttl, fields}
end
return out
"""
)
