-- KEYS: lease keys. ARGV: token and ttl_ms for each key, in order.
-- Returns one code per key: 1 renewed, 0 gone, -1 held by another token,
-- -2 maximum hold reached (not extended; it expires on its own).
-- The TTL is never extended past the lease's maximum hold.
-- The largest number of milliseconds accepted (dramatiq_leases.core.scripts.MAX_MS).
local MAX_MS = 1000000000000
-- A whole number in [lo, hi], or nil.
local function whole(value, lo, hi)
  local n = tonumber(value)
  if n == nil or n ~= math.floor(n) or n < lo or n > hi then return nil end
  return n
end
local function bad(name, value)
  return redis.error_reply('ERR dramatiq-leases: invalid ' .. name .. ' ' .. tostring(value))
end
local function server_now()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
if #ARGV ~= 2 * #KEYS then return bad('argument count', #ARGV) end
for i = 1, #KEYS do
  if whole(ARGV[2 * i], 1, MAX_MS) == nil then return bad('ttl', ARGV[2 * i]) end
end
local now = server_now()
local out = {}
for i, key in ipairs(KEYS) do
  local cur = redis.pcall('HMGET', key, 'token', 'max_hold_until_ms')
  if cur.err then
    out[i] = -1
  elseif not cur[1] then
    out[i] = 0
  elseif cur[1] ~= ARGV[2 * i - 1] then
    out[i] = -1
  else
    local px = tonumber(ARGV[2 * i])
    local until_ms = tonumber(cur[2]) or 0
    if until_ms > 0 and until_ms - now < px then px = until_ms - now end
    if px <= 0 then
      out[i] = -2
    else
      redis.call('PEXPIRE', key, px)
      redis.call('HSET', key, 'renewed_ms', now)
      out[i] = 1
    end
  end
end
return out
