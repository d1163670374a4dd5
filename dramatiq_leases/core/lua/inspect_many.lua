-- KEYS: lease keys. No ARGV. Returns the server time, then for each key
-- {pttl, flat field/value list} (an empty list for a key that is not a hash).
local function server_now()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local out = {server_now()}
for i, key in ipairs(KEYS) do
  local pttl = redis.call('PTTL', key)
  local fields = redis.pcall('HGETALL', key)
  if fields.err then fields = {} end
  out[i + 1] = {pttl, fields}
end
return out
