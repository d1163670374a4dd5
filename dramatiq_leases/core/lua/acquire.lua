-- KEYS:
--   1 lease: the lease hash (slot 0's)
--   2 fence: the fence counter
--   3 line: the key's line of waiters
--   4 done: the waiters of the key that ran (or were superseded or finally refused)
--   5 epoch: the epoch record of the key's Cluster slot (see failover_ms)
--   6 order: the key's order record (read and written by the latest build only): `seen`, the newest order
--     that reached the lease (granted, or waiting as the key's latest), and `by`, its waiter; `seq` is
--     lua/order.lua's
--   7 waiters: the waiters' entries (see prelude's entry)
--   8 unique: the key's unique records (lock_unique)
--   9 history: the key's history (see prelude's history_append)
--   10 wake: this waiter's wake list (keys.wake_name; deleted when it leaves the line)
--   11.. rate: the ring of each rate of ARGV 20 (prelude's rate section), in that order
--   then slot: the names of holder slots 1, 2 ... (prelude's declared_slots): as many as `limit` needs; a key
--     wider than that is answered {NEED_SLOTS, width}, nothing written
-- ARGV:
--   1 token: the new holder's owner token
--   2 ttl_ms: the lease's TTL
--   3 max_hold_ms: the longest the holder may trust the lease, from now (0: none)
--   4 interval_ms: how often a heartbeat renews it (0: nobody renews it)
--   5 margin_ms: how long before the key can expire its holder stops trusting it (below ttl_ms)
--   6 retention_ms: how long an idle fence counter is kept (0: for ever)
--   7 waiter: a message's waiter id in the key's line ('': never joins it)
--   8 limit: how many may hold the key at once (its holders counted whatever limit they were granted with)
--   9 history: how many events the key's history keeps (0: none; see prelude's history_append)
--   10 unique: 1 if the grant ends the message's "queued" unique record (`q:<attempt>:<message id>` in the
--     key's `unique` set: lock_unique), in the same step; else 0
--   11 first_ms: the waiter's first attempt, its place in the line (server ms; 0: now)
--   12 mode: 0 never join the line, 1 join it, 2 join it and may wait in place
--   13 ready: how many waiters of the key may wait in place
--   14 park_ms: how long a parked waiter's copy is delayed
--   15 promote_ms: how long a waiter whose turn came has to show up
--   16 policy: 1 if the key keeps only its newest waiter of this kind (lock_on_busy="latest": the latest build,
--     and only it); 2 if a refusal of this waiter (mode 0) is final: remembered, so another copy of its message
--     never runs after it (a copy sent back, refused by lock_on_busy skip or fail); else 0
--   17 order: the latest build only (else 0): the message's order, when it was sent (µs of the Redis server's
--     clock, lua/order.lua; or of its producer's, if it was sent without one); one more than ORDER_AHEAD_MS
--     ahead of the server's clock counts as that far ahead
--   18 grace_ms: the restart grace (0: none): a key without a fence counter is granted only once the server
--     has been up this long (its INFO's uptime), since a store that restarted without persistence may have
--     forgotten a grant whose holder still runs; until then it answers busy for the rest of the grace
--   19 failover_ms: the failover grace (0: none): once the server's replication id changed (a restart, a
--     replica promoted), no key of the slot is granted until this long after the slot's first grant asked since
--     (prelude's failover_left); until then it answers busy for the rest of it, as in the restart grace
--   20 rates: how many rates the key has (lock_rate; 0 to MAX_RATES), each then given as two numbers: how
--     many grants (1 to MAX_RATE_COUNT) in any window of how many ms (1 to MAX_RATE_WINDOW); a grant they do
--     not allow yet is busy as if the key were full, for as long as they say (pttl)
--   21.. fields: after the rates, field/value pairs of the lease hash ('key', and 'meta': the holder metadata
--     as JSON)
-- (KEYS and ARGV in this order: core/protocol.py's GrantRequest.encode.)
-- Returns {GRANTED, fence, now, previous_fence_expired, released_ms, from_line, slot} when granted (the last
-- three left out when 0, as on the plain path; released_ms: when the key's last grant was released, if this
-- waiter waited in the line; from_line: 1 if granted from the front of the line, so its release must remember
-- it; slot: the holder slot granted; then, if it woke waiters in place, an eighth: their ids, for the caller to
-- wake, lua/wake.lua), or {BUSY, pttl, holder_fence, now, action, rank, length, block_ms, newer, woken} (pttl:
-- the soonest a holder's TTL ends; holder_fence: the newest holder's fence), action one of the WAIT_ codes:
-- NONE not in the line, IN_PLACE wait in place (BLPOP the waiter's wake list for block_ms), PARK park, SOON
-- park, near the front (a place to wait in but no thread for it), DUPLICATE this waiter already ran, SUPERSEDED
-- a newer message took its place (latest; it must not run; `newer`: the message id of the newest that
-- reached the lease, '' if unknown or not latest; `woken` as above, left out with `newer` when empty),
-- COPY_HOLDS another copy of this waiter holds the key (it runs: ask again later, outside the line; the
-- holder's hash names its `waiter`), GRACE within the restart
-- or failover grace for a caller that never joins the line (see grace_ms, failover_ms). A key with free slots
-- and a line goes to the front of its line only: its first waiters, one per free slot.
-- Built twice (core/scripts.py): ACQUIRE without the `--#if latest` parts, for every actor but
-- lock_on_busy="latest" (which it refuses), and ACQUIRE_LATEST with them. Latest: the newest message of a key is
-- the one sent last, by its order. One whose order is below the record's `seen` (or equal, from a message with a
-- smaller id) supersedes itself wherever it meets the key (free, held, lined), unless another copy of it holds
-- the key (COPY_HOLDS first); else it supersedes the key's latest waiter, then is granted or waits as the
-- latest, and its order becomes `seen` (the record kept ORDER_MS).
-- Records: a key never held by several at once keeps its last release and expiry in the counter's
-- `released` (0 from the counter's first grant) and `expired`; once it was (the counter has a `width`: how many
-- slots may be held), each slot s keeps its own: `g:s` granted, `r:s` released, `e:s` expired, and each grant's
-- hash names its `slot` and the `limit` it was granted under.
-- A key its last holder held back (lua/release.lua's hold_ms, a RateLimited: the counter's `hold_until`) is full
-- until then, as under a rate that allows no grant yet; the first grant after forgets the hold.
-- With a history, a grant appends 'expired' (the previous grant was found ended by TTL) and 'granted', a copy
-- that already ran 'duplicate', a waiter a newer one replaced (or older than the newest seen) 'superseded'.
-- Pay only for what is used: a plain grant (limit 1, a key never held by several, nobody in its line, no
-- waiter of it remembered) reads the counter and one EXISTS, then writes the counter and the lease; the unique
-- record, the history and the counter's TTL add their commands only when asked for. Every argument is checked
-- first, those of the general path too.
--#include args grant clock uptime epoch slots rate history
local refused, token, waiter, ttl_ms, max_hold_ms, interval_ms, margin_ms, retention_ms = grant_head(ARGV)
if refused then return refused end
local limit = whole(ARGV[8], 1, MAX_LIMIT)
local history = whole(ARGV[9], 0, MAX_HISTORY)
local unique = ARGV[10]
if limit == nil then return bad('limit', ARGV[8]) end
if history == nil then return bad('history', ARGV[9]) end
if unique ~= '0' and (unique ~= '1' or waiter == '') then return bad('unique', unique) end
local nrates = whole(ARGV[20], 0, MAX_RATES)
if nrates == nil then return bad('rates', ARGV[20]) end
-- The lease hash's fields follow the rates.
local fields_at = 21 + 2 * nrates
if #ARGV < fields_at - 1 or (#ARGV - fields_at + 1) % 2 ~= 0 then return bad('fields', #ARGV - fields_at + 1) end
local RATES = {}
for i = 1, nrates do
  local count, window = whole(ARGV[19 + 2 * i], 1, MAX_RATE_COUNT), whole(ARGV[20 + 2 * i], 1, MAX_RATE_WINDOW)
  if count == nil or window == nil then
    return bad('rates', tostring(ARGV[19 + 2 * i]) .. '/' .. tostring(ARGV[20 + 2 * i]))
  end
  RATES[i] = {count, window}
end
local first_ms = whole(ARGV[11], 0, MAX_TIMESTAMP_MS)
local mode = whole(ARGV[12], 0, 2)
local ready = whole(ARGV[13], 0, MAX_READY)
local park_ms = whole(ARGV[14], 1, MAX_MS)
local promote_ms = whole(ARGV[15], 1, MAX_MS)
local latest = whole(ARGV[16], 0, 2)
if first_ms == nil then return bad('first_ms', ARGV[11]) end
if mode == nil or (waiter == '' and mode ~= 0) then return bad('mode', ARGV[12]) end
if ready == nil then return bad('ready', ARGV[13]) end
if park_ms == nil then return bad('park_ms', ARGV[14]) end
if promote_ms == nil then return bad('promote_ms', ARGV[15]) end
local grace_ms = whole(ARGV[18], 0, MAX_MS)
if grace_ms == nil then return bad('grace_ms', ARGV[18]) end
local failover_ms = whole(ARGV[19], 0, MAX_MS)
if failover_ms == nil then return bad('failover_ms', ARGV[19]) end
--#if latest
if latest ~= 1 or mode == 0 then return bad('policy', ARGV[16]) end
local order = whole(ARGV[17], 1, MAX_ORDER)
if order == nil then return bad('order', ARGV[17]) end
--#else
if latest == nil or latest == 1 or (latest == 2 and (mode ~= 0 or waiter == '')) then
  return bad('policy', ARGV[16])
end
if ARGV[17] ~= '0' then return bad('order', ARGV[17]) end
--#end
if #KEYS < 10 + nrates then return bad('key count', #KEYS) end
local RINGS = {unpack(KEYS, 11, 10 + nrates)}
local LINE, DONE, WAITERS, HISTORY = KEYS[3], KEYS[4], KEYS[7], KEYS[9]
local now, now_us = server_time()
-- The counter first: one of another type fails the script here, before any write.
local counter = redis.call('HMGET', KEYS[2], 'fence', 'width', 'released', 'released_ms', 'hold_until')
local prev_fence = tonumber(counter[1]) or 0
-- nil: never held by several at once; bounded, should the field be written by hand.
local width = tonumber(counter[2])
if width then width = math.max(1, math.min(math.floor(width), MAX_LIMIT)) end
local slots = math.max(limit, width or 1)
local SLOTS, declared = declared_slots(KEYS[1], 11 + nrates)
if slots > declared then return {NEED_SLOTS, slots} end
-- The restart grace left: a key without a counter was never granted, or the store forgot it (a restart
-- without persistence). Within grace_ms of the server's start, a holder the store forgot may still run:
-- nobody is granted the key before the rest of the grace (as if held that long), so that holder meets its
-- deadline first.
local grace_left = 0
if grace_ms > 0 and not counter[1] then grace_left = grace_ms - uptime_ms() end
-- And the failover grace: the store may have lost grants and renewals whose holders still run.
if failover_ms > 0 then grace_left = math.max(grace_left, failover_left(KEYS[5], failover_ms, now, false)) end
-- And the key's rates: how long until they allow one more grant (read only).
local rate_left = 0
if nrates > 0 then rate_left = rate_wait(RINGS, RATES, now_us) end
-- And a hold its last holder put on it (lua/release.lua's hold_ms: a RateLimited), which counts as a rate.
if counter[5] then rate_left = math.max(rate_left, (tonumber(counter[5]) or 0) - now) end
-- The holder's metadata, for the events that name it (read only with a history).
local meta = nil
if history > 0 then
  for i = fields_at, #ARGV - 1, 2 do
    if ARGV[i] == 'meta' then meta = ARGV[i + 1] end
  end
end

-- The next fence: above the counter's last, and never below the server's clock in microseconds, so every
-- grant's fence is its grant time (scripts run one at a time and each takes over a microsecond). A counter
-- the store lost (a restart without persistence, an older snapshot, a failover to a replica that missed the
-- last grants) or that its retention expired when idle thus starts above every fence it had handed out, as
-- long as the server's clock is past the last of those grants (docs/guarantees.md). A new counter of a key
-- of one holder says it was never released (`released` 0), so that a release finds the field there and
-- knows the counter was not made again without its TTL (prelude's record_release). A counter a release
-- made again (its retention expired it during a long hold) has that field already, the release's own
-- record: kept, so that the release asked again still finds it and the exporter still tells a release.
local function next_fence(wide, keep_ms, expired)
  local fence = math.max(prev_fence + 1, now_us)
  if prev_fence == 0 and not wide and not counter[3] then
    redis.call('HSET', KEYS[2], 'fence', fence, 'released', 0)
  elseif expired > 0 then
    redis.call('HSET', KEYS[2], 'fence', fence, 'expired', expired)
  else
    redis.call('HSET', KEYS[2], 'fence', fence)
  end
  if retention_ms > 0 then
    -- A wide key's counter (its width) outlives its holders: never shortened below what they need.
    local ms = retention_ms
    if keep_ms > ms then ms = math.max(keep_ms, redis.call('PTTL', KEYS[2])) end
    redis.call('PEXPIRE', KEYS[2], ms)
  end
  return fence
end

--#if latest
local note_order  -- defined with the general path's arguments, which it needs
--#end
-- Slot 0 held by a holder of the key's one-holder days (no width yet; a hash): grant() marks it if it makes the
-- key wide. Set by the general path's slot walk.
local narrow_held = false
-- Grants slot s to this caller: the fence counter first, then the lease and its TTL. `top`: the highest
-- slot held by others (-1: none), so the counter's width shrinks back once a lowered limit drained.
local function grant(s, top)
  local wide = not (width == nil and slots == 1)
  local px, until_ms = ttl_ms, 0
  if max_hold_ms > 0 then
    until_ms = now + max_hold_ms + margin_ms
    if max_hold_ms + margin_ms < px then px = max_hold_ms + margin_ms end
  end
  local expired, released_ms = 0, tonumber(counter[4]) or 0
  -- A key held by one until now (no width): its last grant is judged as ever, at the first grant of its slot:
  -- never released, it ended by TTL.
  if (not wide or (width == nil and s == 0)) and prev_fence > 0 and (tonumber(counter[3]) or 0) < prev_fence then
    expired = prev_fence
  end
  local fence = next_fence(wide, wide and px or 0, expired)
  -- A hold that ended: forgotten, so that the plain scripts may grant the key again.
  if counter[5] then redis.call('HDEL', KEYS[2], 'hold_until') end
  -- The key turns wide while its one holder holds slot 0: that holder's release and renewals must keep the
  -- counter (its width counts this grant) as they would a wide holder's (prelude's record_release).
  if wide and narrow_held then redis.call('HSET', KEYS[1], 'wide', 1) end
  if wide then
    local rec = redis.call('HMGET', KEYS[2], 'g:' .. s, 'r:' .. s)
    local last = tonumber(rec[1]) or 0
    if last > 0 and (tonumber(rec[2]) or 0) < last then
      expired = last
      redis.call('HSET', KEYS[2], 'e:' .. s, expired)
    end
    redis.call('HSET', KEYS[2], 'g:' .. s, fence, 'width', math.max(limit, top + 1))
  end
  local name = SLOTS[s]
  if wide then
    redis.call('HSET', name, 'token', token, 'fence', fence, 'ttl', ttl_ms, 'interval', interval_ms,
      'margin_ms', margin_ms, 'acquired_ms', now, 'renewed_ms', now, 'max_hold_until_ms', until_ms, 'slot', s,
      'limit', limit, unpack(ARGV, fields_at))
  else
    redis.call('HSET', name, 'token', token, 'fence', fence, 'ttl', ttl_ms, 'interval', interval_ms,
      'margin_ms', margin_ms, 'acquired_ms', now, 'renewed_ms', now, 'max_hold_until_ms', until_ms,
      unpack(ARGV, fields_at))
  end
  redis.call('PEXPIRE', name, px)
  if nrates > 0 then rate_record(RINGS, RATES, now_us) end
  if history > 0 then
    local slot = nil
    if wide then slot = s end
    if expired > 0 then
      history_append(HISTORY, history, now, {e = 'expired', f = string.format('%d', expired), s = slot})
    end
    local ev = {e = 'granted', f = string.format('%d', fence), s = slot}
    if waiter ~= '' then ev.w = waiter end
    history_append(HISTORY, history, now, ev, meta)
  end
--#if latest
  note_order()
--#end
  -- lock_unique="queued": the message's record ends as its lease begins, in this step (never neither held).
  if unique == '1' then
    local mid, attempt = string.match(waiter, '^(.*):(%d+)$')
    if mid then redis.call('ZREM', KEYS[8], 'q:' .. attempt .. ':' .. mid) end
  end
  return fence, expired, released_ms
end

--#if latest
--#else
-- The plain path: a key of one holder, free, with no line and no waiter remembered (Redis stores numbers
-- given to it as integers: exact, whatever their size).
if slots == 1 and grace_left <= 0 and rate_left <= 0 then
  local found
  if waiter == '' then
    found = redis.call('EXISTS', KEYS[1], LINE)
  else
    found = redis.call('EXISTS', KEYS[1], LINE, DONE)
  end
  if found == 0 then
    local fence, expired = grant(0, -1)
    if expired > 0 then return {GRANTED, fence, now, expired} end
    return {GRANTED, fence, now}
  end
end
--#end

-- The general path.
--#if latest
-- How this message compares with the newest that reached the lease (read before any write; a record of another
-- type, written by hand, counts as none and is replaced when written).
order = math.min(order, now_us + ORDER_AHEAD_MS * 1000)
local newest, newest_by, newest_id = 0, '', ''
local rec = redis.pcall('HMGET', KEYS[6], 'seen', 'by')
if not rec.err then
  newest, newest_by = whole(rec[1], 0, MAX_ORDER) or 0, rec[2] or ''
  newest_id = string.match(newest_by, '^(.*):%d+$') or newest_by
end
-- One message (any copy, any retry) is never older than itself; a tie between two goes by message id.
local my_id = string.match(waiter, '^(.*):%d+$') or waiter
local older = order < newest or (order == newest and my_id ~= newest_id and my_id < newest_id)

-- This message reached the lease (granted, or waiting as the key's latest): the newest now, kept ORDER_MS.
note_order = function()
  if order == newest and waiter == newest_by then return end
  local fields = {'seen', string.format('%d', order), 'by', waiter}
  local set = redis.pcall('HSET', KEYS[6], unpack(fields))
  if type(set) == 'table' and set.err then  -- another type, written by hand: replaced
    redis.call('DEL', KEYS[6])
    redis.call('HSET', KEYS[6], unpack(fields))
  end
  redis.call('PEXPIRE', KEYS[6], ORDER_MS)
end
--#end
if waiter ~= '' then
  local done = redis.call('ZMSCORE', DONE, waiter, 's:' .. waiter, 'n:' .. waiter)
  if (done[1] and tonumber(done[1]) > now) or (done[3] and tonumber(done[3]) > now) then
    history_append(HISTORY, history, now, {e = 'duplicate', w = waiter}, meta)
    return {BUSY, 0, 0, now, WAIT_DUPLICATE, -1, 0, 0}
  end
--#if latest
  if done[2] and tonumber(done[2]) > now then return {BUSY, 0, 0, now, WAIT_SUPERSEDED, -1, 0, 0, newest_id} end
--#else
  if done[2] and tonumber(done[2]) > now then return {BUSY, 0, 0, now, WAIT_SUPERSEDED, -1, 0, 0} end
--#end
end
-- One call for the holders and the line.
local found = present(SLOTS, slots, LINE)
local lined = found > 0 and redis.call('EXISTS', LINE) == 1
local count = found - (lined and 1 or 0)

--#if latest
if count == 0 and not lined and not older and grace_left <= 0 and rate_left <= 0 then
--#else
if count == 0 and not lined and grace_left <= 0 and rate_left <= 0 then
--#end
  local fence, expired = grant(0, -1)
  return {GRANTED, fence, now, expired, 0, 0, 0}
end

-- Keys of another type (written by hand) would fail a command below after earlier writes, leaving a line
-- without TTL: refused before the first write (but the slot's epoch record's, right whatever follows).
if lined and redis.call('TYPE', LINE).ok ~= 'zset' then return bad('line (not a sorted set)', LINE) end
local waiters_type = redis.call('TYPE', WAITERS).ok
if waiters_type ~= 'hash' and waiters_type ~= 'none' then return bad('waiters (not a hash)', WAITERS) end
-- The holders: a free slot below the limit, the highest held, the soonest TTL end, the newest fence.
local pttl, holder_fence, free_slot, top, sibling_holds = 0, 0, nil, -1, false
if count > 0 then
  pttl = nil
  for s = 0, slots - 1 do
    local name = SLOTS[s]
    local cur = redis.pcall('HMGET', name, 'fence', 'token', 'acquired_ms', 'waiter')
    -- A hash without those fields (written by hand) blocks its slot as any holder does.
    if cur.err or cur[1] or cur[2] or redis.call('EXISTS', name) == 1 then
      if not cur.err and cur[2] == token then
        -- Our own grant, asked again (a client retry after a lost reply): the same answer.
        -- A waiter's: it may have come from the line, and its release must then remember it (harmless if not).
        return {GRANTED, tonumber(cur[1]) or 0, tonumber(cur[3]) or now, 0, 0, waiter ~= '' and 1 or 0, s}
      end
      if not cur.err then holder_fence = math.max(holder_fence, tonumber(cur[1]) or 0) end
      if s == 0 and width == nil and not cur.err and cur[2] then narrow_held = true end
      -- Another copy of this message holds a slot (it runs): this one must not run beside it.
      if waiter ~= '' and not cur.err and cur[4] == waiter then sibling_holds = true end
      local left = redis.call('PTTL', name)
      if left >= -1 and (pttl == nil or (left >= 0 and (pttl < 0 or left < pttl))) then pttl = left end
      top = s
    elseif free_slot == nil and s < limit then
      free_slot = s
    end
  end
  pttl = pttl or 0
else
  free_slot = 0
end
if sibling_holds then return {BUSY, pttl, holder_fence, now, WAIT_COPY_HOLDS, -1, 0, 0} end
local free = limit - count
if free_slot == nil then free = 0 end
-- A slot free but for the rates (or a grace): the next start is when they allow, not when a holder ends.
local slot_free = free > 0
if rate_left > 0 then  -- full until the rates allow one more: waiters keep their places, as for a holder
  free = 0
  if slot_free or pttl < rate_left then pttl = rate_left end
  -- Told to the counter, so that a release or a line call does not call waiters forward before then (they
  -- would only be refused again); a counter the retention expired is not made again for it.
  if counter[1] then redis.call('HSET', KEYS[2], 'rate_until', now + rate_left) end
end
if grace_left > 0 then  -- held, as far as anyone may know, until the grace ends
  free = 0
  if slot_free or pttl < grace_left then pttl = grace_left end
end

--#include line
-- The waiters in place this call woke (prelude's call_forward): answered last, for the caller to wake.
local WOKEN = {}
local function busy(pttl_, fence_, action, rank, length, block_ms, newer)
  if #WOKEN > 0 then return {BUSY, pttl_, fence_, now, action, rank, length, block_ms, newer or '', WOKEN} end
  return {BUSY, pttl_, fence_, now, action, rank, length, block_ms, newer}
end
local mine_first = first_ms > 0 and first_ms or now
--#if latest
-- A newer waiter of this kind takes the place of the older: decided here, with the grant, so two never
-- both think they are the one waiting.
local function supersede(w)
  local e = entry(WAITERS, w)
  forget(LINE, WAITERS, w)
  if history > 0 then
    history_append(HISTORY, history, now, {e = 'superseded', w = w, m = string.match(w, '^(.*):%d+$'),
      a = e and e.actor ~= '' and e.actor or nil, by = waiter})
  end
  redis.call('ZADD', DONE, now + DONE_MS, 's:' .. w)
  redis.call('PEXPIRE', DONE, DONE_MS)
  if e and e.state == 'r' then
    WOKEN[#WOKEN + 1] = w
  elseif e and e.holder ~= '' then
    redis.call('PUBLISH', e.holder, w)
  end
end
if older then
  -- Sent before a message of the key that already reached the lease: it must not run after it.
  if lined then forget(LINE, WAITERS, waiter, KEYS[10]) end
  history_append(HISTORY, history, now, {e = 'superseded', w = waiter, by = newest_by}, meta)
  redis.call('ZADD', DONE, now + DONE_MS, 's:' .. waiter)
  redis.call('PEXPIRE', DONE, DONE_MS)
  return busy(pttl, holder_fence, WAIT_SUPERSEDED, -1, lined and redis.call('ZCARD', LINE) or 0, 0, newest_id)
end
if lined then
  -- Newer than every message that reached the lease: the key's latest waiter, if another, is older.
  mine_first = tonumber(redis.call('ZSCORE', LINE, waiter)) or mine_first
  local w0 = string.match(redis.call('HGET', WAITERS, '') or '', '^L (%S+) %d+$')
  if w0 and w0 ~= waiter and redis.call('ZSCORE', LINE, w0) then supersede(w0) end
end
--#end

local front = {}
if lined then front = line_front(LINE, WAITERS, now, math.max(free, 1)) end
local in_front = false
for i = 1, math.min(free, #front) do
  if front[i][1] == waiter then in_front = true end
end
if free > 0 and (#front < free or in_front) then
  local fence, expired, released_ms = grant(free_slot, top)
  local handoff = 0
  if #front > 0 then
    if waiter ~= '' then forget(LINE, WAITERS, waiter, KEYS[10]) end
--#if latest
    if redis.call('HGET', WAITERS, '') == 'L ' .. waiter .. ' ' .. string.format('%d', mine_first) then
      redis.call('HDEL', WAITERS, '')
    end
--#end
    if expired == 0 then handoff = released_ms end
    -- The others of the front may take the slots still free.
    call_forward(LINE, WAITERS, now, ready + limit - 1, promote_ms, free - 1, WOKEN)
  end
  if #WOKEN > 0 then return {GRANTED, fence, now, expired, handoff, #front > 0 and 1 or 0, free_slot, WOKEN} end
  return {GRANTED, fence, now, expired, handoff, #front > 0 and 1 or 0, free_slot}
end

-- The front of a key with free slots must know: woken if waiting in place, else asked to come back.
local function call_front()
  local parked = false
  for i = 1, math.min(free, #front) do
    local f = front[i]
    if f[1] ~= waiter and f[2] and f[2].state == 'r' then
      WOKEN[#WOKEN + 1] = f[1]
    elseif f[1] ~= waiter then
      parked = true
    end
  end
  if parked then call_forward(LINE, WAITERS, now, ready + limit - 1, promote_ms, 0, WOKEN) end
end
-- Within the restart grace, one that never joins the line is not refused for good (nor remembered as such):
-- nobody may hold the key, and it asks again once the grace ends.
if grace_left > 0 and mode == 0 then
  return busy(pttl, holder_fence, WAIT_GRACE, -1, lined and redis.call('ZCARD', LINE) or 0, 0)
end
if mode == 0 then
  call_front()
  if latest == 2 then
    redis.call('ZADD', DONE, now + DONE_MS, 'n:' .. waiter)
    redis.call('PEXPIRE', DONE, DONE_MS)
  end
  return busy(pttl, holder_fence, WAIT_NONE, -1, redis.call('ZCARD', LINE), 0)
end
redis.call('ZADD', LINE, 'NX', mine_first, waiter)
local rank = redis.call('ZRANK', LINE, waiter)
local mine = entry(WAITERS, waiter)
local holder = mine and mine.holder or ''
local actor = ''
for i = fields_at, #ARGV - 1, 2 do
  if ARGV[i] == 'meta' then
    local ok, meta = pcall(cjson.decode, ARGV[i + 1])
    if ok and type(meta) == 'table' and type(meta.actor) == 'string' then actor = string.gsub(meta.actor, '%s', '_') end
  end
end
local places = math.min(MAX_READY, ready + limit - 1)
local action, block_ms = WAIT_PARK, 0
if rank < places and mode == 2 then
  -- Wait in place until woken: by a release, at the soonest holder's TTL, or when
  -- the front in transit would lose its place.
  local until_ms = now + pttl
  if free > 0 and front[1] and front[1][2] then until_ms = front[1][2].deadline end
  if count > 0 and free <= 0 and pttl < 0 then until_ms = now + MAX_BLOCK_MS end  -- no TTL: no expiry to wait for
  -- Past a TTL's end the key may linger a moment (Redis expires lazily): the slack. The instant a rate allows
  -- is exact on this clock, and the block starts after it was read: a millisecond is enough.
  local slack = BLOCK_SLACK_MS
  if rate_left > 0 and pttl == rate_left then slack = 1 end
  block_ms = math.min(MAX_BLOCK_MS, math.max(slack, until_ms - now + slack))
  action = WAIT_IN_PLACE
  put(WAITERS, waiter, 'r', now + block_ms + READY_SLACK_MS, holder, actor)
elseif rank < places then
  -- Near the front but no thread to wait in: parked too, and so promoted at the next release (asking
  -- again soon instead would cost an enqueue per round).
  action = WAIT_SOON
  put(WAITERS, waiter, 'p', now + park_ms + promote_ms, holder, actor)
else
  put(WAITERS, waiter, 'p', now + park_ms + promote_ms, holder, actor)
end
--#if latest
local placed = tonumber(redis.call('ZSCORE', LINE, waiter))
redis.call('HSET', WAITERS, '', 'L ' .. waiter .. ' ' .. string.format('%d', placed))
note_order()
--#end
if free > 0 then call_front() end
redis.call('PEXPIRE', LINE, LINE_TTL_MS)
redis.call('PEXPIRE', WAITERS, LINE_TTL_MS)
return busy(pttl, holder_fence, action, rank, redis.call('ZCARD', LINE), block_ms)
