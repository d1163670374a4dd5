"""Lua scripts behind every lease operation, built once from ``core/lua/*.lua``.

One script and one round trip per operation (a grant or release without options tries a plain script
first). The loader copies in ``lua/prelude.lua``'s sections at each ``--#include``, keeps a variant's
``--#if`` lines, and declares the constants of :data:`LUA_CONSTANTS` each script names. How a script is
built, the keys it may touch (:data:`CHECK_KEYS`), the key layout and the holder's deadline:
docs/scripts.md.
"""

from __future__ import annotations

import os
import re
from importlib.resources import files

#: The largest number of milliseconds any argument may carry (about 31 years):
#: sums of such numbers stay exact in Lua's doubles and valid for ``PEXPIRE``.
MAX_MS = 10**12
#: The largest Unix time in milliseconds a script accepts (the year 2286; ``numbers.MAX_TIMESTAMP_MS``).
MAX_TIMESTAMP_MS = 10**13
#: The most waiters of one key that may wait in place (a script's bound on ``ready``).
MAX_READY = 1000
#: The longest waiter id or holder channel a script accepts (characters).
MAX_ID_LENGTH = 512
#: The longest a waiter in place blocks on its wake list in one call, in ms (``client.MAX_BLOCK_S``).
MAX_BLOCK_MS = 10_000
#: A waiter in place blocks at least this long, and this long past the instant it expects its turn (ms).
BLOCK_SLACK_MS = 50
#: How long past its block a waiter in place keeps its place, to come back and block again (ms).
READY_SLACK_MS = 2_000
#: How long a wake-up waits in its list for a waiter that has not blocked yet (ms; ``line.WAKE_TTL_MS``).
WAKE_TTL_MS = MAX_BLOCK_MS + READY_SLACK_MS
#: How long a line and its waiters are kept after their last change (ms).
LINE_TTL_MS = 86_400_000
#: How long a waiter that ran is remembered, so a stray copy of its message never runs again (ms).
DONE_MS = 3_600_000
#: How long a fence counter made again to record a release is kept when the caller knows no retention (ms).
RECORD_MS = 3_600_000
#: The most holders one key may have at once (``keys.MAX_LIMIT``).
MAX_LIMIT = 1000
#: How many vanished waiters one call drops from the head of a line at most (bounded work per call).
HEAD_DROPS_MAX = 16
#: The most events a key's history keeps (the bound on ``Leases(history=N)``).
MAX_HISTORY = 10_000
#: How long a key's history is kept after its last event (ms): a week.
HISTORY_MS = 7 * 86_400_000
#: The largest order a message may carry (``lock_on_busy="latest"``; microseconds, exact in Lua's doubles).
MAX_ORDER = 2**53 - 1
#: How long a key's order record is kept after its last change (ms): a week, as long as Dramatiq keeps a
#: message that can still come back (the longest delay, a dead letter) and as long as a backlog is allowed to be.
ORDER_MS = 7 * 86_400_000
#: How far ahead of the Redis server's clock a message's order may be (ms; a producer's clock ahead, with no
#: order from Redis): one further ahead counts as this far, so that it cannot hold newer messages back for longer.
ORDER_AHEAD_MS = 60_000

#: The most rates one key may be given at once (``lock_rate``; see :mod:`.rates`).
MAX_RATES = 4
#: The most grants one rate may allow per window: its ring keeps 8 bytes per grant (800 KB per key at most).
MAX_RATE_COUNT = 100_000
#: The longest window of a rate (ms): 366 days.
MAX_RATE_WINDOW = 366 * 86_400_000
#: The longest a holder may hold its key back at its release (ms; ``RateLimited``'s ``retry_after``): a day.
MAX_HOLD_BACK_MS = 86_400_000

