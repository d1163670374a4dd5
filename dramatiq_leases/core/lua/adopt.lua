-- KEYS:
--   1 lease: the lease hash
--   2 epoch: the epoch record of the key's Cluster slot (see failover_ms)
--   3 history: the key's history (needed only with a history cap)
-- ARGV:
--   1 handed_token: the token the lease was handed over with
--   2 token: the adopter's new owner token
--   3 ttl_ms: the lease's TTL from now on
--   4 interval_ms: how often the adopter's heartbeat renews it
--   5 margin_ms: how long before the key can expire its holder stops trusting it (below ttl_ms)
--   6 max_hold_ms: the longest the adopter may trust the lease, from now (0: none)
--   7 failover_ms: the failover grace (0: none; lua/acquire.lua): within it no lease is adopted, since the
--     store may have lost an adoption made before (answered -2, with the rest of the grace)
--   8.. fields: field/value pairs of holder metadata; an odd last one is the history cap: how many events the
--     key's history keeps (absent or 0: none; see prelude's history_append), which records the adoption
-- Takes over a lease acquired elsewhere (a web request) by proving its token, and replaces the token, so a
-- lease is adopted once: a second delivery carrying the same token finds another owner. The fence stays
-- the grant's. The maximum hold becomes the earlier of the grant's and now + max_hold_ms.
-- Returns {1, fence, acquired_ms, max_hold_until_ms, now}, {0} when the lease is gone (or its maximum hold
-- is over), {-1, pttl, holder_fence, now} when another token holds it, or {-2, grace_left, fence, now} within
-- the failover grace (ask again after it).
--#include args clock epoch history
local handed_token, token = ARGV[1], ARGV[2]
local ttl_ms = whole(ARGV[3], 1, MAX_MS)
local interval_ms = whole(ARGV[4], 0, MAX_MS)
local max_hold_ms = whole(ARGV[6], 0, MAX_MS)
local failover_ms = whole(ARGV[7], 0, MAX_MS)
if handed_token == nil or handed_token == '' then return bad('handed_token', handed_token) end
if token == nil or token == '' or token == handed_token then return bad('token', token) end
if ttl_ms == nil then return bad('ttl_ms', ARGV[3]) end
if interval_ms == nil then return bad('interval_ms', ARGV[4]) end
if max_hold_ms == nil then return bad('max_hold_ms', ARGV[6]) end
if failover_ms == nil then return bad('failover_ms', ARGV[7]) end
if failover_ms > 0 and KEYS[2] == nil then return bad('epoch record (KEYS[2])') end
local margin_ms = whole(ARGV[5], 0, ttl_ms - 1)
if margin_ms == nil then return bad('margin_ms', ARGV[5]) end
local last, history = #ARGV, 0
if (#ARGV - 7) % 2 ~= 0 then
  history = whole(ARGV[#ARGV], 0, MAX_HISTORY)
  if history == nil then return bad('fields', #ARGV - 7) end
  last = #ARGV - 1
end
if history > 0 and KEYS[3] == nil then return bad('history (KEYS[3])') end
local now = server_time()
local cur = redis.pcall('HMGET', KEYS[1], 'token', 'fence', 'acquired_ms', 'max_hold_until_ms')
if cur.err then return {-1, redis.call('PTTL', KEYS[1]), 0, now} end
if not cur[1] then return {0} end
if cur[1] == token then
  -- Adopted by us already (a client retry after a lost reply): the same answer.
  return {1, tonumber(cur[2]) or 0, tonumber(cur[3]) or now, tonumber(cur[4]) or 0, now}
end
if cur[1] ~= handed_token then return {-1, redis.call('PTTL', KEYS[1]), tonumber(cur[2]) or 0, now} end
if failover_ms > 0 then
  local left = failover_left(KEYS[2], failover_ms, now, false)
  if left > 0 then return {-2, left, tonumber(cur[2]) or 0, now} end
end
local until_ms = tonumber(cur[4]) or 0
if max_hold_ms > 0 and (until_ms == 0 or now + max_hold_ms + margin_ms < until_ms) then
  until_ms = now + max_hold_ms + margin_ms
end
local px = ttl_ms
if until_ms > 0 and until_ms - now < px then px = until_ms - now end
if px <= margin_ms then return {0} end
redis.call('HSET', KEYS[1], 'token', token, 'ttl', ttl_ms, 'interval', interval_ms, 'margin_ms', margin_ms,
  'renewed_ms', now, 'max_hold_until_ms', until_ms, 'adopted_ms', now, unpack(ARGV, 8, last))
redis.call('PEXPIRE', KEYS[1], px)
if history > 0 then
  local meta = nil
  for i = 8, last - 1, 2 do
    if ARGV[i] == 'meta' then meta = ARGV[i + 1] end
  end
  history_append(KEYS[3], history, now, {e = 'adopted', f = cur[2] or '0'}, meta)
end
return {1, tonumber(cur[2]) or 0, tonumber(cur[3]) or now, until_ms, now}
