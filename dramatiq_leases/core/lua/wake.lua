-- KEYS:
--   1.. list: the wake lists of the waiters to wake (keys.wake_name), all of one key
-- ARGV: none
-- Wakes each waiter waiting in place: a push on the list it blocks on, kept until it has had time to block
-- (a waiter that blocks later finds it at once). Sent by the caller of a script that answered which
-- waiters it woke, right after it. A list of another type (written by hand) is replaced. Returns how many.
for _, list in ipairs(KEYS) do
  local pushed = redis.pcall('LPUSH', list, 1)
  if type(pushed) == 'table' and pushed.err then
    redis.call('DEL', list)
    redis.call('LPUSH', list, 1)
  end
  redis.call('PEXPIRE', list, WAKE_TTL_MS)
end
return #KEYS
