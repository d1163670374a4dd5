-- KEYS: lease keys of one TTL. ARGV: ttl_ms, then the token of each key, in order.
-- Returns one character per key, as one string (cheaper to send and parse
-- than a list of numbers): '1' renewed, '0' gone, 's' held by another token
-- (stolen), 'm' maximum hold reached (not extended; it expires on its own).
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
if #ARGV ~= #KEYS + 1 then return bad('argument count', #ARGV) end
local ttl = whole(ARGV[1], 1, MAX_MS)
if ttl == nil then return bad('ttl', ARGV[1]) end
-- Every token before the first write (Lua is not a transaction): an empty one would renew a hash written
-- by hand with an empty token field.
for i = 2, #ARGV do
  if ARGV[i] == '' then return bad('token', "''") end
end
local now = server_now()
local out = {}
for i, key in ipairs(KEYS) do
  local cur = redis.pcall('HMGET', key, 'token', 'max_hold_until_ms')
  if cur.err then
    out[i] = 's'
  elseif not cur[1] then
    out[i] = '0'
  elseif cur[1] ~= ARGV[i + 1] then
    out[i] = 's'
  else
    local px = ttl
    local until_ms = tonumber(cur[2]) or 0
    if until_ms > 0 and until_ms - now < px then px = until_ms - now end
    if px <= 0 then
      out[i] = 'm'
    else
      redis.call('PEXPIRE', key, px)
      redis.call('HSET', key, 'renewed_ms', now)
      out[i] = '1'
    end
  end
end
return table.concat(out)