#: The longest quiet window, and cap, of a debounce (``lock_debounce``, ``lock_debounce_max``; ms): a day.
MAX_DEBOUNCE_MS = 86_400_000
#: How long a key's debounce record is kept after its last change (ms): a week, as an order record (a message
#: older than the last run must still be known as such when a backlog or a dead letter brings it back).
DEBOUNCE_MS = 7 * 86_400_000
#: How often a message waiting for a newer send's confirm asks again, at most (ms).
DEBOUNCE_STEP_MS = 250
#: The debounce script's verdicts on a delivery (``core.debounce.Verdict``).
DEBOUNCE_RUN, DEBOUNCE_WAIT, DEBOUNCED = 1, 2, 3

#: The acquire script's answers: granted, or busy with what its waiter should do (``lease.Wait``, in this order).
GRANTED, BUSY = 1, 0
WAIT_NONE, WAIT_IN_PLACE, WAIT_PARK, WAIT_SOON, WAIT_DUPLICATE, WAIT_SUPERSEDED, WAIT_COPY_HOLDS, WAIT_GRACE = range(8)
#: The release script's answers (``protocol.Released``): not held (nothing touched), released, released earlier.
NOT_HELD, RELEASED, RELEASED_EARLIER = 0, 1, 2
#: The plain scripts' answer when a request is not theirs to decide (nothing written): the general script decides.
NOT_PLAIN = -1
#: A script's answer ``{NEED_SLOTS, width}`` when the key has more holder slots than its caller declared (nothing
#: written): asked again with ``width`` slots' names.
NEED_SLOTS = -2

#: Every constant the Lua uses, by the name it uses: the loader declares those a script names.
LUA_CONSTANTS: dict[str, int] = {
    "MAX_MS": MAX_MS,
    "MAX_TIMESTAMP_MS": MAX_TIMESTAMP_MS,
    "MAX_READY": MAX_READY,
    "MAX_ID_LENGTH": MAX_ID_LENGTH,
    "MAX_BLOCK_MS": MAX_BLOCK_MS,
    "BLOCK_SLACK_MS": BLOCK_SLACK_MS,
    "READY_SLACK_MS": READY_SLACK_MS,
    "WAKE_TTL_MS": WAKE_TTL_MS,
    "LINE_TTL_MS": LINE_TTL_MS,
    "DONE_MS": DONE_MS,
    "RECORD_MS": RECORD_MS,
    "HEAD_DROPS_MAX": HEAD_DROPS_MAX,
    "MAX_LIMIT": MAX_LIMIT,
    "MAX_HISTORY": MAX_HISTORY,
    "HISTORY_MS": HISTORY_MS,
    "MAX_ORDER": MAX_ORDER,
    "ORDER_MS": ORDER_MS,
    "ORDER_AHEAD_MS": ORDER_AHEAD_MS,
    "MAX_RATES": MAX_RATES,
    "MAX_RATE_COUNT": MAX_RATE_COUNT,
    "MAX_RATE_WINDOW": MAX_RATE_WINDOW,
    "MAX_HOLD_BACK_MS": MAX_HOLD_BACK_MS,
    "MAX_DEBOUNCE_MS": MAX_DEBOUNCE_MS,
    "DEBOUNCE_MS": DEBOUNCE_MS,
    "DEBOUNCE_STEP_MS": DEBOUNCE_STEP_MS,
    "DEBOUNCE_RUN": DEBOUNCE_RUN,
    "DEBOUNCE_WAIT": DEBOUNCE_WAIT,
    "DEBOUNCED": DEBOUNCED,
    "GRANTED": GRANTED,
    "BUSY": BUSY,
    "WAIT_NONE": WAIT_NONE,
    "WAIT_IN_PLACE": WAIT_IN_PLACE,
    "WAIT_PARK": WAIT_PARK,
    "WAIT_SOON": WAIT_SOON,
    "WAIT_DUPLICATE": WAIT_DUPLICATE,
    "WAIT_SUPERSEDED": WAIT_SUPERSEDED,
    "WAIT_COPY_HOLDS": WAIT_COPY_HOLDS,
    "WAIT_GRACE": WAIT_GRACE,
    "NOT_HELD": NOT_HELD,
    "RELEASED": RELEASED,
    "RELEASED_EARLIER": RELEASED_EARLIER,
    "NOT_PLAIN": NOT_PLAIN,
    "NEED_SLOTS": NEED_SLOTS,
}

