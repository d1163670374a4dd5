-- KEYS:
--   1 lease: the holder's lease hash (slot 0's)
--   2 fence: the fence counter
--   3 line: the key's line of waiters
-- ARGV:
--   1 token: the holder's owner token
--   2 grant: the holder's fence, so that a release asked again (its first reply lost) answers
--     RELEASED_EARLIER; or '' if unknown
--   3 retention_ms: how long an idle fence counter is kept (0: for ever)
-- (KEYS and ARGV in this order: core/protocol.py's ReleaseRequest.encode_plain.)
-- Returns RELEASED, NOT_HELD (nothing touched), RELEASED_EARLIER, as lua/release.lua does, or NOT_PLAIN having
-- written nothing: the key has a line to hand on to, or the holder is one of several, and lua/release.lua must
-- release it.
-- The plain release, beside the general script: a holder that did not come from the line, of a store without
-- history, released by itself (core/protocol.py's `plain`) reads the lease and EXISTS the line, then deletes
-- the lease and records the release in the counter, as lua/release.lua's uncontended path does.
--#include args counter
local token, grant = ARGV[1], ARGV[2]
local retention_ms = whole(ARGV[3], 0, MAX_MS)
if grant == nil or (grant ~= '' and not string.match(grant, '^%d+$')) then return bad('grant', grant) end
if retention_ms == nil then return bad('retention_ms', ARGV[3]) end
local cur = redis.pcall('HMGET', KEYS[1], 'token', 'fence', 'slot', 'wide')
if cur.err or not cur[1] or cur[1] ~= token then
  if grant ~= '' then
    local rec = redis.pcall('HMGET', KEYS[2], 'released', 'r:0')
    if not rec.err and (rec[1] == grant or rec[2] == grant) then return RELEASED_EARLIER end
  end
  return NOT_HELD
end
if cur[3] or cur[4] or redis.call('EXISTS', KEYS[3]) == 1 then return NOT_PLAIN end
redis.call('DEL', KEYS[1])
local fence = tonumber(cur[2]) or 0
if fence > 0 then record_release(KEYS[2], fence, retention_ms, nil, nil) end
return RELEASED
