-- KEYS: lease, fence (one hash tag; the line, waiters and done keys are derived from the lease's name).
-- ARGV: token, ttl_ms, max_hold_ms (0: none), interval_ms (0: nobody renews
-- it), margin_ms, waiter (a message's waiter id, '' for none), the line's
-- numbers as one argument "first_ms mode ready park_ms promote_ms retention_ms" (first_ms:
-- the waiter's first attempt, server ms, 0: now; mode 0: never join the
-- line, 1: join, 2: join and may wait in place; ready: waiters per key that
-- may wait in place; park_ms: how long a parked waiter's copy is delayed;
-- promote_ms: how long a waiter whose turn came has to show up; retention_ms:
-- how long an idle fence counter is kept, 0 for ever), then
-- field/value pairs of the lease hash ('key', and 'meta': the holder
-- metadata as JSON).
-- Returns {1, fence, now, previous_fence_expired, released_ms, from_line} when
-- granted (released_ms: when the previous grant was released, if this waiter
-- waited in the line, else 0; from_line: 1 if granted as the head of the
-- line, so its release must remember it), or {0, pttl, holder_fence, now, action, rank,
-- length, block_ms}: action 0 not in the line, 1 wait in place (BLPOP the
-- waiter's wake list for block_ms), 2 park, 3 ask again soon (a place to
-- wait in but no thread for it), 4 this waiter already ran (a duplicate).
-- The line is a sorted set of waiters by first attempt; a free key goes to
-- its head only. Entries are "state deadline holder actor": p parked, m
-- promoted (asked to come back), r waiting in place; one past its deadline
-- has vanished and loses its place.
-- The uncontended path (free key, no line) comes first and creates no closure.
-- The largest numbers accepted (dramatiq_leases.core.scripts.MAX_MS, numbers.MAX_TIMESTAMP_MS).
local MAX_MS = 1000000000000
local MAX_TIMESTAMP_MS = 10000000000000
local READY_SLACK_MS, BLOCK_MAX_MS, LINE_TTL_MS = 2000, 10000, 86400000
local function whole(value, lo, hi)
  local n = tonumber(value)
  if n == nil or n ~= math.floor(n) or n < lo or n > hi then return nil end
  return n
end
local function bad(name, value)
  return redis.error_reply('ERR dramatiq-leases: invalid ' .. name .. ' ' .. tostring(value))
end
local token, waiter = ARGV[1], ARGV[6]
local ttl = whole(ARGV[2], 1, MAX_MS)
local max_hold = whole(ARGV[3], 0, MAX_MS)
local interval = whole(ARGV[4], 0, MAX_MS)
local f1, f2, f3, f4, f5, f6 = string.match(ARGV[7] or '', '^(%d+) (%d+) (%d+) (%d+) (%d+) (%d+)$')
local first = whole(f1, 0, MAX_TIMESTAMP_MS)
local mode = whole(f2, 0, 2)
local ready = whole(f3, 0, 1000)
local park_ms = whole(f4, 1, MAX_MS)
local promote_ms = whole(f5, 1, MAX_MS)
local retention = whole(f6, 0, MAX_MS)
if token == nil or token == '' then return bad('token', token) end
if ttl == nil then return bad('ttl', ARGV[2]) end
if max_hold == nil then return bad('max_hold', ARGV[3]) end
if interval == nil then return bad('interval', ARGV[4]) end
local margin = whole(ARGV[5], 0, ttl - 1)
if margin == nil then return bad('margin', ARGV[5]) end
if waiter == nil or #waiter > 512 or (waiter == '' and mode ~= 0) then return bad('waiter', waiter) end
if first == nil or mode == nil or ready == nil or park_ms == nil or promote_ms == nil or retention == nil then
  return bad('line numbers', ARGV[7])
end
if (#ARGV - 7) % 2 ~= 0 then return bad('metadata count', #ARGV - 7) end
-- The line's keys share the lease's hash tag (one slot, so Cluster runs this as is): derived here
-- rather than passed, to keep the hot path's arguments few.
local function sibling(kind) return (string.gsub(KEYS[1], ':lease:{', ':' .. kind .. ':{', 1)) end
local LINE = sibling('line')
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if waiter ~= '' then
  local done = redis.call('ZSCORE', sibling('done'), waiter)
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
  if retention == 0 then
    local fence = redis.call('HINCRBY', KEYS[2], 'fence', 1)
    return fence, fence - 1
  end
  local prev = tonumber(redis.call('HGET', KEYS[2], 'fence')) or 0
  local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
  local fence = math.max(prev + 1, now_us)
  redis.call('HSET', KEYS[2], 'fence', string.format('%d', fence))
  redis.call('PEXPIRE', KEYS[2], retention)
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
  local px, until_ms = ttl, 0
  if max_hold > 0 then
    until_ms = now + max_hold + margin
    if max_hold + margin < px then px = max_hold + margin end
  end
  redis.call('HSET', KEYS[1], 'token', token, 'fence', string.format('%d', fence), 'ttl', ttl, 'interval', interval, 'margin_ms', margin,
    'acquired_ms', now, 'renewed_ms', now, 'max_hold_until_ms', until_ms, unpack(ARGV, 8))
  redis.call('PEXPIRE', KEYS[1], px)
  return fence, expired, released_ms
end

if not held and not lined then
  local fence, expired = grant()
  return {1, fence, now, expired, 0, 0}
end

local WAITERS = sibling('waiters')
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

local function entry(w)
  local e = redis.call('HGET', WAITERS, w)
  if not e then return nil end
  local state, deadline, holder, actor = string.match(e, '^(%a) (%d+) (%S*) ?(.*)$')
  return {state = state, deadline = tonumber(deadline), holder = holder, actor = actor}
end
local function put(w, state, deadline, holder, actor)
  redis.call('HSET', WAITERS, w, state .. ' ' .. deadline .. ' ' .. holder .. ' ' .. actor)
end
-- Drop vanished waiters from the head; bounded work per call.
local function head()
  for _ = 1, 16 do
    local h = redis.call('ZRANGE', LINE, 0, 0)[1]
    if not h then return nil end
    local e = entry(h)
    if e and e.deadline >= now then return h, e end
    redis.call('ZREM', LINE, h)
    redis.call('HDEL', WAITERS, h)
  end
  return redis.call('ZRANGE', LINE, 0, 0)[1], nil
end
-- Ask the parked among the first `ready` waiters to come back (their holder
-- process is told on its channel; an unknown holder learns it when it
-- registers).
local function promote()
  for _, w in ipairs(redis.call('ZRANGE', LINE, 0, math.max(ready, 1) - 1)) do
    local e = entry(w)
    if e and e.state == 'p' then
      put(w, 'm', now + promote_ms, e.holder, e.actor)
      if e.holder ~= '' then redis.call('PUBLISH', e.holder, w) end
    end
  end
end
local function wake(w, e)
  if e.state == 'r' then
    local list = LINE .. ':w:' .. w
    local pushed = redis.pcall('LPUSH', list, 1)
    if type(pushed) == 'table' and pushed.err then  -- not a list (written by hand): ours to replace
      redis.call('DEL', list)
      redis.call('LPUSH', list, 1)
    end
    redis.call('PEXPIRE', list, BLOCK_MAX_MS + READY_SLACK_MS)
  end
end

local first_waiter, first_entry = nil, nil
if lined then first_waiter, first_entry = head() end
if not held and (first_waiter == nil or first_waiter == waiter) then
  local fence, expired, released_ms = grant()
  local handoff = 0
  if first_waiter ~= nil then
    redis.call('ZREM', LINE, waiter)
    redis.call('HDEL', WAITERS, waiter)
    redis.call('DEL', LINE .. ':w:' .. waiter)
    if expired == 0 then handoff = released_ms end
    promote()
  end
  return {1, fence, now, expired, handoff, first_waiter ~= nil and 1 or 0}
end

if mode == 0 then
  if not held and first_entry then wake(first_waiter, first_entry) end
  return {0, pttl, holder_fence, now, 0, -1, redis.call('ZCARD', LINE), 0}
end
redis.call('ZADD', LINE, 'NX', first > 0 and first or now, waiter)
local rank = redis.call('ZRANK', LINE, waiter)
local mine = entry(waiter)
local holder = mine and mine.holder or ''
local actor = ''
for i = 8, #ARGV - 1, 2 do
  if ARGV[i] == 'meta' then
    local ok, meta = pcall(cjson.decode, ARGV[i + 1])
    if ok and type(meta) == 'table' and type(meta.actor) == 'string' then actor = string.gsub(meta.actor, '%s', '_') end
  end
end
local action, block = 2, 0
if rank < ready and mode == 2 then
  -- Wait in place until woken: by a release, at the holder's TTL, or when
  -- the head in transit would lose its place.
  local until_ms = now + pttl
  if not held and first_entry then until_ms = first_entry.deadline end
  if held and pttl < 0 then until_ms = now + BLOCK_MAX_MS end  -- a key without TTL: no expiry to wait for
  block = math.min(BLOCK_MAX_MS, math.max(50, until_ms - now + 50))
  action = 1
  put(waiter, 'r', now + block + READY_SLACK_MS, holder, actor)
elseif rank < ready then
  action = 3
  put(waiter, 'm', now + promote_ms, holder, actor)
else
  put(waiter, 'p', now + park_ms + promote_ms, holder, actor)
end
if not held and first_entry and first_waiter ~= waiter then
  -- A free key whose head is elsewhere: make sure the head knows.
  if first_entry.state == 'r' then wake(first_waiter, first_entry) else promote() end
end
redis.call('PEXPIRE', LINE, LINE_TTL_MS)
redis.call('PEXPIRE', WAITERS, LINE_TTL_MS)
return {0, pttl, holder_fence, now, action, rank, redis.call('ZCARD', LINE), block}
