-- KEYS:
--   1.. lease: the lease hashes to read
-- ARGV: none
-- Returns the server time, then for each key {pttl, flat field/value list} (an empty list for a key that is
-- not a hash).
--#include clock
local now = server_time()
local out = {now}
for i, key in ipairs(KEYS) do
  local pttl = redis.call('PTTL', key)
  local fields = redis.pcall('HGETALL', key)
  if fields.err then fields = {} end
  out[i + 1] = {pttl, fields}
end
return out
