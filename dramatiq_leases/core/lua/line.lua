-- KEYS: lease (the line, waiters and done keys are derived from its name: one hash tag). ARGV: op ('hold' or
-- 'leave'), holder (the channel of the process holding the waiters' parked
-- copies; '' for leave), park_ms, ready (waiters per key that may wait in
-- place), promote_ms (how long a waiter whose turn came has to show up),
-- then waiter ids.
-- hold: the process holds these waiters' parked copies; returns one state per
-- waiter: 'p' parked (keep it), 'm' promoted (send it back now), 'r' waiting
-- in place elsewhere (this copy is a spare: keep it parked; a waiter in place
-- past its deadline is not waiting any more, and its copy is parked), 'd' already ran
-- (drop it), 'x' not in the line (send it back now, to take its place again).
-- leave: the waiters give up their places; returns how many had one.
-- Either way vanished waiters at the head lose their place, and a free key's
-- head is woken or asked to come back (so a missed wake-up heals here).
local WAKE_TTL_MS, MAX_MS = 12000, 1000000000000
local op, holder = ARGV[1], ARGV[2]
local park_ms, ready, PROMOTE_MS = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
if op ~= 'hold' and op ~= 'leave' then return redis.error_reply('ERR dramatiq-leases: invalid op ' .. tostring(op)) end
-- The holder is one space-separated field of each waiter's entry ("state deadline holder actor").
if holder == nil or #holder > 512 or string.find(holder, '%s') then
  return redis.error_reply('ERR dramatiq-leases: invalid holder')
end
if park_ms == nil or park_ms ~= math.floor(park_ms) or park_ms < 1 or park_ms > MAX_MS then
  return redis.error_reply('ERR dramatiq-leases: invalid park_ms ' .. tostring(ARGV[3]))
end
if ready == nil or ready ~= math.floor(ready) or ready < 0 or ready > 1000 then
  return redis.error_reply('ERR dramatiq-leases: invalid ready ' .. tostring(ARGV[4]))
end
if PROMOTE_MS == nil or PROMOTE_MS ~= math.floor(PROMOTE_MS) or PROMOTE_MS < 1 or PROMOTE_MS > MAX_MS then
  return redis.error_reply('ERR dramatiq-leases: invalid promote_ms ' .. tostring(ARGV[5]))
end
for i = 6, #ARGV do
  if ARGV[i] == '' or #ARGV[i] > 512 then return redis.error_reply('ERR dramatiq-leases: invalid waiter') end
end
-- The line's keys share the lease's hash tag (one slot, so Cluster runs this as is): derived here
-- rather than passed, to keep the hot path's arguments few.
local function sibling(kind) return (string.gsub(KEYS[1], ':lease:{', ':' .. kind .. ':{', 1)) end
local LINE, WAITERS, DONE = sibling('line'), sibling('waiters'), sibling('done')
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function entry(w)
  local e = redis.call('HGET', WAITERS, w)
  if not e then return nil end
  local state, deadline, h, actor = string.match(e, '^(%a) (%d+) (%S*) ?(.*)$')
  return {state = state, deadline = tonumber(deadline), holder = h, actor = actor}
end
local out = {}
for i = 6, #ARGV do
  local w = ARGV[i]
  local e = entry(w)
  if op == 'leave' then
    if e then
      redis.call('ZREM', LINE, w)
      redis.call('HDEL', WAITERS, w)
      redis.call('DEL', LINE .. ':w:' .. w)
      out[#out + 1] = w
    end
  else
    local done = redis.call('ZSCORE', DONE, w)
    if done and tonumber(done) > now then
      out[#out + 1] = 'd'
    elseif not e or not redis.call('ZSCORE', LINE, w) then
      out[#out + 1] = 'x'
    elseif e.state == 'r' and e.deadline >= now then
      out[#out + 1] = 'r'
    elseif e.state == 'm' then
      redis.call('HSET', WAITERS, w, 'm ' .. e.deadline .. ' ' .. holder .. ' ' .. e.actor)
      out[#out + 1] = 'm'
    else
      redis.call('HSET', WAITERS, w, 'p ' .. (now + park_ms + PROMOTE_MS) .. ' ' .. holder .. ' ' .. e.actor)
      out[#out + 1] = 'p'
    end
  end
end
if redis.call('EXISTS', LINE) == 1 then
  for _ = 1, 16 do
    local h = redis.call('ZRANGE', LINE, 0, 0)[1]
    if not h then break end
    local e = entry(h)
    if e and e.deadline >= now then break end
    redis.call('ZREM', LINE, h)
    redis.call('HDEL', WAITERS, h)
  end
  if redis.call('EXISTS', KEYS[1]) == 0 then
    for i, w in ipairs(redis.call('ZRANGE', LINE, 0, math.max(ready, 1) - 1)) do
      local e = entry(w)
      if e and i == 1 and e.state == 'r' then
        local list = LINE .. ':w:' .. w
        local pushed = redis.pcall('LPUSH', list, 1)
        if type(pushed) == 'table' and pushed.err then  -- not a list (written by hand): ours to replace
          redis.call('DEL', list)
          redis.call('LPUSH', list, 1)
        end
        redis.call('PEXPIRE', list, WAKE_TTL_MS)
      elseif e and e.state == 'p' then
        redis.call('HSET', WAITERS, w, 'm ' .. (now + PROMOTE_MS) .. ' ' .. e.holder .. ' ' .. e.actor)
        if e.holder ~= '' then redis.call('PUBLISH', e.holder, w) end
        -- The caller may hold it: its reply says so below.
        for j = 6, #ARGV do if ARGV[j] == w and out[j - 5] == 'p' then out[j - 5] = 'm' end end
      end
    end
  end
end
if op == 'leave' then return #out end
return out
