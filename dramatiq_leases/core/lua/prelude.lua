-- The helpers every script shares, written once. Not a script: core/scripts.py copies a section into a
-- script where the script says `--#include NAME` (at the top for what its fast path needs, later for the
-- rest, so the fast path creates no closure it does not call). The constants (MAX_MS ...) come from
-- core/scripts.py, declared by the loader in each script that names them. Every helper takes what it
-- works on as arguments: no upvalue but those constants, so a section reads the same in every script.

--#section args
-- A whole number in [lo, hi], or nil.
local function whole(value, lo, hi)
  local n = tonumber(value)
  if n == nil or n ~= math.floor(n) or n < lo or n > hi then return nil end
  return n
end
-- The reply refusing an argument (returned before the script's first write), with its value if given.
local function bad(name, value)
  if value == nil then return redis.error_reply('ERR dramatiq-leases: invalid ' .. name) end
  return redis.error_reply('ERR dramatiq-leases: invalid ' .. name .. ' ' .. tostring(value))
end

--#section clock
-- Redis server time, in milliseconds and in microseconds (exact in a double: below 2^53).
local function server_time()
  local t = redis.call('TIME')
  local s, us = tonumber(t[1]), tonumber(t[2])
  return s * 1000 + math.floor(us / 1000), s * 1000000 + us
end

--#section keys
-- A key of the lease's line (kind 'line', 'waiters' or 'done'). It shares the lease's hash tag (one slot,
-- so Cluster runs the script as is): derived here rather than passed, to keep the hot path's arguments few.
local function sibling(lease, kind) return (string.gsub(lease, ':lease:{', ':' .. kind .. ':{', 1)) end

--#section counter
-- Records fence as the last released in the fence counter (how the exporter tells a release from an
-- expiry), with the field/value pairs given. `counter` is the counter's TYPE, read before the script's
-- first write: a counter of another type is left alone. One that is gone (a fleet's retention expired it
-- during a long hold) is made again only with a TTL: the caller's retention, else RECORD_MS (a caller
-- without the setting, such as the CLI, would otherwise keep it for ever).
local function record_release(fence_key, counter, fence, retention_ms, ...)
  if counter ~= 'hash' and counter ~= 'none' then return end
  -- As text: a fence may have 16 digits (with a retention), more than Lua prints a number with.
  redis.call('HSET', fence_key, 'released', string.format('%d', fence), ...)
  if retention_ms > 0 then
    redis.call('PEXPIRE', fence_key, retention_ms)
  elseif counter == 'none' then
    redis.call('PEXPIRE', fence_key, RECORD_MS)
  end
end

--#section line
-- The line is a sorted set of waiters by first attempt; each waiter's entry in the waiters hash is
-- "state deadline holder actor": p parked, m promoted (asked to come back), r waiting in place; one past
-- its deadline has vanished and loses its place.
local function entry(waiters, w)
  local e = redis.call('HGET', waiters, w)
  if not e then return nil end
  local state, deadline, holder, actor = string.match(e, '^(%a) (%d+) (%S*) ?(.*)$')
  return {state = state, deadline = tonumber(deadline), holder = holder, actor = actor}
end
local function put(waiters, w, state, deadline, holder, actor)
  redis.call('HSET', waiters, w, state .. ' ' .. deadline .. ' ' .. holder .. ' ' .. actor)
end
-- A waiter leaves the line: its place, its entry, its wake list.
local function forget(line, waiters, w)
  redis.call('ZREM', line, w)
  redis.call('HDEL', waiters, w)
  redis.call('DEL', line .. ':w:' .. w)
end
-- Drops vanished waiters from the head (bounded work per call: HEAD_DROPS_MAX); returns the head and its
-- entry (the entry nil if the head is still unknown then).
local function line_head(line, waiters, now)
  for _ = 1, HEAD_DROPS_MAX do
    local h = redis.call('ZRANGE', line, 0, 0)[1]
    if not h then return nil end
    local e = entry(waiters, h)
    if e and e.deadline >= now then return h, e end
    redis.call('ZREM', line, h)
    redis.call('HDEL', waiters, h)
  end
  return redis.call('ZRANGE', line, 0, 0)[1], nil
end
-- Wakes waiter w waiting in place: a push on the list it blocks on, kept until it has had time to block.
local function wake(line, w)
  local list = line .. ':w:' .. w
  local pushed = redis.pcall('LPUSH', list, 1)
  if type(pushed) == 'table' and pushed.err then  -- not a list (written by hand): ours to replace
    redis.call('DEL', list)
    redis.call('LPUSH', list, 1)
  end
  redis.call('PEXPIRE', list, WAKE_TTL_MS)
end
-- Calls the first `ready` waiters forward: the parked are promoted (asked to come back: their holder
-- process is told on its channel; an unknown holder learns it when it registers), and, if wake_head, a
-- head waiting in place is woken. Each waiter promoted is set true in `promoted`, if given.
local function call_forward(line, waiters, now, ready, promote_ms, wake_head, promoted)
  for i, w in ipairs(redis.call('ZRANGE', line, 0, math.max(ready, 1) - 1)) do
    local e = entry(waiters, w)
    if e and wake_head and i == 1 and e.state == 'r' then
      wake(line, w)
    elseif e and e.state == 'p' then
      put(waiters, w, 'm', now + promote_ms, e.holder, e.actor)
      if e.holder ~= '' then redis.call('PUBLISH', e.holder, w) end
      if promoted then promoted[w] = true end
    end
  end
end
