"""Lua scripts behind every lease operation, loaded once from ``core/lua/*.lua``.

Each operation is one script and one round trip; each ``.lua`` file is
complete on its own, its header saying its KEYS, ARGV and replies. A script only touches the
keys passed in ``KEYS``, and those always share one hash tag, so every script
runs unchanged on Redis Cluster.

Key layout for a lease key ``K`` under prefix ``P`` (``T`` is the hash tag,
see :func:`dramatiq_leases.core.keys.hash_tag`):

* ``P:lease:{T}``: a hash holding the lease: ``token``, ``fence``, ``ttl``,
  ``interval``, ``margin_ms``, ``acquired_ms``, ``renewed_ms``,
  ``max_hold_until_ms`` (0: none), ``adopted_ms`` (set once a handed-over lease
  was adopted) and the holder's metadata. It always carries a TTL.
* ``P:fence:{T}``: a hash that outlives every grant: ``fence`` (the last
  fencing token handed out), ``released`` (the last fence released),
  ``released_ms`` (when) and ``expired`` (the last fence seen ending by TTL).
* ``P:line:{T}``: the line of waiters, a sorted set by first attempt;
  ``P:waiters:{T}``: each waiter's state, ``"<p|m|r> <deadline_ms> <holder> <actor>"``
  (parked, promoted, waiting in place); ``P:line:{T}:w:<waiter>``: the list a
  waiter waiting in place blocks on; ``P:done:{T}``: waiters that ran, by
  expiry. See :mod:`.line`. All carry TTLs.

The holder's deadline. A holder stops trusting its lease ``margin_ms`` before
the key can expire: at ``min(renewed_ms + ttl, max_hold_until_ms) - margin_ms``
in server time, or earlier (it counts from when it *sent* the renewal), and the
margin is the time its interrupted actor has to stop. Those are facts the
holder wrote itself, so a script that finds the deadline *and* the margin past
knows no holder can still be running under the lease: that, and only that, is
what :data:`RELEASE_IF_DEAD` calls dead. It is the instant the key would have
expired by itself had nobody changed its TTL.

Lua scripts are not transactions: a command that fails midway keeps the writes
before it. So every script checks all of its arguments before its first write,
and a lease hash gets its TTL in the command right after the one that creates
it, which cannot fail (``PEXPIRE`` of a valid integer on a key just written).

Times are Redis server time (``TIME``) in milliseconds, so hosts with skewed
clocks agree on ages and deadlines.
"""

from __future__ import annotations

from importlib.resources import files

#: The largest number of milliseconds any argument may carry (about 31 years):
#: sums of such numbers stay exact in Lua's doubles and valid for ``PEXPIRE``.
#: The scripts that check numbers declare the same value.
MAX_MS = 10**12


def _load(name: str) -> str:
    return files(__package__).joinpath("lua").joinpath(f"{name}.lua").read_text(encoding="utf-8")


#: Acquire a free key (see ``lua/acquire.lua``).
ACQUIRE = _load("acquire")
#: Renew many leases of one slot (``lua/renew_many.lua``).
RENEW_MANY = _load("renew_many")
#: Release by owner token (``lua/release.lua``).
RELEASE = _load("release")
#: Release only a lease nobody can still be running under (``lua/release_if_dead.lua``).
RELEASE_IF_DEAD = _load("release_if_dead")
#: Adopt a handed-over lease, once (``lua/adopt.lua``).
ADOPT = _load("adopt")
#: Hold parked waiters, or leave the line (``lua/line.lua``).
LINE = _load("line")
#: Read many lease hashes with the server time (``lua/inspect_many.lua``).
INSPECT_MANY = _load("inspect_many")

#: Every script, by name.
ALL = {
    "acquire": ACQUIRE,
    "renew_many": RENEW_MANY,
    "release": RELEASE,
    "release_if_dead": RELEASE_IF_DEAD,
    "adopt": ADOPT,
    "inspect_many": INSPECT_MANY,
    "line": LINE,
}
