"""``min_replicas``: grants and renewals that count only once replicas acknowledged them (``WAIT``).

Redis replicates asynchronously: a grant a failing primary had not yet sent to the replica that
replaces it is unknown there, and the key can be granted again. ``WAIT`` after each write, on the
same connection and in the same round trip, tells how many replicas have it. It is not consensus:
docs/replication.md says what it adds and what it does not.
"""

from __future__ import annotations

from typing import Any

import redis
from redis.cluster import RedisCluster

from .client import RedisClient, connection_kwargs, pipelined
from .errors import LeaseConfigError, LeaseUnavailableError

#: The most replicas ``min_replicas`` may ask to acknowledge a grant.
MAX_REPLICAS = 100

#: How long a grant or renewal waits for ``min_replicas`` replicas to acknowledge it by default (ms).
DEFAULT_REPLICA_TIMEOUT_MS = 500


def check_replication(client: RedisClient, timeout_ms: int) -> None:
    """Refuse, at construction, a ``min_replicas`` set-up that cannot work."""
    if isinstance(client, RedisCluster):
        raise LeaseConfigError(
            "Leases: min_replicas is not available with RedisCluster (WAIT must follow each "
            "script on the connection that ran it)"
        )
    socket_timeout = connection_kwargs(client).get("socket_timeout")
    if isinstance(socket_timeout, (int, float)) and timeout_ms >= socket_timeout * 1000:
        raise LeaseConfigError(
            f"Leases: replica_timeout must be shorter than the Redis client's socket_timeout "
            f"({socket_timeout} s), got {timeout_ms}: a read that times out before WAIT answers fails the call"
        )


def evalsha_acked(
    client: Any, script: Any, keys: list[str], args: list[Any], *, replicas: int, timeout_ms: int
) -> tuple[Any, int]:
    """Run ``script`` then ``WAIT replicas timeout_ms`` on one connection, in one round trip.

    Returns the script's reply and how many replicas acknowledged every write this connection made
    (``WAIT`` counts a connection's own writes: the script's, here). ``WAIT`` returns as soon as
    ``replicas`` acknowledged, or after ``timeout_ms`` with fewer.
    """
    commands = [("EVALSHA", script.sha, len(keys), *keys, *args), ("WAIT", replicas, timeout_ms)]
    reply, acked = pipelined(client, commands)
    if isinstance(reply, redis.exceptions.NoScriptError):  # Redis lost it (a restart, a failover): load it
        client.script_load(script.script)
        reply, acked = pipelined(client, commands)
    for answer in (reply, acked):
        if isinstance(answer, Exception):
            raise answer
    return reply, int(acked)


def not_replicated(
    what: str, key: str, *, acked: int, wanted: int, timeout_ms: int, released: bool | None
) -> LeaseUnavailableError:
    """The error for a grant fewer than ``wanted`` replicas acknowledged in time, released (or not: ``None``)."""
    outcome = "not released (it ends by its TTL)" if released is None else "released"
    return LeaseUnavailableError(
        f"could not {what} lease {key!r}: granted, but acknowledged by {acked} of the {wanted} replica(s) asked "
        f"(min_replicas) within {timeout_ms} ms, so a failover could lose it; {outcome}",
        key=key,
    )
