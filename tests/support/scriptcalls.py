"""The acquire and release scripts called by hand, as the store calls them, with arguments replaced by name
(``protocol.GRANT_ARGV``, ``protocol.RELEASE_ARGV``): for tests of what a script refuses or writes."""

from __future__ import annotations

from typing import Any

import redis

from dramatiq_leases.core import scripts
from dramatiq_leases.core.keys import line_names, script_names, wake_name
from dramatiq_leases.core.protocol import GRANT_ARGV, RELEASE_ARGV, GrantRequest, Join, ReleaseRequest


def grant_call(
    key: str = "k", *, prefix: str = "t", keys: list[str] | None = None, script: str | None = None, **named: Any
) -> list[Any]:
    """``EVAL`` arguments of ``lua/acquire.lua`` (its latest build if ``policy`` is 1) for a plain grant of
    ``key`` by token ``tok`` (60 s), each ARGV ``named`` replaced; ``keys`` replaces the KEYS, ``script`` the
    build."""
    latest = str(named.get("policy", 0)) == "1"
    request = GrantRequest(
        key,
        "tok",
        60_000,
        latest=latest,
        order=1 if latest else 0,
        waiter="w" if latest else "",
        join=Join.PARK if latest else Join.NEVER,
    )
    # As many holder slots declared as a good limit needs (the store declares its request's).
    limit = named.get("limit")
    width = limit if isinstance(limit, int) and 1 <= limit <= scripts.MAX_LIMIT else 1
    names, args = request.encode(prefix, 0, 0, width=width)
    for name, value in named.items():
        args[GRANT_ARGV.index(name)] = value
    names = names if keys is None else keys
    script = script or (scripts.ACQUIRE_LATEST if latest else scripts.ACQUIRE)
    return [script, len(names), *names, *args]


def acquire(client: redis.Redis, key: str = "k", **named: Any) -> Any:
    """The acquire script's reply to :func:`grant_call`."""
    return client.eval(*grant_call(key, **named))


def release_call(key: str = "k", *, prefix: str = "t", **named: Any) -> list[Any]:
    """``EVAL`` arguments of ``lua/release.lua`` for a release of ``key`` by token ``tok``, each ARGV ``named``
    replaced."""
    names, args = ReleaseRequest(key, "tok").encode(prefix, 0, 0)
    for name, value in named.items():
        args[RELEASE_ARGV.index(name)] = value
    return [scripts.RELEASE, len(names), *names, *args]


def line_call(op: str, holder: str, *args: Any, key: str = "k", prefix: str = "t") -> list[Any]:
    """``EVAL`` arguments of ``lua/line.lua``: ``op``, ``holder``, then park_ms, ready, promote_ms and the waiters
    (``args``), with the keys the store declares (a key of one holder slot)."""
    names, (_, waiters_key, _, _) = script_names(prefix, key), line_names(prefix, key)
    keys = [names[0], names[2], waiters_key, names[3], names[1], *(wake_name(prefix, key, str(w)) for w in args[3:])]
    return [scripts.LINE, len(keys), *keys, op, holder, *args]


def renew_call(names: list[str] | list[bytes], ttl: Any, *tokens: Any, prefix: str = "t") -> list[Any]:
    """``EVAL`` arguments of ``lua/renew_many.lua`` renewing the lease hashes ``names`` with ``tokens``, each
    lease's fence counter declared after them (no history)."""
    names = [name.decode() if isinstance(name, bytes) else name for name in names]
    fences = [name.replace(":lease:", ":fence:", 1).rsplit("}", 1)[0] + "}" for name in names]
    return [scripts.RENEW_MANY, 2 * len(names), *names, *fences, ttl, *tokens]
