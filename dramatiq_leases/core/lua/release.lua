-- KEYS: lease, fence. ARGV: token. Returns 1 if released, 0 if the token
-- did not hold the lease (nothing is touched then). The holder always has the
-- newest fence of its key, so it is recorded as the last one released.
local cur = redis.pcall('HMGET', KEYS[1], 'token', 'fence')
if cur.err or not cur[1] or cur[1] ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
local fence = tonumber(cur[2]) or 0
if fence > 0 then redis.call('HSET', KEYS[2], 'released', fence) end
return 1
