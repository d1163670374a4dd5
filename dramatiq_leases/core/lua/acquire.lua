-- KEYS: lease, fence. ARGV: token, ttl_ms, max_hold_ms (0: none), interval_ms
-- (0: nobody renews it), margin_ms, then field/value pairs of holder metadata.
-- Returns {1, fence, now, previous_fence_expired} or {0, pttl, holder_fence, now}.
-- With a maximum hold, the key lives at most ``max_hold + margin`` ms.
-- The largest number of milliseconds accepted (dramatiq_leases.core.scripts.MAX_MS).
local MAX_MS = 1000000000000
-- A whole number in [lo, hi], or nil.
local function whole(value, lo, hi)
  local n = tonumber(value)
  if n == nil or n ~= math.floor(n) or n < lo or n > hi then return nil end
  return n
end
local function bad(name, value)
  return redis.error_reply('ERR dramatiq-leases: invalid ' .. name .. ' ' .. tostring(value))
end
local function server_now()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
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
