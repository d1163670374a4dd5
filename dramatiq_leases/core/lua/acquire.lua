-- KEYS: lease, fence, line, waiters, done (one hash tag).
-- ARGV: token, ttl_ms, max_hold_ms (0: none), interval_ms (0: nobody renews
-- it), margin_ms, waiter (a message's waiter id, '' for none), first_ms (its
-- first attempt, server ms; 0: now), mode (0: never join the line, 1: join,
-- 2: join and may wait in place), ready (waiters per key that may wait in
-- place), park_ms (how long a parked waiter's copy is delayed), promote_ms
-- (how long a waiter whose turn came has to show up), then field/value pairs
-- of holder metadata.
-- Returns {1, fence, now, previous_fence_expired, released_ms} when granted
-- (released_ms: when the previous grant was released, if this waiter waited
-- in the line; else 0), or {0, pttl, holder_fence, now, action, rank,
-- length, block_ms}: action 0 not in the line, 1 wait in place (BLPOP the
-- waiter's wake list for block_ms), 2 park, 3 ask again soon (a place to
-- wait in but no thread for it), 4 this waiter already ran (a duplicate).
-- The line is a sorted set of waiters by first attempt; a free key goes to
-- its head only. Entries are "state deadline holder actor": p parked, m promoted
-- (asked to come back), r waiting in place; one past its deadline has
-- vanished and loses its place.
local MAX_MS = 1000000000000
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
local first = whole(ARGV[7], 0, 10000000000000)
local mode = whole(ARGV[8], 0, 2)
local ready = whole(ARGV[9], 0, 1000)
local park_ms = whole(ARGV[10], 1, MAX_MS)
local PROMOTE_MS = whole(ARGV[11], 1, MAX_MS)
if token == nil or token == '' then return bad('token', token) end
if ttl == nil then return bad('ttl', ARGV[2]) end
if max_hold == nil then return bad('max_hold', ARGV[3]) end
if interval == nil then return bad('interval', ARGV[4]) end
local margin = whole(ARGV[5], 0, ttl - 1)
if margin == nil then return bad('margin', ARGV[5]) end
if waiter == nil or #waiter > 512 or (waiter == '' and mode ~= 0) then return bad('waiter', waiter) end
if first == nil then return bad('first_ms', ARGV[7]) end
if mode == nil then return bad('mode', ARGV[8]) end
if ready == nil then return bad('ready', ARGV[9]) end
if park_ms == nil then return bad('park_ms', ARGV[10]) end
if PROMOTE_MS == nil then return bad('promote_ms', ARGV[11]) end
if (#ARGV - 11) % 2 ~= 0 then return bad('metadata count', #ARGV - 11) end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local function entry(w)
  local e = redis.call('HGET', KEYS[4], w)
  if not e then return nil end
  local state, deadline, holder, actor = string.match(e, '^(%a) (%d+) (%S*) ?(.*)$')
  return {state = state, deadline = tonumber(deadline), holder = holder, actor = actor}
end
local function put(w, state, deadline, holder, actor)
  redis.call('HSET', KEYS[4], w, state .. ' ' .. deadline .. ' ' .. holder .. ' ' .. actor)
end
-- Drop vanished waiters from the head; bounded work per call.
local function head()
  for _ = 1, 16 do
    local h = redis.call('ZRANGE', KEYS[3], 0, 0)[1]
    if not h then return nil end
    local e = entry(h)
    if e and e.deadline >= now then return h, e end
    redis.call('ZREM', KEYS[3], h)
    redis.call('HDEL', KEYS[4], h)
  end
  return redis.call('ZRANGE', KEYS[3], 0, 0)[1], nil
end
-- Ask the parked among the first `ready` waiters to come back (their holder
-- process is told on its channel; an unknown holder learns it when it
-- registers).
local function promote()
  for _, w in ipairs(redis.call('ZRANGE', KEYS[3], 0, math.max(ready, 1) - 1)) do
    local e = entry(w)
    if e and e.state == 'p' then
      put(w, 'm', now + PROMOTE_MS, e.holder, e.actor)
      if e.holder ~= '' then redis.call('PUBLISH', e.holder, w) end
    end
  end
end
local function wake(w, e)
  if e.state == 'r' then
    local list = KEYS[3] .. ':w:' .. w
    redis.call('LPUSH', list, 1)
    redis.call('PEXPIRE', list, BLOCK_MAX_MS + READY_SLACK_MS)
  end
end

if waiter ~= '' then
  local done = redis.call('ZSCORE', KEYS[5], waiter)
  if done and tonumber(done) > now then return {0, 0, 0, now, 4, -1, 0, 0} end
end
local held = redis.call('EXISTS', KEYS[1]) == 1
local pttl, holder_fence = 0, 0
if held then
  if redis.call('TYPE', KEYS[1]).ok == 'hash' then
    local cur = redis.call('HMGET', KEYS[1], 'fence', 'token', 'acquired_ms')
    holder_fence = tonumber(cur[1]) or 0
    if cur[2] == token then
      -- Our own grant, asked again (a client retry after a lost reply): the same answer.
      return {1, holder_fence, tonumber(cur[3]) or now, 0, 0}
    end
  end
  pttl = redis.call('PTTL', KEYS[1])
end
local first_waiter, first_entry = nil, nil
if redis.call('EXISTS', KEYS[3]) == 1 then first_waiter, first_entry = head() end

if not held and (first_waiter == nil or first_waiter == waiter) then
  -- The counter first: if it fails (a foreign value), nothing else was written.
  local fence = redis.call('HINCRBY', KEYS[2], 'fence', 1)
  local prev = redis.call('HMGET', KEYS[2], 'released', 'released_ms')
  local released = tonumber(prev[1]) or 0
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
    'acquired_ms', now, 'renewed_ms', now, 'max_hold_until_ms', until_ms, unpack(ARGV, 12))
  redis.call('PEXPIRE', KEYS[1], px)
  local handoff = 0
  if first_waiter ~= nil then
    redis.call('ZREM', KEYS[3], waiter)
    redis.call('HDEL', KEYS[4], waiter)
    redis.call('DEL', KEYS[3] .. ':w:' .. waiter)
    if expired == 0 then handoff = tonumber(prev[2]) or 0 end
    promote()
  end
  return {1, fence, now, expired, handoff}
end

if mode == 0 then
  if not held and first_entry then wake(first_waiter, first_entry) end
  return {0, pttl, holder_fence, now, 0, -1, redis.call('ZCARD', KEYS[3]), 0}
end
redis.call('ZADD', KEYS[3], 'NX', first > 0 and first or now, waiter)
local rank = redis.call('ZRANK', KEYS[3], waiter)
local mine = entry(waiter)
local holder = mine and mine.holder or ''
local actor = ''
for i = 12, #ARGV - 1, 2 do if ARGV[i] == 'actor' then actor = string.gsub(ARGV[i + 1], '%s', '_') end end
local action, block = 2, 0
if rank < ready and mode == 2 then
  -- Wait in place until woken: by a release, at the holder's TTL, or when
  -- the head in transit would lose its place.
  local until_ms = now + pttl
  if not held and first_entry then until_ms = first_entry.deadline end
  block = math.min(BLOCK_MAX_MS, math.max(50, until_ms - now + 50))
  action = 1
  put(waiter, 'r', now + block + READY_SLACK_MS, holder, actor)
elseif rank < ready then
  action = 3
  put(waiter, 'm', now + PROMOTE_MS, holder, actor)
else
  put(waiter, 'p', now + park_ms + PROMOTE_MS, holder, actor)
end
if not held and first_entry and first_waiter ~= waiter then
  -- A free key whose head is elsewhere: make sure the head knows.
  if first_entry.state == 'r' then wake(first_waiter, first_entry) else promote() end
end
redis.call('PEXPIRE', KEYS[3], LINE_TTL_MS)
redis.call('PEXPIRE', KEYS[4], LINE_TTL_MS)
return {0, pttl, holder_fence, now, action, rank, redis.call('ZCARD', KEYS[3]), block}