#: Whether the scripts are built with the check that fails a script on a key it was not given in ``KEYS``
#: (``DRAMATIQ_LEASES_CHECK_KEYS=1``, read at import; for tests: the check costs a table lookup per command).
CHECK_KEYS = os.environ.get("DRAMATIQ_LEASES_CHECK_KEYS") == "1"

# The check: every command goes through it (the loader rewrites redis.call and redis.pcall), and each command's
# keys must be in KEYS. The commands the scripts use, by where their keys are: TIME, INFO and PUBLISH take none,
# EXISTS and DEL only keys, every other the first argument. A command not listed fails too, so that a new one
# is placed here.
_CHECK = """\
local __declared = {}
for _, k in ipairs(KEYS) do __declared[k] = true end
local function __set(words)
  local set = {}
  for c in string.gmatch(words, '%%S+') do set[c] = true end
  return set
end
local __none, __all, __first = __set('TIME INFO PUBLISH'), __set('EXISTS DEL'), __set('%s')
local function __check(cmd, ...)
  local c = string.upper(cmd)
  if __none[c] then return end
  local args = {...}
  local n = 1
  if __all[c] then n = #args elseif not __first[c] then error('dramatiq-leases: command not checked: ' .. c) end
  for i = 1, n do
    local k = args[i]
    if not __declared[k] then error('dramatiq-leases: undeclared key ' .. tostring(k) .. ' (' .. c .. ')') end
  end
end
local function __call(cmd, ...) __check(cmd, ...) return redis.call(cmd, ...) end
local function __pcall(cmd, ...) __check(cmd, ...) return redis.pcall(cmd, ...) end
"""
_FIRST_KEY_COMMANDS = (
    "GET SET GETRANGE SETRANGE TYPE PTTL PEXPIRE HGET HSET HMGET HDEL HEXISTS HGETALL HINCRBY ZADD ZREM ZRANGE "
    "ZSCORE ZMSCORE ZRANK ZCARD ZREMRANGEBYSCORE LPUSH LTRIM LRANGE"
)

_INCLUDE = re.compile(r"^--#include((?: \w+)+)\n", re.MULTILINE)
_IF = re.compile(r"^--#if (\w+)\n(.*?)(?:^--#else\n(.*?))?^--#end\n", re.MULTILINE | re.DOTALL)
_DIRECTIVE = re.compile(r"^--#(?:if|else|end)\b", re.MULTILINE)
_SECTION = re.compile(r"^--#section (\w+)\n", re.MULTILINE)


def _read(name: str) -> str:
    return files(__package__).joinpath("lua").joinpath(f"{name}.lua").read_text(encoding="utf-8")


def _sections() -> dict[str, str]:
    """The prelude's sections by name (the text before the first one is the prelude's own comment)."""
    parts = _SECTION.split(_read("prelude"))
    return {name: text.strip("\n") + "\n" for name, text in zip(parts[1::2], parts[2::2], strict=True)}


