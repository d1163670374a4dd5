"""Renewal rounds: many leases renewed in one round trip, as script calls grouped per hash slot and TTL.

A standalone Redis takes every call of a round in one pipeline of bare ``EVALSHA`` commands (with
``min_replicas``, a ``WAIT`` closes it); a Redis Cluster takes them node by node (:mod:`.cluster`).
The script is loaded again only if Redis lost it (a restart).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import redis
from redis.crc import key_slot

from .client import evalsha, pipelined
from .lease import Lease

#: Largest number of leases renewed by one script call; bigger batches are
#: split, and the calls still share one pipelined round trip.
RENEW_BATCH = 1000

#: One script call: its keys (the leases' Redis keys, then their fence counters, then, with a history, their
#: histories) and its arguments (the TTL, then the tokens; with a history, its cap and the leases' fences).
Call = tuple[list[str], list[Any]]


def plan(
    leases: Sequence[Lease], names: Callable[[Lease], tuple[str, str, str]], *, cluster: bool, history: int = 0
) -> tuple[list[list[int]], list[Call]]:
    """Group ``leases`` into script calls: the indexes each call renews, and the calls.

    One call per slot (Cluster) and TTL, so the TTL travels once, not once per lease; ``names`` gives a lease's
    Redis key, fence counter and history (``lua/renew_many.lua`` declares each). ``history``: the keys' history
    cap (0: none kept), so that a lease found lost is recorded with its fence.
    """
    groups: dict[tuple[int, int], list[int]] = defaultdict(list)
    named = [names(lease) for lease in leases]
    for i, lease in enumerate(leases):
        slot = key_slot(named[i][0].encode()) if cluster else 0
        groups[(slot, lease.ttl)].append(i)
    batches = [idx[n : n + RENEW_BATCH] for idx in groups.values() for n in range(0, len(idx), RENEW_BATCH)]
    kinds = 3 if history else 2
    calls = [
        (
            [named[i][kind] for kind in range(kinds) for i in batch],
            [leases[batch[0]].ttl, *(leases[i].token for i in batch)],
        )
        for batch in batches
    ]
    if history:
        for batch, (_, args) in zip(batches, calls):
            args += [history, *(leases[i].fence for i in batch)]
    return batches, calls


def run(client: Any, script: Any, calls: list[Call]) -> list[Any]:
    """The replies of ``calls`` on a standalone Redis, in one round trip."""
    if len(calls) == 1:
        return [evalsha(client, script, *calls[0])]
    # redis-py would check SCRIPT EXISTS before a pipeline (an extra round trip);
    # send bare EVALSHAs and load the script only if Redis lost it.
    for attempt in (1, 2):
        pipe = client.pipeline(transaction=False)
        for keys, args in calls:
            pipe.evalsha(script.sha, len(keys), *keys, *args)
        try:
            return list(pipe.execute())
        except redis.exceptions.NoScriptError:
            if attempt == 2:
                raise
            client.script_load(script.script)
    raise AssertionError("unreachable")


def run_acked(client: Any, script: Any, calls: list[Call], replicas: int, timeout_ms: int) -> tuple[list[Any], int]:
    """``calls`` then ``WAIT replicas timeout_ms``, pipelined on one connection (never a Cluster's): the
    replies, and how many replicas acknowledged them."""
    commands: list[tuple[Any, ...]] = [("EVALSHA", script.sha, len(keys), *keys, *args) for keys, args in calls]
    commands.append(("WAIT", replicas, timeout_ms))
    replies = pipelined(client, commands)
    if any(isinstance(reply, redis.exceptions.NoScriptError) for reply in replies):
        client.script_load(script.script)  # Redis lost it (a restart, a failover)
        replies = pipelined(client, commands)
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
    return replies[:-1], int(replies[-1])
