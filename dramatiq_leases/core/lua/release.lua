-- KEYS:
--   1 lease: the holder's lease hash (its slot's: see prelude's declared_slots)
--   2 fence: the fence counter
--   3 line: the key's line of waiters
--   4 done: the waiters of the key that ran
--   5 waiters: the waiters' entries
--   6 history: the key's history
--   7 lease0: the key's lease hash of slot 0
--   8.. slot: the names of holder slots 1, 2 ...: as many as the key's width needs (its counter's), read when
--     the key has a line or the grant is looked for ('find'); a wider key is answered {NEED_SLOTS, width},
--     nothing written
-- ARGV:
--   1 token: the holder's owner token
--   2 waiter: the holder's waiter id if it waited in the line and its actor returned, else ''
--   3 grant: what the caller knows of its grant: its fence, so that a release asked again (its first reply
--     lost) finds the grant recorded as released and answers RELEASED_EARLIER; or 'find' if it knows neither
--     fence nor slot (a grant whose reply was lost): the token is looked for in every slot of the key; or ''
--   4 retention_ms: how long an idle fence counter is kept (0: for ever)
--   5 history: how many events the key's history keeps (0: none; -1: as many as it has, if it has one: see
--     prelude's history_append)
--   6 ready: how many waiters of the key may wait in place
--   7 promote_ms: how long a waiter whose turn came has to show up
--   8 by: who released it in the holder's stead (an operator), or '': the history's event is then
--     'force_released' naming them, not 'released'
--   9 hold_ms: hold the key back this long (0: no hold): no grant of any slot until then (the counter's
--     `hold_until`, read by lua/acquire.lua; and its `rate_until`, so that nobody is called forward before).
--     The holder's answer to a downstream's 429 (RateLimited); only its holder may hold a key back
--   10 back: the waiter id the holder's message waits again as, put at the head of the line ('' none): its
--     copy comes back when the hold ends, and runs first
-- (KEYS and ARGV in this order: core/protocol.py's ReleaseRequest.encode.)
-- Returns RELEASED ({RELEASED, woken...} if it woke waiters in place: their ids, for the caller to wake,
-- lua/wake.lua), NOT_HELD if the token did not hold the lease (nothing is touched then), or RELEASED_EARLIER
-- if it did not but the grant of the fence given is recorded as released (by this token, or release
-- --if-dead). The holder always has the newest fence of its slot, so it is recorded as the slot's last one
-- released. A waiter that ran is remembered for DONE_MS, so a stray copy of it never runs again; the head of
-- the line is woken, or asked to come back: as many as the key has slots free (its counter's width).
-- A plain release (no waiter, no line, no history) reads the lease and EXISTS the line, then deletes the lease
-- and records the release in the counter: four commands.
--#include args clock counter slots history
local token, waiter, grant, by = ARGV[1], ARGV[2], ARGV[3], ARGV[8]
local retention_ms = whole(ARGV[4], 0, MAX_MS)
local history = whole(ARGV[5], -1, MAX_HISTORY)
local ready = whole(ARGV[6], 0, MAX_READY)
local promote_ms = whole(ARGV[7], 1, MAX_MS)
if waiter == nil or #waiter > MAX_ID_LENGTH then return bad('waiter', waiter) end
if grant == nil or (grant ~= '' and grant ~= 'find' and not string.match(grant, '^%d+$')) then
  return bad('grant', grant)
end
if retention_ms == nil then return bad('retention_ms', ARGV[4]) end
if history == nil then return bad('history', ARGV[5]) end
if ready == nil then return bad('ready', ARGV[6]) end
if promote_ms == nil then return bad('promote_ms', ARGV[7]) end
if by == nil or #by > MAX_ID_LENGTH then return bad('by', by) end
local hold_ms = whole(ARGV[9], 0, MAX_HOLD_BACK_MS)
local back = ARGV[10]
if hold_ms == nil then return bad('hold_ms', ARGV[9]) end
if back == nil or #back > MAX_ID_LENGTH or (back ~= '' and (hold_ms == 0 or by ~= '')) then
  return bad('back', back)
end
if #KEYS < 7 then return bad('key count', #KEYS) end
local LINE, DONE, WAITERS, HISTORY = KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local LEASE = KEYS[1]
local SLOTS, declared = declared_slots(KEYS[7], 8)
-- The key's width (its counter's; one of another type counts as one slot), where the slots are read, and until
-- when it is over its rate (lua/acquire.lua's `rate_until`: nobody is called forward before).
local function key_width()
  local rec = redis.pcall('HMGET', KEYS[2], 'width', 'rate_until')
  if rec.err then rec = {} end
  return math.max(1, math.min(math.floor(tonumber(rec[1]) or 1), MAX_LIMIT)), tonumber(rec[2]) or 0
end
if grant == 'find' then
  local width = key_width()
  if width > declared then return {NEED_SLOTS, width} end
  LEASE = SLOTS[0]
  for s = 1, width - 1 do
    if redis.pcall('HGET', LEASE, 'token') == token then break end
    LEASE = SLOTS[s]
  end
end
local cur
if history == 0 and hold_ms == 0 then
  cur = redis.pcall('HMGET', LEASE, 'token', 'fence', 'slot', 'wide')
else
  cur = redis.pcall('HMGET', LEASE, 'token', 'fence', 'slot', 'wide', 'meta')
end
if cur.err or not cur[1] or cur[1] ~= token then
  if grant ~= '' and grant ~= 'find' then
    local s = string.match(LEASE, '}:(%d+)$') or '0'
    local rec = redis.pcall('HMGET', KEYS[2], 'released', 'r:' .. s)
    if not rec.err and (rec[1] == grant or rec[2] == grant) then return RELEASED_EARLIER end
  end
  return NOT_HELD
end
local slot = tonumber(cur[3])
-- Read before the first write: on a Cluster slot half migrated, a sibling key may be elsewhere, and
-- the script must fail before it deletes anything (Lua is not a transaction).
local lined = redis.call('EXISTS', LINE) == 1
local width, rate_until = 1, 0
if lined then
  width, rate_until = key_width()
  if width > declared then return {NEED_SLOTS, width} end
end
local fence = tonumber(cur[2]) or 0
local line_ok, waiters_ok, done_ok = true, true, true
-- The counter's hold, read before the first write too (one of another type: no hold recorded).
local held = nil
if hold_ms > 0 then
  held = redis.pcall('HMGET', KEYS[2], 'hold_until', 'rate_until', 'fence')
  if held.err then held = nil end
end
if waiter ~= '' or back ~= '' or lined then
  -- Keys of another type (written by hand) are left alone, also read before the first write: the lease is
  -- released whatever they hold, and the rest of the bookkeeping done.
  local function typed(k, want) local kind = redis.call('TYPE', k).ok return kind == want or kind == 'none' end
  line_ok, waiters_ok, done_ok = typed(LINE, 'zset'), typed(WAITERS, 'hash'), typed(DONE, 'zset')
  lined = lined and line_ok and waiters_ok
end
redis.call('DEL', LEASE)
if history ~= 0 then
  local ev = {e = 'released', f = string.format('%d', fence), s = slot}
  if by ~= '' then ev.e, ev.by, ev.r = 'force_released', by, 'owner' end
  if hold_ms > 0 then ev.e, ev.r, ev.w = 'rate_limited', 'hold ' .. hold_ms .. ' ms', back ~= '' and back or nil end
  history_append(HISTORY, history, server_time(), ev, cur[5])
end
if waiter == '' and not lined and hold_ms == 0 then
  -- The uncontended path: no line to wake, no waiter to remember.
  if fence > 0 then record_release(KEYS[2], fence, retention_ms, slot, cur[4]) end
  return RELEASED
end
local now = server_time()
if fence > 0 then record_release(KEYS[2], fence, retention_ms, slot, cur[4], 'released_ms', now) end
if waiter ~= '' then
  if done_ok then
    redis.call('ZREMRANGEBYSCORE', DONE, '-inf', now)
    redis.call('ZADD', DONE, now + DONE_MS, waiter)
    redis.call('PEXPIRE', DONE, DONE_MS)
  end
  if line_ok then redis.call('ZREM', LINE, waiter) end
  if waiters_ok then redis.call('HDEL', WAITERS, waiter) end
end
--#include line
if hold_ms > 0 then
  -- Held back: the key is full until then, whatever its slots; the waiters keep their places, and nobody is
  -- called forward before (the parked would only be refused again; a waiter in place asks again at its block's
  -- end and learns the hold's). A counter this makes (it had none: written by hand, or its retention expired it
  -- during the hold) ends with the hold: never a key without TTL.
  if held then
    local until_ms = now + hold_ms
    redis.call('HSET', KEYS[2], 'hold_until', math.max(until_ms, tonumber(held[1]) or 0),
      'rate_until', math.max(until_ms, tonumber(held[2]) or 0))
    local left = redis.call('PTTL', KEYS[2])
    if (left == -1 and not held[3]) or (left >= 0 and left < hold_ms) then redis.call('PEXPIRE', KEYS[2], hold_ms) end
  end
  if back ~= '' and line_ok and waiters_ok then
    -- At the head: before the line's first (by first attempt), so it runs first once the hold ends.
    local head = redis.call('ZRANGE', LINE, 0, 0, 'WITHSCORES')
    local place = now
    if head[2] then place = math.min(place, tonumber(head[2]) - 1) end
    local actor = ''
    local ok, m = pcall(cjson.decode, cur[5] or '')
    if ok and type(m) == 'table' and type(m.actor) == 'string' then actor = string.gsub(m.actor, '%s', '_') end
    redis.call('ZADD', LINE, place, back)
    put(WAITERS, back, 'p', now + hold_ms + promote_ms, '', actor)
    redis.call('PEXPIRE', LINE, math.max(LINE_TTL_MS, hold_ms + promote_ms))
    redis.call('PEXPIRE', WAITERS, math.max(LINE_TTL_MS, hold_ms + promote_ms))
  end
  return RELEASED
end
if not lined then return RELEASED end
local free = math.max(1, width - present(SLOTS, width))
line_front(LINE, WAITERS, now, free)
local woken = {}
call_forward(LINE, WAITERS, now, ready + width - 1, promote_ms, free, woken, nil, rate_until > now)
if #woken == 0 then return RELEASED end
return {RELEASED, unpack(woken)}
