-- KEYS:
--   1 order: the key's order record (lock_on_busy="latest"): `seq`, the last order handed to a send; `seen`
--     and `by`, the newest order that reached the lease and its waiter (written by lua/acquire.lua)
-- Returns the order of a send, as text: the server's clock in microseconds, raised if need be above `seq` and
-- `seen`, so that the orders of one key only grow (a send's is above every earlier send's, and above every
-- message's that reached the lease before it), across an expiry of the record too (a clock never behind the
-- orders it handed out). The record is kept ORDER_MS after its last change. One of another type (written by
-- hand) is replaced.
--#include args clock
local _, now_us = server_time()
local rec = redis.pcall('HMGET', KEYS[1], 'seq', 'seen')
local seq, seen = 0, 0
if type(rec) == 'table' and rec.err then
  redis.call('DEL', KEYS[1])
else
  seq, seen = whole(rec[1], 0, MAX_ORDER) or 0, whole(rec[2], 0, MAX_ORDER) or 0
end
local order = math.min(MAX_ORDER, math.max(now_us, seq + 1, seen + 1))
redis.call('HSET', KEYS[1], 'seq', string.format('%d', order))
redis.call('PEXPIRE', KEYS[1], ORDER_MS)
return string.format('%d', order)