def _build(source: str, sections: dict[str, str], variant: frozenset[str] = frozenset(), *, check: bool = False) -> str:
    """A script's text as Redis runs it: ``source``'s header, the constants it names, then its body with each
    ``--#if NAME`` block kept or left out (kept if ``variant`` has NAME) and each ``--#include`` replaced by the
    sections named (each once per script); with ``check``, every command goes through the declared keys'
    check first (see :data:`CHECK_KEYS`).

    Raises:
      ValueError: an unknown section, one included twice, or an ``--#if`` without its ``--#end`` (or nested).
    """
    lines = source.splitlines(keepends=True)
    n = next((i for i, line in enumerate(lines) if not line.startswith("--") or line.startswith("--#")), len(lines))
    header, body = "".join(lines[:n]), "".join(lines[n:])
    body = _IF.sub(lambda m: m.group(2) if m.group(1) in variant else (m.group(3) or ""), body)
    stray = _DIRECTIVE.search(body)
    if stray:
        raise ValueError(f"{stray.group(0)}: unmatched, or nested")
    seen: set[str] = set()

    def include(match: re.Match[str]) -> str:
        names = match.group(1).split()
        for name in names:
            if name not in sections or name in seen:
                raise ValueError(f"--#include {name}: {'unknown' if name not in sections else 'twice'}")
            seen.add(name)
        return "".join(sections[name] for name in names)

    body = _INCLUDE.sub(include, body)
    named = [name for name in LUA_CONSTANTS if re.search(rf"\b{name}\b", body)]
    declared = "".join(f"local {name} = {LUA_CONSTANTS[name]}\n" for name in named)
    if check:
        body = _CHECK % _FIRST_KEY_COMMANDS + body.replace("redis.call(", "__call(").replace("redis.pcall(", "__pcall(")
    return header + declared + body


def _load(name: str, *variant: str) -> str:
    return _build(_read(name), _SECTIONS, frozenset(variant), check=CHECK_KEYS)


_SECTIONS = _sections()

#: Acquire a free key (see ``lua/acquire.lua``), for every actor but ``lock_on_busy="latest"``.
ACQUIRE = _load("acquire")
#: Acquire as ``lock_on_busy="latest"``: ``lua/acquire.lua`` with its ``--#if latest`` parts (the order record).
ACQUIRE_LATEST = _load("acquire", "latest")
#: Grant a plainly free key of one holder, or answer NOT_PLAIN (``lua/acquire_plain.lua``).
ACQUIRE_PLAIN = _load("acquire_plain")
#: Renew many leases of one slot (``lua/renew_many.lua``).
RENEW_MANY = _load("renew_many")
#: Release by owner token (``lua/release.lua``).
RELEASE = _load("release")
#: Release a plain holder of a key without a line, or answer NOT_PLAIN (``lua/release_plain.lua``).
RELEASE_PLAIN = _load("release_plain")
#: Release only a lease nobody can still be running under (``lua/release_if_dead.lua``).
RELEASE_IF_DEAD = _load("release_if_dead")
#: Adopt a handed-over lease, once (``lua/adopt.lua``).
ADOPT = _load("adopt")
#: Hold parked waiters, or leave the line (``lua/line.lua``).
LINE = _load("line")
#: Take, keep or end a message's unique record (``lua/unique.lua``).
UNIQUE = _load("unique")
#: The order of a send, for ``lock_on_busy="latest"`` (``lua/order.lua``).
ORDER = _load("order")
#: A key's bursts of sends, and which message of each runs (``lock_debounce``: ``lua/debounce.lua``).
DEBOUNCE = _load("debounce")
#: Read many lease hashes with the server time (``lua/inspect_many.lua``).
INSPECT_MANY = _load("inspect_many")
#: Append an event decided outside the scripts to a key's history (``lua/history.lua``).
HISTORY = _load("history")
#: Wake waiters waiting in place, named by a script's answer (``lua/wake.lua``).
WAKE = _load("wake")

#: Every script, by name.
ALL = {
    "acquire": ACQUIRE,
    "acquire_latest": ACQUIRE_LATEST,
    "acquire_plain": ACQUIRE_PLAIN,
    "renew_many": RENEW_MANY,
    "release": RELEASE,
    "release_plain": RELEASE_PLAIN,
    "release_if_dead": RELEASE_IF_DEAD,
    "adopt": ADOPT,
    "inspect_many": INSPECT_MANY,
    "line": LINE,
    "history": HISTORY,
    "unique": UNIQUE,
    "order": ORDER,
    "debounce": DEBOUNCE,
    "wake": WAKE,
}
#: The file (``lua/<name>.lua``) of each script of :data:`ALL` not built from a file of its own name.
FILES = {"acquire_latest": "acquire"}
