-- KEYS:
--   1 lease: the lease hash
--   2 fence: the fence counter
--   3 line: the key's line of waiters
--   4 done: the waiters of the key that ran (read only for a waiter)
--   5 epoch: the epoch record of the key's Cluster slot (see lua/acquire.lua; written here only if missing)
--   6.. rate: the ring of each rate of ARGV 10 (lua/acquire.lua's), in that order
-- ARGV:
--   1 token: the new holder's owner token
--   2 ttl_ms: the lease's TTL
--   3 max_hold_ms: the longest the holder may trust the lease, from now (0: none)
--   4 interval_ms: how often a heartbeat renews it (0: nobody renews it)
--   5 margin_ms: how long before the key can expire its holder stops trusting it (below ttl_ms)
--   6 retention_ms: how long an idle fence counter is kept (0: for ever)
--   7 waiter: a message's waiter id in the key's line ('': none)
--   8 grace_ms: the restart grace (0: none; see lua/acquire.lua): a key without a counter within it of the
--     server's start is left to the general script
--   9 failover_ms: the failover grace (0: none; see lua/acquire.lua): a key within it, or whose slot's record
--     names another replication id, is left to the general script
--   10 rates: how many rates the key has (lock_rate; 0 to MAX_RATES), each then given as two numbers, as in
--     lua/acquire.lua: a grant they do not allow yet is left to the general script
--   11.. fields: after the rates, field/value pairs of the lease hash ('key', 'meta', and 'waiter' for a waiter)
-- (KEYS and ARGV in this order: core/protocol.py's GrantRequest.encode_plain.)
-- Returns {GRANTED, fence, now[, previous_fence_expired]}, as lua/acquire.lua's plain path does, or NOT_PLAIN
-- having written nothing (but a missing epoch record, as the general script would): the key is not plainly
-- free (held, lined, a waiter of it remembered, once held by several, held back by its last holder since its
-- last grant, without a counter within the restart grace, within the failover grace, or over one of its
-- rates), and lua/acquire.lua must decide. (A ring's time ahead of the clock may have been made now, as
-- lua/acquire.lua would.)
-- The plain grant, beside the general script rather than inside it: a request of a key of one holder with no
-- option (no history, no unique record, not latest, not back from the line: core/protocol.py's `plain`) pays
-- for its own arguments and commands only: the clock, the counter read, one EXISTS, the counter and lease
-- writes, the lease's TTL. It grants exactly as lua/acquire.lua's plain path (the same hash, the same counter
-- fields), so every reader, renewal and release reads it unchanged.
--#include args grant clock uptime epoch rate
local refused, token, waiter, ttl_ms, max_hold_ms, interval_ms, margin_ms, retention_ms = grant_head(ARGV)
if refused then return refused end
local grace_ms = whole(ARGV[8], 0, MAX_MS)
if grace_ms == nil then return bad('grace_ms', ARGV[8]) end
local failover_ms = whole(ARGV[9], 0, MAX_MS)
if failover_ms == nil then return bad('failover_ms', ARGV[9]) end
if failover_ms > 0 and KEYS[5] == nil then return bad('epoch record (KEYS[5])') end
local nrates = whole(ARGV[10], 0, MAX_RATES)
if nrates == nil then return bad('rates', ARGV[10]) end
local fields_at = 11 + 2 * nrates
if #ARGV < fields_at - 1 or (#ARGV - fields_at + 1) % 2 ~= 0 then return bad('fields', #ARGV - fields_at + 1) end
local RATES = {}
for i = 1, nrates do
  local count, window = whole(ARGV[9 + 2 * i], 1, MAX_RATE_COUNT), whole(ARGV[10 + 2 * i], 1, MAX_RATE_WINDOW)
  if count == nil or window == nil then
    return bad('rates', tostring(ARGV[9 + 2 * i]) .. '/' .. tostring(ARGV[10 + 2 * i]))
  end
  RATES[i] = {count, window}
end
if #KEYS < 5 + nrates then return bad('key count', #KEYS) end
local RINGS = {unpack(KEYS, 6, 5 + nrates)}
-- The counter first: one of another type fails the script here, before any write.
local counter = redis.call('HMGET', KEYS[2], 'fence', 'width', 'released', 'hold_until')
if counter[2] or counter[4] then return NOT_PLAIN end
local found
if waiter == '' then
  found = redis.call('EXISTS', KEYS[1], KEYS[3])
else
  found = redis.call('EXISTS', KEYS[1], KEYS[3], KEYS[4])
end
if found > 0 then return NOT_PLAIN end
if grace_ms > 0 and not counter[1] and uptime_ms() < grace_ms then return NOT_PLAIN end
local now, now_us = server_time()
if failover_ms > 0 and failover_left(KEYS[5], failover_ms, now, true) > 0 then return NOT_PLAIN end
if nrates > 0 and rate_wait(RINGS, RATES, now_us) > 0 then return NOT_PLAIN end
-- The fence and the counter's records, as lua/acquire.lua's next_fence writes them for a key of one holder.
local prev_fence = tonumber(counter[1]) or 0
local expired = 0
if prev_fence > 0 and (tonumber(counter[3]) or 0) < prev_fence then expired = prev_fence end
local fence = math.max(prev_fence + 1, now_us)
if prev_fence == 0 and not counter[3] then
  redis.call('HSET', KEYS[2], 'fence', fence, 'released', 0)
elseif expired > 0 then
  redis.call('HSET', KEYS[2], 'fence', fence, 'expired', expired)
else
  redis.call('HSET', KEYS[2], 'fence', fence)
end
if retention_ms > 0 then redis.call('PEXPIRE', KEYS[2], retention_ms) end
local px, until_ms = ttl_ms, 0
if max_hold_ms > 0 then
  until_ms = now + max_hold_ms + margin_ms
  if max_hold_ms + margin_ms < px then px = max_hold_ms + margin_ms end
end
redis.call('HSET', KEYS[1], 'token', token, 'fence', fence, 'ttl', ttl_ms, 'interval', interval_ms,
  'margin_ms', margin_ms, 'acquired_ms', now, 'renewed_ms', now, 'max_hold_until_ms', until_ms, unpack(ARGV, fields_at))
redis.call('PEXPIRE', KEYS[1], px)
if nrates > 0 then rate_record(RINGS, RATES, now_us) end
if expired > 0 then return {GRANTED, fence, now, expired} end
return {GRANTED, fence, now}
