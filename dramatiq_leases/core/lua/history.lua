-- KEYS:
--   1 history: the key's history
-- ARGV:
--   1 history: how many events the key's history keeps (1 to MAX_HISTORY)
--   2 event: what happened, decided by the caller rather than a script: 'skipped', 'failed', 'gave_up' or
--     'debounced'
--   3 fence: the fence the event is about (0: none)
--   4 reason: why, in a few words ('': none)
--   5 meta: the metadata JSON of the message it happened to ('': none)
--   6 waited_ms: how long that message had waited for the key (0: not known)
--   7 by: who or what caused it ('': none; a debounced message: the message that runs instead)
-- Appends that event to the key's history (see prelude's history_append), stamped with the server's time.
-- Returns 1.
--#include args clock history
local history = whole(ARGV[1], 1, MAX_HISTORY)
local event, reason, meta, by = ARGV[2], ARGV[4] or '', ARGV[5] or '', ARGV[7] or ''
if history == nil then return bad('history', ARGV[1]) end
if event ~= 'skipped' and event ~= 'failed' and event ~= 'gave_up' and event ~= 'debounced' then
  return bad('event', event)
end
if not string.match(ARGV[3] or '', '^%d+$') then return bad('fence', ARGV[3]) end
if #reason > MAX_ID_LENGTH then return bad('reason', reason) end
if #by > MAX_ID_LENGTH then return bad('by', by) end
local waited_ms = whole(ARGV[6] or '0', 0, MAX_MS)
if waited_ms == nil then return bad('waited_ms', ARGV[6]) end
local ev = {e = event}
if ARGV[3] ~= '0' then ev.f = ARGV[3] end
if reason ~= '' then ev.r = reason end
if waited_ms > 0 then ev.wt = waited_ms end
if by ~= '' then ev.by = by end
history_append(KEYS[1], history, server_time(), ev, meta ~= '' and meta or nil)
return 1
