-- KEYS:
--   1 lease: the holder's lease hash (its slot's: see prelude's slot_key; the line's keys are derived from it)
--   2 fence: the fence counter
-- ARGV:
--   1 token: the holder's owner token
--   2 waiter: the holder's waiter id if it waited in the line and its actor returned, else ''
--   3 ready: how many waiters of the key may wait in place
--   4 promote_ms: how long a waiter whose turn came has to show up
--   5 retention_ms: how long an idle fence counter is kept (0: for ever; optional)
--   6 grant: what the caller knows of its grant (optional): its fence, so that a release asked again (its
--     first reply lost) finds the grant recorded as released and answers 2; or 'find' if it knows neither
--     fence nor slot (a grant whose reply was lost): the token is looked for in every slot of the key
--     (KEYS[1] then names the lease, slot 0)
--   7 history: how many events the key's history keeps (0 or absent: none; -1: as many as it has, if it has
--     one: see prelude's history_append)
--   8 by: who released it in the holder's stead (an operator; optional): the history's event is then
--     'force_released' naming them, not 'released'
-- Returns 1 if released, 0 if the token did not hold the lease (nothing is touched then), 2 if it did not
-- but the grant of the fence given is recorded as released (by this token, or release --if-dead). The holder
-- always has the newest fence of its slot, so it is recorded as the slot's last one released. A waiter that ran
-- is remembered for DONE_MS, so a stray copy of it never runs again; the head of the line is woken, or
-- asked to come back: as many as the key has slots free (its counter's width).
--#include args clock keys counter slots history
local token, waiter = ARGV[1], ARGV[2]
local ready = whole(ARGV[3], 0, MAX_READY)
local promote_ms = whole(ARGV[4], 1, MAX_MS)
local retention_ms = whole(ARGV[5] or '0', 0, MAX_MS)
if ready == nil then return bad('ready', ARGV[3]) end
if promote_ms == nil then return bad('promote_ms', ARGV[4]) end
if waiter == nil or #waiter > MAX_ID_LENGTH then return bad('waiter', waiter) end
if retention_ms == nil then return bad('retention_ms', ARGV[5]) end
local grant = ARGV[6] or ''
if grant ~= '' and grant ~= 'find' and not string.match(grant, '^%d+$') then return bad('grant', grant) end
local history = whole(ARGV[7] or '0', -1, MAX_HISTORY)
if history == nil then return bad('history', ARGV[7]) end
local by = ARGV[8] or ''
if #by > MAX_ID_LENGTH then return bad('by', by) end
local LINE = sibling(KEYS[1], 'line')
local LEASE = KEYS[1]
if grant == 'find' then
  local width = redis.pcall('HGET', KEYS[2], 'width')
  width = math.min((type(width) == 'string' and tonumber(width)) or 1, MAX_LIMIT)
  for s = 1, width - 1 do
    if redis.pcall('HGET', LEASE, 'token') == token then break end
    LEASE = slot_key(KEYS[1], s)
  end
end
local cur
if history == 0 then
  cur = redis.pcall('HMGET', LEASE, 'token', 'fence', 'slot')
else
  cur = redis.pcall('HMGET', LEASE, 'token', 'fence', 'slot', 'meta')
end
if cur.err or not cur[1] or cur[1] ~= token then
  if grant ~= '' and grant ~= 'find' then
    local s = string.match(LEASE, '}:(%d+)$') or '0'
    local rec = redis.pcall('HMGET', KEYS[2], 'released', 'r:' .. s)
    if not rec.err and (rec[1] == grant or rec[2] == grant) then return 2 end
  end
  return 0
end
local slot = tonumber(cur[3])
-- Read before the first write: on a Cluster slot half migrated, a sibling key may be elsewhere, and
-- the script must fail before it deletes anything (Lua is not a transaction).
local lined = redis.call('EXISTS', LINE) == 1
local fence, counter = tonumber(cur[2]) or 0, 'hash'
if fence > 0 then counter = redis.call('TYPE', KEYS[2]).ok end
local WAITERS, DONE = sibling(KEYS[1], 'waiters'), sibling(KEYS[1], 'done')
local line_ok, waiters_ok, done_ok = true, true, true
if waiter ~= '' or lined then
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
  history_append(KEYS[1], history, server_time(), ev, cur[4])
end
if waiter == '' and not lined then
  -- The uncontended path: no line to wake, no waiter to remember.
  if fence > 0 then record_release(KEYS[2], counter, fence, retention_ms, slot) end
  return 1
end
local now = server_time()
if fence > 0 then record_release(KEYS[2], counter, fence, retention_ms, slot, 'released_ms', now) end
if waiter ~= '' then
  if done_ok then
    redis.call('ZREMRANGEBYSCORE', DONE, '-inf', now)
    redis.call('ZADD', DONE, now + DONE_MS, waiter)
    redis.call('PEXPIRE', DONE, DONE_MS)
  end
  if line_ok then redis.call('ZREM', LINE, waiter) end
  if waiters_ok then redis.call('HDEL', WAITERS, waiter) end
end
if not lined then return 1 end
--#include line
local width = 1
if counter == 'hash' then width = math.min(tonumber(redis.call('HGET', KEYS[2], 'width')) or 1, MAX_LIMIT) end
local base = string.gsub(LEASE, '(:lease:{[^}]*}).*$', '%1', 1)
local free = math.max(1, width - present(base, width))
line_front(LINE, WAITERS, now, free)
call_forward(LINE, WAITERS, now, ready + width - 1, promote_ms, free)
return 1
