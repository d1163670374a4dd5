-- KEYS:
--   1.. lease: the lease hashes, all of one TTL (n of them)
--   n+1.. fence: the fence counter of each, in the same order
--   2n+1.. history: with a history (ARGV), the history of each, in the same order
-- ARGV:
--   1 ttl_ms: the TTL each lease is renewed for
--   2.. token: the owner token of each key, in KEYS order; with a history, followed by:
--       history: how many events each key's history keeps (see prelude's history_append)
--       fence: the fence of each key's holder, one per key in KEYS order: a lease found lost ('0', 's', 'm')
--         appends 'lost' to its key's history, with its fence and reason
-- Returns one character per key, as one string (cheaper to send and parse than a list of numbers): '1'
-- renewed, '0' gone, 's' held by another token (stolen), 'm' maximum hold reached (not extended; it
-- expires on its own). The TTL is never extended past the lease's maximum hold. A holder of a key several
-- may hold (its hash has a `slot`, or `wide`: granted before the key had several) keeps the key's counter, whose
-- width counts its slot, at least as long.
--#include args clock history
local n = #ARGV - 1
if #KEYS % 3 == 0 and #ARGV == 2 * #KEYS / 3 + 2 then n = #KEYS / 3 end
if #KEYS ~= 2 * n and not (#KEYS == 3 * n and #ARGV == 2 * n + 2) then return bad('argument count', #ARGV) end
local ttl_ms = whole(ARGV[1], 1, MAX_MS)
if ttl_ms == nil then return bad('ttl_ms', ARGV[1]) end
-- Every token before the first write (Lua is not a transaction): an empty one would renew a hash written
-- by hand with an empty token field.
for i = 2, n + 1 do
  if ARGV[i] == '' then return bad('token', "''") end
end
local history = 0
if #ARGV > n + 1 then
  history = whole(ARGV[n + 2], 0, MAX_HISTORY)
  if history == nil then return bad('history', ARGV[n + 2]) end
  for i = n + 3, #ARGV do
    if not string.match(ARGV[i], '^%d+$') then return bad('fence', ARGV[i]) end
  end
end
local now = server_time()
local out = {}
for i = 1, n do
  local key = KEYS[i]
  local cur = redis.pcall('HMGET', key, 'token', 'max_hold_until_ms', 'slot', 'fence', 'wide')
  if cur.err then
    out[i] = 's'
  elseif not cur[1] then
    out[i] = '0'
  elseif cur[1] ~= ARGV[i + 1] then
    out[i] = 's'
  else
    local px = ttl_ms
    local until_ms = tonumber(cur[2]) or 0
    if until_ms > 0 and until_ms - now < px then px = until_ms - now end
    if px <= 0 then
      out[i] = 'm'
    else
      redis.call('PEXPIRE', key, px)
      redis.call('HSET', key, 'renewed_ms', now)
      if cur[3] or cur[5] then
        local fence = KEYS[n + i]
        local left = redis.call('PTTL', fence)  -- -1: kept for ever; -2: gone (nothing to keep)
        if left >= 0 and left < px then redis.call('PEXPIRE', fence, px) end
      end
      out[i] = '1'
    end
  end
  if history > 0 and out[i] ~= '1' then
    local ev = {e = 'lost', f = ARGV[n + 2 + i], r = ({['0'] = 'gone', s = 'stolen', m = 'max_hold'})[out[i]]}
    if out[i] == 's' and not cur.err and cur[4] then ev.by = 'fence ' .. cur[4] end
    history_append(KEYS[2 * n + i], history, now, ev)
  end
end
return table.concat(out)
