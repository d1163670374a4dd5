-- KEYS:
--   1 record: the key's debounce record (keys.debounce_name), a hash: `seq` the last sequence handed out, `base`
--     the first this record knew (a sequence outside them is one it never saw: kept by a record the store lost);
--     the open
--     burst's `first` (its first send, server ms) and `due` (when its run is due: the quiet window after its last
--     send, or its first send plus the cap, whichever is sooner); its newest send `newest` (seq), `newest_at`
--     (ms) and `newest_id`; the newest send known to be in the broker, `confirmed` and `confirmed_id`; the newest
--     send of the last burst that ended before its run was picked, `closed` and `closed_id`; the last message
--     picked to run, `picked` and `picked_id`. Kept DEBOUNCE_MS after its last change.
-- ARGV:
--   1 op: 'send', 'confirm' or 'pick'
--   2 seq: the message's sequence (confirm, pick; 0 for send)
--   3 message_id: the message's id
--   4 quiet_ms: the quiet window (send, pick; else 0)
--   5 max_ms: the cap (send, pick; 0: no cap)
--   6 confirmed: 1 if the message is in the broker already (send: a delivery without a sequence); else 0
--   7 confirm_ms: how long a newer send not yet known to be in the broker holds an older one back (pick; else 0)
-- send: a send of the key takes its sequence, above every one handed out and at least the server's clock in µs.
-- It continues the open burst if it comes before the burst's `due`, else it starts one (the burst before, if its
-- run was not picked yet, is `closed`: its newest still runs). Returns {seq, ms until the burst's run is due}.
-- confirm: the send of `seq` reached the broker (its producer's after_enqueue). Returns 1.
-- pick: a delivery of the message sent as `seq` (its caller found the sequence genuine: near its send's time). A
-- sequence this record never saw (the store lost the record that handed it out) is registered as the send it
-- was, at that sequence, so that the messages the store forgot keep their send order. Returns {verdict, wait_ms, id}: DEBOUNCE_RUN it runs (picked
-- now, or before: a copy, a retry); DEBOUNCE_WAIT come back in wait_ms (its burst is not due yet, or a newer send
-- is not yet known to be in the broker: its producer's confirm may follow within confirm_ms); DEBOUNCED not run,
-- `id` naming the message that runs instead (the newest now: a newer send in the broker, the newest of its
-- burst, or the last picked).
-- Runs never go backwards: a message older than the last picked never runs, and one is picked only if no newer
-- send of its burst is in the broker. A newer send never confirmed (its producer failed after the send) holds an
-- older message back confirm_ms at most; that one then runs in its stead.
--#include args clock
local op, id = ARGV[1], ARGV[3]
if op ~= 'send' and op ~= 'confirm' and op ~= 'pick' then return bad('op', op) end
local seq = whole(ARGV[2], op == 'send' and 0 or 1, MAX_ORDER)
local quiet_ms = whole(ARGV[4], op == 'confirm' and 0 or 1, MAX_DEBOUNCE_MS)
local max_ms = whole(ARGV[5], 0, MAX_DEBOUNCE_MS)
local confirmed = ARGV[6]
local confirm_ms = whole(ARGV[7], op == 'pick' and 1 or 0, MAX_MS)
if seq == nil then return bad('seq', ARGV[2]) end
if id == nil or id == '' or #id > MAX_ID_LENGTH then return bad('message_id', id) end
if quiet_ms == nil then return bad('quiet_ms', ARGV[4]) end
if max_ms == nil or (max_ms > 0 and max_ms < quiet_ms) then return bad('max_ms', ARGV[5]) end
if confirmed ~= '0' and confirmed ~= '1' then return bad('confirmed', confirmed) end
if confirm_ms == nil then return bad('confirm_ms', ARGV[7]) end
local REC = KEYS[1]
local function field(v) return tonumber(v) or 0 end
-- One of another type (written by hand) is replaced at a send: it records nothing this script could trust.
local rec = redis.pcall('HMGET', REC, 'seq', 'first', 'due', 'newest', 'newest_id', 'confirmed', 'confirmed_id',
  'closed', 'closed_id', 'picked', 'picked_id', 'newest_at', 'base')
if rec.err then
  if op == 'confirm' then return 1 end
  redis.call('DEL', REC)
  rec = {}
end
local picked, newest = field(rec[10]), field(rec[4])
local now, now_us = server_time()

-- A send: at a new sequence, or (a pick of one this record never saw) at its own.
local function register(at)
  seq = at
  local first, due = field(rec[2]), field(rec[3])
  if first == 0 or now >= due then
    -- A new burst. The one before ended unpicked (its newest is late, or still on its way): it still runs.
    if first > 0 and newest > picked then redis.call('HSET', REC, 'closed', newest, 'closed_id', rec[5] or '') end
    first = now
  end
  due = now + quiet_ms
  if max_ms > 0 then due = math.min(due, first + max_ms) end
  redis.call('HSET', REC, 'seq', math.max(seq, field(rec[1])), 'first', first, 'due', due, 'newest', seq,
    'newest_at', now, 'newest_id', id)
  if not rec[13] then redis.call('HSET', REC, 'base', seq) end
  if confirmed == '1' and seq > field(rec[6]) then redis.call('HSET', REC, 'confirmed', seq, 'confirmed_id', id) end
  redis.call('PEXPIRE', REC, DEBOUNCE_MS)
  rec = redis.call('HMGET', REC, 'seq', 'first', 'due', 'newest', 'newest_id', 'confirmed', 'confirmed_id', 'closed',
    'closed_id', 'picked', 'picked_id', 'newest_at', 'base')
  newest = seq
  return due - now
end

if op == 'send' then
  local due_in = register(math.max(field(rec[1]) + 1, now_us))
  return {seq, due_in}
end

if op == 'confirm' then
  if rec[1] and seq <= field(rec[1]) and seq > field(rec[6]) then
    redis.call('HSET', REC, 'confirmed', seq, 'confirmed_id', id)
    redis.call('PEXPIRE', REC, DEBOUNCE_MS)
  end
  return 1
end

if not rec[1] or seq > field(rec[1]) then
  confirmed = '1'  -- delivered: in the broker
  register(seq)
elseif seq < field(rec[13]) then
  -- Older than every send this record saw: known now, and judged as any older message (it gives way to a newer
  -- one in the broker, or waits a while for one on its way).
  redis.call('HSET', REC, 'base', seq)
end
if seq == picked then return {DEBOUNCE_RUN, 0, id} end
if seq < picked then return {DEBOUNCED, 0, rec[11] or ''} end
local closed = field(rec[8])
local function pick()
  redis.call('HSET', REC, 'picked', seq, 'picked_id', id)
  redis.call('PEXPIRE', REC, DEBOUNCE_MS)
  return {DEBOUNCE_RUN, 0, id}
end
-- The run of a burst that ended before its newest came: due already.
if seq == closed then return pick() end
if seq < closed then return {DEBOUNCED, 0, rec[9] or ''} end
if seq < field(rec[6]) then return {DEBOUNCED, 0, rec[7] or ''} end
-- A newer send of its burst not yet known to be in the broker: wait for its confirm, a while.
local newest_at = field(rec[12])
if newest > seq and now < newest_at + confirm_ms then
  return {DEBOUNCE_WAIT, math.min(DEBOUNCE_STEP_MS, newest_at + confirm_ms - now), ''}
end
local due = field(rec[3])
if now < due then return {DEBOUNCE_WAIT, due - now, ''} end
-- Picked: the burst ends, and the next send starts the next one.
if seq > field(rec[6]) then redis.call('HSET', REC, 'confirmed', seq, 'confirmed_id', id) end
redis.call('HDEL', REC, 'first', 'due')
return pick()
