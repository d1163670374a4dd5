-- KEYS:
--   1 lease: the lease hash (the line, waiters and done keys are derived from its name: one hash tag)
--   2 fence: the fence counter
-- ARGV:
--   1 token: the new holder's owner token
--   2 ttl_ms: the lease's TTL
--   3 max_hold_ms: the longest the holder may trust the lease, from now (0: none)
--   4 interval_ms: how often a heartbeat renews it (0: nobody renews it)
--   5 margin_ms: how long before the key can expire its holder stops trusting it (below ttl_ms)
--   6 waiter: a message's waiter id in the key's line ('': never joins it)
--   7 line_numbers: the line's numbers, as one argument of six space-separated fields:
--       first_ms: the waiter's first attempt, its place in the line (server ms; 0: now)
--       mode: 0 never join the line, 1 join it, 2 join it and may wait in place
--       ready: how many waiters of the key may wait in place
--       park_ms: how long a parked waiter's copy is delayed
--       promote_ms: how long a waiter whose turn came has to show up
--       retention_ms: how long an idle fence counter is kept (0: for ever)
--   8.. fields: field/value pairs of the lease hash ('key', and 'meta': the holder metadata as JSON)
-- Returns {1, fence, now, previous_fence_expired, released_ms, from_line} when granted (released_ms: when
-- the previous grant was released, if this waiter waited in the line, else 0; from_line: 1 if granted as
-- the head of the line, so its release must remember it), or {0, pttl, holder_fence, now, action, rank,
-- length, block_ms}: action 0 not in the line, 1 wait in place (BLPOP the waiter's wake list for block_ms),
-- 2 park, 3 ask again soon (a place to wait in but no thread for it), 4 this waiter already ran (a
-- duplicate). A free key with a line goes to its head only.
-- The uncontended path (free key, no line) comes first and creates no closure it does not call.
--#include args clock keys
local token, waiter = ARGV[1], ARGV[6]
local ttl_ms = whole(ARGV[2], 1, MAX_MS)
local max_hold_ms = whole(ARGV[3], 0, MAX_MS)
local interval_ms = whole(ARGV[4], 0, MAX_MS)
local f1, f2, f3, f4, f5, f6 = string.match(ARGV[7] or '', '^(%d+) (%d+) (%d+) (%d+) (%d+) (%d+)$')
local first_ms = whole(f1, 0, MAX_TIMESTAMP_MS)
local mode = whole(f2, 0, 2)
local ready = whole(f3, 0, MAX_READY)
local park_ms = whole(f4, 1, MAX_MS)
local promote_ms = whole(f5, 1, MAX_MS)
local retention_ms = whole(f6, 0, MAX_MS)
if token == nil or token == '' then return bad('token', token) end
if ttl_ms == nil then return bad('ttl_ms', ARGV[2]) end
if max_hold_ms == nil then return bad('max_hold_ms', ARGV[3]) end
if interval_ms == nil then return bad('interval_ms', ARGV[4]) end
local margin_ms = whole(ARGV[5], 0, ttl_ms - 1)
if margin_ms == nil then return bad('margin_ms', ARGV[5]) end
if waiter == nil or #waiter > MAX_ID_LENGTH or (waiter == '' and mode ~= 0) then return bad('waiter', waiter) end
if first_ms == nil or mode == nil or ready == nil or park_ms == nil or promote_ms == nil or retention_ms == nil then
  return bad('line_numbers', ARGV[7])
end
if (#ARGV - 7) % 2 ~= 0 then return bad('fields', #ARGV - 7) end
local LINE = sibling(KEYS[1], 'line')
local now, now_us = server_time()
if waiter ~= '' then
  local done = redis.call('ZSCORE', sibling(KEYS[1], 'done'), waiter)
  if done and tonumber(done) > now then return {0, 0, 0, now, 4, -1, 0, 0} end
end
-- One call for the common case: neither a lease nor a line.
local present = redis.call('EXISTS', KEYS[1], LINE)
local held = present > 0 and redis.call('EXISTS', KEYS[1]) == 1
local lined = present > 0 and (not held or present == 2) and redis.call('EXISTS', LINE) == 1

-- The next fence. Kept for ever, the counter just counts. With a retention
-- it expires when idle, so a fence is also never below the server's clock in
-- microseconds: every grant's fence is then its grant time (scripts run one at
-- a time and each takes over a microsecond), and a counter created again after
-- an expiry starts above every fence it had handed out.
local function next_fence()
  if retention_ms == 0 then
    local fence = redis.call('HINCRBY', KEYS[2], 'fence', 1)
    return fence, fence - 1
  end
  local prev = tonumber(redis.call('HGET', KEYS[2], 'fence')) or 0
  local fence = math.max(prev + 1, now_us)
  redis.call('HSET', KEYS[2], 'fence', string.format('%d', fence))
  redis.call('PEXPIRE', KEYS[2], retention_ms)
  return fence, prev
end

-- Grants the key to this caller: the fence counter first (if it fails on a
-- foreign value, nothing else was written), then the lease and its TTL.
local function grant()
  local fence, prev_fence = next_fence()
  local expired, released_ms = 0, 0
  if prev_fence > 0 then  -- a key seen before (a first grant has nothing to look back on)
    local prev = redis.call('HMGET', KEYS[2], 'released', 'released_ms')
    released_ms = tonumber(prev[2]) or 0
    if (tonumber(prev[1]) or 0) < prev_fence then
      -- The previous grant was never released: it ended by TTL.
      expired = prev_fence
      redis.call('HSET', KEYS[2], 'expired', string.format('%d', expired))
    end
  end
  local px, until_ms = ttl_ms, 0
  if max_hold_ms > 0 then
    until_ms = now + max_hold_ms + margin_ms
    if max_hold_ms + margin_ms < px then px = max_hold_ms + margin_ms end
  end
  redis.call('HSET', KEYS[1], 'token', token, 'fence', string.format('%d', fence), 'ttl', ttl_ms,
    'interval', interval_ms, 'margin_ms', margin_ms, 'acquired_ms', now, 'renewed_ms', now,
    'max_hold_until_ms', until_ms, unpack(ARGV, 8))
  redis.call('PEXPIRE', KEYS[1], px)
  return fence, expired, released_ms
end

if not held and not lined then
  local fence, expired = grant()
  return {1, fence, now, expired, 0, 0}
end

local WAITERS = sibling(KEYS[1], 'waiters')
-- Keys of another type (written by hand) would fail a command below after earlier writes, leaving a line
-- without TTL: refused before the first write.
if lined and redis.call('TYPE', LINE).ok ~= 'zset' then return bad('line (not a sorted set)', LINE) end
local waiters_type = redis.call('TYPE', WAITERS).ok
if waiters_type ~= 'hash' and waiters_type ~= 'none' then return bad('waiters (not a hash)', WAITERS) end
local pttl, holder_fence = 0, 0
if held then
  if redis.call('TYPE', KEYS[1]).ok == 'hash' then
    local cur = redis.call('HMGET', KEYS[1], 'fence', 'token', 'acquired_ms')
    holder_fence = tonumber(cur[1]) or 0
    if cur[2] == token then
      -- Our own grant, asked again (a client retry after a lost reply): the same answer.
      return {1, holder_fence, tonumber(cur[3]) or now, 0, 0, 0}
    end
  end
  pttl = redis.call('PTTL', KEYS[1])
end

--#include line
local first_waiter, first_entry = nil, nil
if lined then first_waiter, first_entry = line_head(LINE, WAITERS, now) end
if not held and (first_waiter == nil or first_waiter == waiter) then
  local fence, expired, released_ms = grant()
  local handoff = 0
  if first_waiter ~= nil then
    forget(LINE, WAITERS, waiter)
    if expired == 0 then handoff = released_ms end
    call_forward(LINE, WAITERS, now, ready, promote_ms, false)
  end
  return {1, fence, now, expired, handoff, first_waiter ~= nil and 1 or 0}
end

if mode == 0 then
  if not held and first_entry and first_entry.state == 'r' then wake(LINE, first_waiter) end
  return {0, pttl, holder_fence, now, 0, -1, redis.call('ZCARD', LINE), 0}
end
redis.call('ZADD', LINE, 'NX', first_ms > 0 and first_ms or now, waiter)
local rank = redis.call('ZRANK', LINE, waiter)
local mine = entry(WAITERS, waiter)
local holder = mine and mine.holder or ''
local actor = ''
for i = 8, #ARGV - 1, 2 do
  if ARGV[i] == 'meta' then
    local ok, meta = pcall(cjson.decode, ARGV[i + 1])
    if ok and type(meta) == 'table' and type(meta.actor) == 'string' then actor = string.gsub(meta.actor, '%s', '_') end
  end
end
local action, block_ms = 2, 0
if rank < ready and mode == 2 then
  -- Wait in place until woken: by a release, at the holder's TTL, or when
  -- the head in transit would lose its place.
  local until_ms = now + pttl
  if not held and first_entry then until_ms = first_entry.deadline end
  if held and pttl < 0 then until_ms = now + MAX_BLOCK_MS end  -- a key without TTL: no expiry to wait for
  block_ms = math.min(MAX_BLOCK_MS, math.max(BLOCK_SLACK_MS, until_ms - now + BLOCK_SLACK_MS))
  action = 1
  put(WAITERS, waiter, 'r', now + block_ms + READY_SLACK_MS, holder, actor)
elseif rank < ready then
  action = 3
  put(WAITERS, waiter, 'm', now + promote_ms, holder, actor)
else
  put(WAITERS, waiter, 'p', now + park_ms + promote_ms, holder, actor)
end
if not held and first_entry and first_waiter ~= waiter then
  -- A free key whose head is elsewhere: make sure the head knows.
  if first_entry.state == 'r' then
    wake(LINE, first_waiter)
  else
    call_forward(LINE, WAITERS, now, ready, promote_ms, false)
  end
end
redis.call('PEXPIRE', LINE, LINE_TTL_MS)
redis.call('PEXPIRE', WAITERS, LINE_TTL_MS)
return {0, pttl, holder_fence, now, action, rank, redis.call('ZCARD', LINE), block_ms}
