-- KEYS: lease, fence (one hash tag; the line, waiters and done keys are derived from the lease's name). ARGV: token, waiter
-- (the holder's waiter id if it waited in the line, else ''), ready (waiters
-- per key that may wait in place), promote_ms (how long a waiter whose turn
-- came has to show up), retention_ms (how long an idle fence counter is kept,
-- 0 for ever). Returns 1 if released, 0 if the token did
-- not hold the lease (nothing is touched then). The holder always has the
-- newest fence of its key, so it is recorded as the last one released. A
-- waiter that ran (the caller passes it only if its actor returned) is
-- remembered for an hour, so a stray copy of it never runs again; the head of
-- the line is woken, or asked to come back.
local DONE_MS, WAKE_TTL_MS = 3600000, 12000
local ready, PROMOTE_MS = tonumber(ARGV[3]), tonumber(ARGV[4])
if ready == nil or ready ~= math.floor(ready) or ready < 0 or ready > 1000 then
  return redis.error_reply('ERR dramatiq-leases: invalid ready ' .. tostring(ARGV[3]))
end
if PROMOTE_MS == nil or PROMOTE_MS ~= math.floor(PROMOTE_MS) or PROMOTE_MS < 1 or PROMOTE_MS > 1000000000000 then
  return redis.error_reply('ERR dramatiq-leases: invalid promote_ms ' .. tostring(ARGV[4]))
end
if ARGV[2] == nil or #ARGV[2] > 512 then
  return redis.error_reply('ERR dramatiq-leases: invalid waiter ' .. tostring(ARGV[2]))
end
local retention = tonumber(ARGV[5] or '0')
if retention == nil or retention ~= math.floor(retention) or retention < 0 or retention > 1000000000000 then
  return redis.error_reply('ERR dramatiq-leases: invalid retention_ms ' .. tostring(ARGV[5]))
end
local fence_of, counter = 0, 'hash'
-- How long a counter made again to record a release is kept when the caller knows no retention.
local RECORD_MS = 3600000
-- Records the released fence (how the exporter tells a release from an expiry). A counter that expired
-- during a long hold (a fleet's retention) is made again only with a TTL: this caller's retention, else
-- RECORD_MS (a caller without the setting, such as the CLI, would otherwise keep it for ever). A counter
-- of another type is left alone: read before the first write, so nothing fails after the lease is gone.
local function released(...)
  if counter ~= 'hash' and counter ~= 'none' then return end
  redis.call('HSET', KEYS[2], 'released', string.format('%d', fence_of), ...)
  if retention > 0 then
    redis.call('PEXPIRE', KEYS[2], retention)
  elseif counter == 'none' then
    redis.call('PEXPIRE', KEYS[2], RECORD_MS)
  end
end
-- The line's keys share the lease's hash tag (one slot, so Cluster runs this as is): derived here
-- rather than passed, to keep the hot path's arguments few.
local function sibling(kind) return (string.gsub(KEYS[1], ':lease:{', ':' .. kind .. ':{', 1)) end
local LINE = sibling('line')
local cur = redis.pcall('HMGET', KEYS[1], 'token', 'fence')
if cur.err or not cur[1] or cur[1] ~= ARGV[1] then return 0 end
-- Read before the first write: on a Cluster slot half migrated, a sibling key may be elsewhere, and
-- the script must fail before it deletes anything (Lua is not a transaction).
local lined = redis.call('EXISTS', LINE) == 1
fence_of = tonumber(cur[2]) or 0
if fence_of > 0 then counter = redis.call('TYPE', KEYS[2]).ok end
local WAITERS, DONE = sibling('waiters'), sibling('done')
local line_ok, waiters_ok, done_ok = true, true, true
if ARGV[2] ~= '' or lined then
  -- Keys of another type (written by hand) are left alone, also read before the first write: the lease is
  -- released whatever they hold, and the rest of the bookkeeping done.
  local function typed(k, want) local kind = redis.call('TYPE', k).ok return kind == want or kind == 'none' end
  line_ok, waiters_ok, done_ok = typed(LINE, 'zset'), typed(WAITERS, 'hash'), typed(DONE, 'zset')
  lined = lined and line_ok and waiters_ok
end
redis.call('DEL', KEYS[1])
if ARGV[2] == '' and not lined then
  -- The uncontended path: no line to wake, no waiter to remember.
  if fence_of > 0 then released() end
  return 1
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if fence_of > 0 then released('released_ms', now) end
if ARGV[2] ~= '' then
  if done_ok then
    redis.call('ZREMRANGEBYSCORE', DONE, '-inf', now)
    redis.call('ZADD', DONE, now + DONE_MS, ARGV[2])
    redis.call('PEXPIRE', DONE, DONE_MS)
  end
  if line_ok then redis.call('ZREM', LINE, ARGV[2]) end
  if waiters_ok then redis.call('HDEL', WAITERS, ARGV[2]) end
end
if not lined then return 1 end
local function entry(w)
  local e = redis.call('HGET', WAITERS, w)
  if not e then return nil end
  local state, deadline, holder, actor = string.match(e, '^(%a) (%d+) (%S*) ?(.*)$')
  return {state = state, deadline = tonumber(deadline), holder = holder, actor = actor}
end
-- Vanished waiters at the head lose their place (bounded work per call).
for _ = 1, 16 do
  local h = redis.call('ZRANGE', LINE, 0, 0)[1]
  if not h then break end
  local e = entry(h)
  if e and e.deadline >= now then break end
  redis.call('ZREM', LINE, h)
  redis.call('HDEL', WAITERS, h)
end
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
  end
end
return 1
