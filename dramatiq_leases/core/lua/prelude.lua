-- The helpers every script shares, written once. Not a script: core/scripts.py copies a section into a
-- script where the script says `--#include NAME` (at the top for what its fast path needs, later for the
-- rest, so the fast path creates no closure it does not call). The constants (MAX_MS ...) come from
-- core/scripts.py, declared by the loader in each script that names them. Every helper takes what it
-- works on as arguments: no upvalue but those constants, so a section reads the same in every script.

--#section args
-- A whole number in [lo, hi], or nil.
local function whole(value, lo, hi)
  local n = tonumber(value)
  if n == nil or n ~= math.floor(n) or n < lo or n > hi then return nil end
  return n
end
-- The reply refusing an argument (returned before the script's first write), with its value if given.
local function bad(name, value)
  if value == nil then return redis.error_reply('ERR dramatiq-leases: invalid ' .. name) end
  return redis.error_reply('ERR dramatiq-leases: invalid ' .. name .. ' ' .. tostring(value))
end

--#section grant
-- The arguments both grant scripts take first (ARGV 1-7: core/protocol.py's GRANT_PLAIN_ARGV), checked in
-- order: nil and their values, or the reply refusing the first bad one (returned before any write).
local function grant_head(argv)
  local token, waiter = argv[1], argv[7]
  local ttl_ms = whole(argv[2], 1, MAX_MS)
  local max_hold_ms = whole(argv[3], 0, MAX_MS)
  local interval_ms = whole(argv[4], 0, MAX_MS)
  local retention_ms = whole(argv[6], 0, MAX_MS)
  if token == nil or token == '' then return bad('token', token) end
  if ttl_ms == nil then return bad('ttl_ms', argv[2]) end
  if max_hold_ms == nil then return bad('max_hold_ms', argv[3]) end
  if interval_ms == nil then return bad('interval_ms', argv[4]) end
  local margin_ms = whole(argv[5], 0, ttl_ms - 1)
  if margin_ms == nil then return bad('margin_ms', argv[5]) end
  if retention_ms == nil then return bad('retention_ms', argv[6]) end
  if waiter == nil or #waiter > MAX_ID_LENGTH then return bad('waiter', waiter) end
  return nil, token, waiter, ttl_ms, max_hold_ms, interval_ms, margin_ms, retention_ms
end

--#section clock
-- Redis server time, in milliseconds and in microseconds (exact in a double: below 2^53).
local function server_time()
  local t = redis.call('TIME')
  local s, us = tonumber(t[1]), tonumber(t[2])
  return s * 1000 + math.floor(us / 1000), s * 1000000 + us
end

--#section uptime
-- How long the server has been up, in ms, rounded down to its second (INFO's resolution: never more than it
-- was). INFO costs more than a command: asked only where a restart would matter (see acquire.lua's grace_ms).
local function uptime_ms()
  local up = string.match(redis.call('INFO', 'server'), 'uptime_in_seconds:(%d+)')
  return (tonumber(up) or 0) * 1000
end

--#section epoch
-- The failover grace left (ms; 0 or less: none), from the epoch record of the key's Cluster slot: a string,
-- "<rid> <since>": the server's replication id when a grant of the slot last looked, and when a grant first
-- saw a change (0: never). Kept for ever (at most one per slot, 16 384): a record that expired under a lease
-- held and renewed for longer would leave that holder without a grace. The id (INFO replication's
-- master_replid) is new at every start of the server and on every replica promoted, the times a store may
-- have lost writes it acknowledged. A change: the record names another id, is of another type or form
-- (written by hand), says it was seen later than now (the clock stepped back), or is missing on a server
-- promoted since its start (master_replid2 set; a missing record is otherwise a slot never granted in, or a
-- store that forgot everything: restart_grace's case). Each slot's grace starts at its first grant after a
-- change, which is no earlier than the change. A plain grant (lua/acquire_plain.lua) writes a missing record
-- but leaves a change to lua/acquire.lua (`plain`). A server that refuses INFO to the caller (an ACL without
-- @dangerous): no grace.
local function failover_left(record, grace_ms, now, plain)
  local info = redis.pcall('INFO', 'replication')
  if type(info) ~= 'string' then return 0 end
  local id = string.match(info, 'master_replid:(%w+)') or ''
  local rec = redis.pcall('GET', record)
  local rid, since
  if type(rec) == 'string' then rid, since = string.match(rec, '^(%w*) (%d+)$') end
  since = tonumber(since) or 0
  local changed = true
  if rid then
    changed = rid ~= id or since > now
  elseif rec == false then
    local promoted = string.match(info, 'master_replid2:(%w+)')
    changed = promoted ~= nil and string.find(promoted, '[^0]') ~= nil
  end
  if changed then
    if plain then return grace_ms end
    since = now
  end
  if changed or not rid then redis.call('SET', record, string.format('%s %d', id, since)) end
  return since + grace_ms - now
end

--#section slots
-- A key may have several holders at once (its limit): holder slot s is a lease hash of its own, named after
-- the lease (slot 0 is the lease's own name, `<lease>:s` the others'), so each holder's TTL, token and release
-- are its own. The caller declares the names of slots 1 .. n - 1 in KEYS from index `first` on (a script
-- builds no key name): `declared_slots` gives them by slot, with n. A script that finds the key wider than n
-- (its counter's width) answers {NEED_SLOTS, width} before its first write, and is asked again with them.
local function declared_slots(lease, first)
  local names = {[0] = lease}
  for i = first, #KEYS do names[i - first + 1] = KEYS[i] end
  return names, #KEYS - first + 2
end
-- How many of slots 0 .. width - 1 (names: declared_slots') are held, and whether the line exists, in one
-- command.
local function present(names, width, line)
  local list = {}
  for s = 0, width - 1 do list[#list + 1] = names[s] end
  if line then list[#list + 1] = line end
  return redis.call('EXISTS', unpack(list))
end

--#section rate
-- A key's rates (lock_rate, core/rates.py): `rates` a list of {count, window_ms}, `names` each one's ring, a
-- string: 8 bytes of header, the number of grants recorded, then the server time (µs) of each of the last
-- `count` grants, 8 bytes each, the oldest at (grants % count), all as struct's big-endian doubles (exact
-- below 2^53). A ring lives one window after its last grant: by then every time in it is a window old. One of
-- another type or form (written by hand) counts as empty, and rate_record replaces it.
local function rate_grants(name)
  local raw = redis.pcall('GETRANGE', name, 0, 7)
  if type(raw) ~= 'string' or (#raw > 0 and #raw < 8) then return nil end
  if #raw == 0 then return 0 end
  local n = struct.unpack('>d', raw)
  if n ~= n or n < 0 or n ~= math.floor(n) or n >= 2 ^ 53 then return nil end
  return n
end
-- How long until every rate allows one more grant (ms, rounded up; 0: now), at `now_us`: the oldest of a full
-- ring's times plus the window. A time later than now (the clock stepped back, or written by hand) is made now
-- where it is read: the key waits a window more at most, not until the clock catches up.
local function rate_wait(names, rates, now_us)
  local wait = 0
  for i, r in ipairs(rates) do
    local n = rate_grants(names[i])
    if n and n >= r[1] then
      local at = 8 + 8 * (n % r[1])
      local raw = redis.call('GETRANGE', names[i], at, at + 7)
      if #raw == 8 then
        local t = struct.unpack('>d', raw)
        if t ~= t or t > now_us then
          t = now_us
          redis.call('SETRANGE', names[i], at, struct.pack('>d', now_us))
        end
        wait = math.max(wait, math.ceil((t + r[2] * 1000 - now_us) / 1000))
      end
    end
  end
  return wait
end
-- Records a grant at `now_us` in every ring (its TTL set by the command after the one that may create it: a
-- window and a millisecond, since `now_us` may be up to a millisecond past the instant PEXPIRE counts from).
local function rate_record(names, rates, now_us)
  for i, r in ipairs(rates) do
    local n = rate_grants(names[i])
    if n == nil then
      redis.call('DEL', names[i])
      n = 0
    end
    redis.call('SETRANGE', names[i], 8 + 8 * (n % r[1]), struct.pack('>d', now_us))
    redis.call('PEXPIRE', names[i], r[2] + 1)
    redis.call('SETRANGE', names[i], 0, struct.pack('>d', n + 1))
  end
end

--#section counter
-- Records fence as the last released in the fence counter (how the exporter tells a release from an
-- expiry), with the field/value pairs given. A counter of another type (written by hand) is left alone: the
-- write fails without effect. One that is gone (a fleet's retention expired it during a long hold) is made
-- again only with a TTL: the caller's retention, else RECORD_MS (a caller without the setting, such as the CLI,
-- would otherwise keep it for ever). A counter's first grant writes `released` 0, so a write that adds fields
-- to a counter without a `fence` is one that made it again.
-- A grant of a key with several holders (its hash has a `slot`) is recorded per slot: `r:<slot>`. `wide`: the
-- holder was granted while the key had one holder, and the key has had several since (its hash has `wide`): its
-- record stays `released`, but the counter, whose width counts the others, is never shortened by it either.
local function record_release(fence_key, fence, retention_ms, slot, wide, ...)
  local field = 'released'
  if slot then field = 'r:' .. slot end
  -- A number given to redis.call is stored as an integer, exact (a fence may have 16 digits).
  local added = redis.pcall('HSET', fence_key, field, fence, ...)
  if type(added) ~= 'number' then return end
  if retention_ms > 0 then
    -- A wide key's counter outlives its holders (see acquire.lua): a release never shortens it.
    if not (slot or wide) or redis.call('PTTL', fence_key) < retention_ms then
      redis.call('PEXPIRE', fence_key, retention_ms)
    end
  elseif added > 0 and redis.call('HEXISTS', fence_key, 'fence') == 0 then
    redis.call('PEXPIRE', fence_key, RECORD_MS)
  end
end

--#section line
-- The line is a sorted set of waiters by first attempt; each waiter's entry in the waiters hash is
-- "state deadline holder actor": p parked, m promoted (asked to come back), r waiting in place; one past
-- its deadline has vanished and loses its place.
local function entry(waiters, w)
  local e = redis.call('HGET', waiters, w)
  if not e then return nil end
  local state, deadline, holder, actor = string.match(e, '^(%a) (%d+) (%S*) ?(.*)$')
  return {state = state, deadline = tonumber(deadline), holder = holder, actor = actor}
end
local function put(waiters, w, state, deadline, holder, actor)
  redis.call('HSET', waiters, w, state .. ' ' .. deadline .. ' ' .. holder .. ' ' .. actor)
end
-- A waiter leaves the line: its place, its entry, and its wake list if the caller declared it (`list`; one
-- left behind ends by its TTL, and a stale wake-up costs its waiter one more ask).
local function forget(line, waiters, w, list)
  redis.call('ZREM', line, w)
  redis.call('HDEL', waiters, w)
  if list then redis.call('DEL', list) end
end
-- The first n live waiters of the line, as {waiter, entry} pairs, dropping vanished ones on the way (bounded
-- work per call: HEAD_DROPS_MAX; past that a waiter is kept as it is, its entry perhaps nil).
local function line_front(line, waiters, now, n)
  local out, start, drops = {}, 0, 0
  while #out < n do
    local batch = redis.call('ZRANGE', line, start, start + n - #out - 1)
    if #batch == 0 then break end
    for _, w in ipairs(batch) do
      local e = entry(waiters, w)
      if (e and e.deadline >= now) or drops >= HEAD_DROPS_MAX then
        out[#out + 1] = {w, e}
        start = start + 1
      else
        redis.call('ZREM', line, w)
        redis.call('HDEL', waiters, w)
        drops = drops + 1
      end
    end
  end
  return out
end
-- Calls the first `ready` waiters forward: the parked are promoted (asked to come back: their holder
-- process is told on its channel; an unknown holder learns it when it registers), and the first `wake_n`
-- waiting in place are added to `woken`: the script answers them, and its caller wakes them (lua/wake.lua;
-- their wake lists are named after them, keys a script could not declare beforehand). Each waiter promoted
-- is set true in `promoted`, if given. `stay`: the parked stay parked (the key is over its rate: promoted, they
-- would only be refused again; they come back when it allows).
local function call_forward(line, waiters, now, ready, promote_ms, wake_n, woken, promoted, stay)
  for i, w in ipairs(redis.call('ZRANGE', line, 0, math.max(ready, 1) - 1)) do
    local e = entry(waiters, w)
    if e and i <= wake_n and e.state == 'r' then
      woken[#woken + 1] = w
    elseif e and e.state == 'p' and not stay then
      put(waiters, w, 'm', now + promote_ms, e.holder, e.actor)
      if e.holder ~= '' then redis.call('PUBLISH', e.holder, w) end
      if promoted then promoted[w] = true end
    end
  end
end

--#section history
-- A key's history (opt-in): a list beside the lease, `history:{tag}` (one hash slot with it), of compact
-- JSON events, newest first. history_append pushes event `ev` (a table; `ev.e` names it: 'granted',
-- 'released', ...) to the history `name` (declared by the caller) stamped with `now` (server ms), then keeps
-- the newest `cap` and HISTORY_MS from now.
-- `cap` 0: the history is off and nothing is done (no Redis call); -1 (a caller that cannot know the fleet's
-- cap, such as the CLI): only a history that exists is appended to, and kept to MAX_HISTORY. `meta`: the
-- holder's metadata JSON (the lease hash's `meta`), if the event is about a holder: its message id, actor
-- and host:pid are named in the event (m, a, h). A key of another type (written by hand) is replaced: no
-- error once the caller has written.
local function history_append(name, cap, now, ev, meta)
  if cap == 0 then return end
  if cap < 0 then
    if redis.call('EXISTS', name) == 0 then return end
    cap = MAX_HISTORY
  end
  if meta then
    local ok, m = pcall(cjson.decode, meta)
    if ok and type(m) == 'table' then
      if type(m.message_id) == 'string' then ev.m = m.message_id end
      if type(m.actor) == 'string' then ev.a = m.actor end
      if type(m.host) == 'string' or type(m.pid) == 'string' then
        ev.h = tostring(m.host or '') .. ':' .. tostring(m.pid or '')
      end
    end
  end
  -- Bounded events, not only a bounded count: a huge metadata value (or a unique send's actor) is cut to
  -- MAX_ID_LENGTH bytes, at a UTF-8 boundary (a cut character is dropped whole, so the event still decodes).
  for _, f in ipairs({'m', 'a', 'h'}) do
    local v = ev[f]
    if type(v) == 'string' and #v > MAX_ID_LENGTH then
      local next_byte = string.byte(v, MAX_ID_LENGTH + 1)
      v = string.sub(v, 1, MAX_ID_LENGTH)
      if next_byte >= 128 and next_byte < 192 then v = string.gsub(v, '[\192-\255][\128-\191]*$', '') end
      ev[f] = v
    end
  end
  ev.t = now
  local json = cjson.encode(ev)
  local pushed = redis.pcall('LPUSH', name, json)
  if type(pushed) == 'table' and pushed.err then
    redis.call('DEL', name)
    redis.call('LPUSH', name, json)
  end
  redis.call('LTRIM', name, 0, cap - 1)
  redis.call('PEXPIRE', name, HISTORY_MS)
end
