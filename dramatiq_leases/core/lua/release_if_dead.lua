-- KEYS: lease, fence. ARGV: retention_ms (how long an idle fence counter is
-- kept, 0 for ever or not known: the CLI's; optional). Releases the lease only if no holder can still
-- be running under it: its holder's deadline and safety margin have passed (the
-- key outlived them: its TTL was changed by hand), or the hash does not say and
-- the key has no TTL (a key written by hand).
-- The release is recorded in the fence counter (its 'released' field: how the exporter tells a release
-- from an expiry). A counter is updated as it is, keeping its TTL; one that is gone (a fleet's retention
-- expired it during a long leak) is made again only with a TTL: the caller's retention, else RECORD_MS,
-- long enough for an exporter's next scan. Made without one it would be kept for ever (the CLI does not
-- know the fleet's retention). A counter of another type is left alone, and the lease still released.
-- Returns {1, ms_past_end, fence}, {0, ms_to_end, fence} (-1: the key expires
-- by itself and its hash does not say when its holder stops), or {-1} if there
-- is no such key.
local function server_now()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
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
-- How long a counter made again to record a release is kept when the caller does not know the retention.
local RECORD_MS = 3600000
local retention = tonumber(ARGV[1] or '0')
if retention == nil or retention ~= math.floor(retention) or retention < 0 or retention > 1000000000000 then
  return redis.error_reply('ERR dramatiq-leases: invalid retention_ms ' .. tostring(ARGV[1]))
end
if redis.call('EXISTS', KEYS[1]) == 0 then return {-1} end
local now = server_now()
local pttl = redis.call('PTTL', KEYS[1])
-- Read before the first write, so that nothing below can fail after the lease is deleted.
local counter = redis.call('TYPE', KEYS[2]).ok
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
if fence > 0 and (counter == 'hash' or counter == 'none') then
  -- As text: a fence may have 16 digits (with a retention), more than Lua prints a number with.
  redis.call('HSET', KEYS[2], 'released', string.format('%d', fence))
  if retention > 0 then
    redis.call('PEXPIRE', KEYS[2], retention)
  elseif counter == 'none' then
    redis.call('PEXPIRE', KEYS[2], RECORD_MS)
  end
end
return {1, deadline and now - deadline or 0, fence}
