-- KEYS:
--   1 lease: the lease hash (slot 0's)
--   2 line: the key's line of waiters
--   3 waiters: the waiters' entries
--   4 done: the waiters of the key that ran
--   5 fence: the fence counter (its `width`: how many holder slots the key has)
--   6.. wake: the wake list of each waiter of ARGV 6.., in that order (KEYS[i] is ARGV[i]'s)
--   then slot: the names of holder slots 1, 2 ...: as many as the key's width needs (a wider key is answered
--     {NEED_SLOTS, width}, nothing written)
-- ARGV:
--   1 op: 'hold' or 'leave'
--   2 holder: the channel of the process holding the waiters' parked copies ('' for leave)
--   3 park_ms: how long a parked waiter's copy is delayed
--   4 ready: how many waiters of the key may wait in place
--   5 promote_ms: how long a waiter whose turn came has to show up
--   6.. waiter: the waiter ids
-- hold: the process holds these waiters' parked copies; returns one state per waiter: 'p' parked (keep
-- it), 'm' promoted (send it back now), 'r' waiting in place elsewhere (this copy is a spare: keep it
-- parked; a waiter in place past its deadline is not waiting any more, and its copy is parked), 'd' already
-- ran (drop it), 's' a newer waiter took its place (lock_on_busy="latest": drop it), 'x' not in the line
-- (send it back now, to take its place again).
-- leave: the waiters give up their places; returns how many had one.
-- The answer is {states or count, woken}: woken, the waiters in place it woke, for the caller to wake
-- (lua/wake.lua). Either way vanished waiters at the front lose their place, and the front of a key with free
-- slots (its counter's width says how many it has) is woken or asked to come back (so a missed wake-up heals
-- here).
--#include args clock line slots
local op, holder = ARGV[1], ARGV[2]
local park_ms = whole(ARGV[3], 1, MAX_MS)
local ready = whole(ARGV[4], 0, MAX_READY)
local promote_ms = whole(ARGV[5], 1, MAX_MS)
if op ~= 'hold' and op ~= 'leave' then return bad('op', op) end
-- The holder is one space-separated field of each waiter's entry ("state deadline holder actor").
if holder == nil or #holder > MAX_ID_LENGTH or string.find(holder, '%s') then return bad('holder') end
if park_ms == nil then return bad('park_ms', ARGV[3]) end
if ready == nil then return bad('ready', ARGV[4]) end
if promote_ms == nil then return bad('promote_ms', ARGV[5]) end
for i = 6, #ARGV do
  if ARGV[i] == '' or #ARGV[i] > MAX_ID_LENGTH then return bad('waiter') end
end
if #KEYS < #ARGV then return bad('key count', #KEYS) end
local LINE, WAITERS, DONE, FENCE = KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local SLOTS, declared = declared_slots(KEYS[1], #ARGV + 1)
-- Read before the first write: a counter of another type counts as a key of one slot. `rate_until`: the key
-- is over its rate until then (lua/acquire.lua), and nobody is called forward before.
local rec = redis.pcall('HMGET', FENCE, 'width', 'rate_until')
if rec.err then rec = {} end
local width = math.max(1, math.min(math.floor(tonumber(rec[1]) or 1), MAX_LIMIT))
if width > declared then return {NEED_SLOTS, width} end
local now = server_time()
local over_rate = (tonumber(rec[2]) or 0) > now
local out = {}
for i = 6, #ARGV do
  local w = ARGV[i]
  local e = entry(WAITERS, w)
  if op == 'leave' then
    if e then
      forget(LINE, WAITERS, w, KEYS[i])
      out[#out + 1] = w
    end
  else
    local done = redis.call('ZMSCORE', DONE, w, 's:' .. w)
    if done[1] and tonumber(done[1]) > now then
      out[#out + 1] = 'd'
    elseif done[2] and tonumber(done[2]) > now then
      out[#out + 1] = 's'
    elseif not e or not redis.call('ZSCORE', LINE, w) then
      out[#out + 1] = 'x'
    elseif e.state == 'r' and e.deadline >= now then
      out[#out + 1] = 'r'
    elseif e.state == 'm' then
      put(WAITERS, w, 'm', e.deadline, holder, e.actor)
      out[#out + 1] = 'm'
    else
      put(WAITERS, w, 'p', now + park_ms + promote_ms, holder, e.actor)
      out[#out + 1] = 'p'
    end
  end
end
local woken = {}
if redis.call('EXISTS', LINE) == 1 then
  local free = width - present(SLOTS, width)
  if over_rate then free = 0 end
  line_front(LINE, WAITERS, now, math.max(free, 1))
  if free > 0 then
    local promoted = {}
    call_forward(LINE, WAITERS, now, ready + width - 1, promote_ms, free, woken, promoted)
    -- The caller may hold them: its reply says so.
    for j = 6, #ARGV do
      if promoted[ARGV[j]] and out[j - 5] == 'p' then out[j - 5] = 'm' end
    end
  end
end
if op == 'leave' then return {#out, woken} end
return {out, woken}
