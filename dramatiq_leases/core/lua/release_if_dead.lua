-- KEYS:
--   1 lease: the lease hash
--   2 fence: the fence counter
--   3 history: the key's history (needed only with a history cap, ARGV 3)
-- ARGV:
--   1 retention_ms: how long an idle fence counter is kept (0: for ever or not known, the CLI's; optional)
--   2 fence: release only the grant of this fence (0 or absent: whichever holds the slot; optional)
--   3 history: how many events the key's history keeps (0 or absent: none; -1: as many as it has, if it has
--     one: see prelude's history_append)
--   4 by: who asked (an operator, as user@host; optional), named in the history's 'force_released' event
-- Releases the lease only if no holder can still be running under it: its holder's deadline and safety
-- margin have passed (the key outlived them: its TTL was changed by hand), or the hash does not say and
-- the key has no TTL (a key written by hand). The release is recorded in the fence counter as a release by
-- its holder is (see record_release); a counter of another type is left alone, and the lease still
-- released.
-- Returns {1, ms_past_end, fence}, {0, ms_to_end, fence} (-1: the key expires by itself and its hash does
-- not say when its holder stops), {-1} if there is no such key, or {-2, fence} if another grant holds it.
--#include args clock counter history
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
local retention_ms = whole(ARGV[1] or '0', 0, MAX_MS)
if retention_ms == nil then return bad('retention_ms', ARGV[1]) end
local wanted = whole(ARGV[2] or '0', 0, 2 ^ 53)
if wanted == nil then return bad('fence', ARGV[2]) end
local history = whole(ARGV[3] or '0', -1, MAX_HISTORY)
if history == nil then return bad('history', ARGV[3]) end
local by = ARGV[4] or ''
if #by > MAX_ID_LENGTH then return bad('by', by) end
if history ~= 0 and KEYS[3] == nil then return bad('history (KEYS[3])') end
if redis.call('EXISTS', KEYS[1]) == 0 then return {-1} end
local now = server_time()
local pttl = redis.call('PTTL', KEYS[1])
-- Nothing below can fail after the lease is deleted (record_release's write is a pcall).
local cur = redis.pcall('HMGET', KEYS[1], 'renewed_ms', 'ttl', 'max_hold_until_ms', 'fence', 'slot', 'meta', 'wide')
local deadline, fence, slot, wide = nil, 0, nil, false
if not cur.err then
  wide = cur[7]
  deadline = lease_end(cur[1], cur[2], cur[3])
  fence = tonumber(cur[4]) or 0
  slot = tonumber(cur[5])
end
if wanted > 0 and fence ~= wanted then return {-2, fence} end
if deadline == nil then
  if pttl ~= -1 then return {0, -1, fence} end
elseif now <= deadline then
  -- Both clocks are whole ms, rounded down: only a now past the deadline is surely past the holder's.
  return {0, deadline - now, fence}
end
redis.call('DEL', KEYS[1])
if fence > 0 then record_release(KEYS[2], fence, retention_ms, slot, wide) end
if history ~= 0 then
  local ev = {e = 'force_released', f = string.format('%d', fence), s = slot, r = 'dead'}
  if by ~= '' then ev.by = by end
  history_append(KEYS[3], history, now, ev, not cur.err and cur[6] or nil)
end
return {1, deadline and now - deadline or 0, fence}
