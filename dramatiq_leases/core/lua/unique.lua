-- KEYS:
--   1 lease: the key's lease hash (holder slot 0)
--   2 fence: the fence counter (its `width`: how many holder slots to look at)
--   3 unique: the key's unique records
--   4 history: the key's history
--   5.. slot: the names of holder slots 1, 2 ...: as many as max(limit, the key's width) needs (else, but for
--     'end', the answer is {NEED_SLOTS, width}, nothing written)
-- ARGV:
--   1 op: 'take' (a send asks for a record), 'keep' (its message lives on: delivered, parked, retried),
--     'renew' (a 'keep' that sets the end to `ms` from now exactly, earlier too: a delivery enqueued its own
--     message again, its run is over, and the run's longest hold no longer counts) or 'end' (its message is
--     done for good)
--   2 message_id: the message whose record it is
--   3 mode: 'q' (lock_unique="queued": refused while `limit` messages of the key are queued, not started)
--     or 'd' ("until_done": refused while `limit` are queued or running); for 'keep', the record to take
--     again if the message has none and the key has room (a message re-driven from its dead letters, a
--     retry of a started "queued" message: queued again), or '-' (none); ignored by 'end'
--   4 limit: how many may be queued (q) or queued and running (d) at once; ignored by 'end'
--   5 ms: how long the record lives from now without news of its message ('take': a short grace until
--     the broker has the message; 'keep': until its next sign of life); ignored by 'end'
--   6 attempt: the message's attempt (Dramatiq's `retries`): a record remembers the newest it was taken or
--     kept for, and 'end' by an older attempt (a stray copy of an attempt that failed) leaves it
--   7 history: how many events the key's history keeps (0 or absent: none; see prelude's history_append):
--     a refused 'take' appends a `duplicate` event (reason `unique`, by: the holder's message id)
--   8 actor: the refused message's actor, for that event (optional)
-- The records: a sorted set `unique` beside the lease, members `q:<attempt>:<message id>` and
-- `d:<attempt>:<message id>`, scored by the server time (ms) at which each ends. A grant (acquire.lua)
-- ends its message's `q:` record in its own step. A record is live while its score is ahead, or while its
-- message holds a slot of the key (a holder's hash names its `waiter`, `<message id>:<retries>`); a `q:`
-- record whose message holds a slot is over (it started: an adoption of a handed-over lease).
-- Returns, for 'take': {1, now} taken (or its own record again: the same message sent twice is not a
-- duplicate of itself), or {0, now, holder} refused (holder: the message id of the oldest live record);
-- for 'keep': {1} a record was kept (or taken again), {0} none; for 'end': {n} the records removed.
--#include args clock slots history
local op, mid, mode = ARGV[1], ARGV[2], ARGV[3]
local limit = whole(ARGV[4], 1, MAX_LIMIT)
local ms = whole(ARGV[5], 1, MAX_MS)
local attempt = whole(ARGV[6], 0, 2 ^ 31)
local history = whole(ARGV[7] or '0', -1, MAX_HISTORY)
local actor = ARGV[8]
if op ~= 'take' and op ~= 'keep' and op ~= 'renew' and op ~= 'end' then return bad('op', op) end
local exact = op == 'renew'
if exact then op = 'keep' end
if mid == nil or mid == '' or #mid > MAX_ID_LENGTH then return bad('message_id', mid) end
if op ~= 'end' and mode ~= 'q' and mode ~= 'd' and not (op == 'keep' and mode == '-') then
  return bad('mode', mode)
end
if op ~= 'end' and limit == nil then return bad('limit', ARGV[4]) end
if op ~= 'end' and ms == nil then return bad('ms', ARGV[5]) end
if attempt == nil then return bad('attempt', ARGV[6]) end
if history == nil then return bad('history', ARGV[7]) end
if #KEYS < 4 then return bad('key count', #KEYS) end
local UNIQUE = KEYS[3]
local kind_of = redis.call('TYPE', UNIQUE).ok
if kind_of ~= 'zset' and kind_of ~= 'none' then return bad('unique records (not a sorted set)', UNIQUE) end
local now = server_time()
-- The key's width (its counter's), read before the first write: slots are read below, of a wider key than
-- declared only once they are.
local width = tonumber(redis.pcall('HGET', KEYS[2], 'width')) or 1
width = math.max(1, math.min(math.floor(width), MAX_LIMIT))
local SLOTS, declared = declared_slots(KEYS[1], 5)
if op ~= 'end' and math.max(width, limit) > declared then return {NEED_SLOTS, math.max(width, limit)} end

-- The set lives as long as its longest record (never without a TTL).
local function expire_set()
  local last = redis.call('ZRANGE', UNIQUE, -1, -1, 'WITHSCORES')
  if last[2] then redis.call('PEXPIRE', UNIQUE, math.max(1, tonumber(last[2]) - now)) end
end

-- Every record, parsed: {member, kind, attempt, id, score}. A member of no known shape is swept.
local function records()
  local out, raw = {}, redis.call('ZRANGE', UNIQUE, 0, -1, 'WITHSCORES')
  for i = 1, #raw, 2 do
    local kind, a, id = string.match(raw[i], '^([qd]):(%d+):(.*)$')
    if kind then
      out[#out + 1] = {raw[i], kind, tonumber(a), id, tonumber(raw[i + 1])}
    else
      redis.call('ZREM', UNIQUE, raw[i])
    end
  end
  return out
end

if op == 'end' then
  local removed = 0
  for _, r in ipairs(records()) do
    if r[4] == mid and r[3] <= attempt then removed = removed + redis.call('ZREM', UNIQUE, r[1]) end
  end
  return {removed}
end

-- This message's records: lives on, until `ms` from now at least, as its newest attempt.
local function keep_own(all)
  local kept = 0
  for _, r in ipairs(all) do
    if r[4] == mid then
      kept = 1
      local score = math.max(r[5], now + ms)
      if exact and attempt >= r[3] then score = now + ms end  -- never by a stray older attempt
      if attempt > r[3] then
        redis.call('ZREM', UNIQUE, r[1])
        redis.call('ZADD', UNIQUE, score, r[2] .. ':' .. attempt .. ':' .. mid)
      elseif score ~= r[5] then
        redis.call('ZADD', UNIQUE, score, r[1])
      end
    end
  end
  return kept
end

local all = records()
if op == 'keep' then
  local kept = keep_own(all)
  if kept == 1 then expire_set() end
  if kept == 1 or mode == '-' then return {kept} end
end

-- take (or keep of a message without a record): which messages hold a slot now (by message id), from the
-- holders' own hashes.
local holding = {}
for s = 0, math.max(width, limit) - 1 do
  local w = redis.pcall('HGET', SLOTS[s], 'waiter')
  if type(w) == 'string' then
    local holder = string.match(w, '^(.*):%d+$')
    if holder then holding[holder] = true end
  end
end
local counted, oldest, oldest_score, own = 0, nil, nil, false
for _, r in ipairs(all) do
  local started = holding[r[4]]
  if (r[2] == 'q' and started) or (r[5] <= now and not started) then
    redis.call('ZREM', UNIQUE, r[1])  -- over: ended by time, or started
  elseif r[4] == mid then
    own = true
  elseif mode == 'd' or not started then
    counted = counted + 1
    if oldest_score == nil or r[5] < oldest_score then oldest, oldest_score = r[4], r[5] end
  end
end
if own then
  keep_own(records())
  expire_set()
  if op == 'keep' then return {1} end
  return {1, now}
end
if counted >= limit then
  expire_set()
  if op == 'keep' then return {0} end  -- an enqueue of a message already sent is never refused
  if history ~= 0 then
    history_append(KEYS[4], history, now, {e = 'duplicate', r = 'unique', m = mid, a = actor, by = oldest}, nil)
  end
  return {0, now, oldest}
end
redis.call('ZADD', UNIQUE, now + ms, mode .. ':' .. attempt .. ':' .. mid)
expire_set()
if op == 'keep' then return {1} end
return {1, now}
