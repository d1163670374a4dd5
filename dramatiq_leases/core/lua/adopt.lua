-- KEYS: lease. ARGV: handed-over token, new token, ttl_ms, interval_ms,
-- margin_ms, max_hold_ms (0: none), then field/value pairs of holder metadata.
-- Takes over a lease acquired elsewhere (a web request) by proving its token,
-- and replaces the token, so a lease is adopted once: a second delivery
-- carrying the same token finds another owner. The fence stays the grant's.
-- The maximum hold becomes the earlier of the grant's and ``now + max_hold``.
-- Returns {1, fence, acquired_ms, max_hold_until_ms, now}, {0} when the lease
-- is gone (or its maximum hold is over), or {-1, pttl, holder_fence, now} when
-- another token holds it.
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
