"""The one path every script of a store takes to Redis: the thread's connection, a Cluster's node, or the pool.

A :class:`~.store.Leases` and its parts (the grants, the line, the unique records, the history, the
recovery) share one :class:`ScriptRunner`, so a script is sent the same way whoever runs it; with
``min_replicas``, the calls that grant end with ``WAIT`` in the same round trip.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import redis
from redis.cluster import RedisCluster

from . import cluster, rounds
from .client import RedisClient, ThreadConnections, evalsha
from .numbers import whole_count, whole_ms
from .replication import MAX_REPLICAS, check_replication, evalsha_acked
from .scripts import MAX_LIMIT, NEED_SLOTS

#: A script call's ``KEYS`` and ``ARGV`` with a key's holder slots declared as many as asked (see
#: :meth:`ScriptRunner.call_slots`).
Encode = Callable[[int], tuple[list[str], list[Any]]]


def needed_slots(reply: Any) -> int | None:
    """How many holder slots a script asked to be declared (its answer ``{NEED_SLOTS, width}``), or ``None``."""
    if isinstance(reply, list) and len(reply) == 2 and reply[0] == NEED_SLOTS:
        return int(reply[1])
    return None


class ScriptRunner:
    """How a store's scripts are sent: for the package's parts and integrations, not a user API.

    Parameters:
      client: the store's client.
      thread_connections: each thread runs its calls on a connection of its own (see :class:`~.store.Leases`);
        never with RedisCluster.
      min_replicas, replica_timeout: ``WAIT`` after the calls that grant (checked as the store's options).
    """

    def __init__(
        self, client: RedisClient, *, thread_connections: bool, min_replicas: int, replica_timeout: int
    ) -> None:
        self.client = client
        #: Whether the client is a Redis Cluster's (calls go node by node).
        self.cluster = isinstance(client, RedisCluster)
        self.min_replicas = whole_count(min_replicas, "min_replicas", maximum=MAX_REPLICAS, owner="Leases")
        self.replica_timeout = whole_ms(replica_timeout, "replica_timeout", owner="Leases")
        if self.min_replicas:
            check_replication(client, self.replica_timeout)
        # The holder slots a key was last found to have, when more than one (see call_slots); bounded.
        self._widths: dict[str, int] = {}
        #: The calling thread's own connections (``thread_connections``), or ``None``.
        self.threads = (
            ThreadConnections(client)
            if thread_connections and isinstance(client, redis.Redis) and not self.cluster
            else None
        )

    def register(self, source: str) -> Any:
        """The client's script object for the Lua ``source`` (sent by its SHA, loaded when Redis lacks it)."""
        return self.client.register_script(source)

    def call(self, script: Any, keys: list[str], args: list[Any]) -> Any:
        """Run ``script`` with ``keys`` and ``args``; its reply."""
        if self.cluster:
            return cluster.call(self.client, script, keys, args)
        if self.threads is None:
            return evalsha(self.client, script, keys, args)
        return self.threads.call(script, keys, args)

    def call_acked(self, script: Any, keys: list[str], args: list[Any]) -> tuple[Any, int]:
        """:meth:`call`, then, with ``min_replicas``, ``WAIT`` on the same connection in the same round trip:
        the reply, and how many replicas acknowledged it (``0`` without ``min_replicas``: none asked)."""
        if not self.min_replicas:
            return self.call(script, keys, args), 0
        replicas, timeout_ms = self.min_replicas, self.replica_timeout
        if self.threads is None:
            return evalsha_acked(self.client, script, keys, args, replicas=replicas, timeout_ms=timeout_ms)
        return self.threads.run(
            lambda client: evalsha_acked(client, script, keys, args, replicas=replicas, timeout_ms=timeout_ms)
        )

    def call_slots(self, key: str, script: Any, encode: Encode, *, acked: bool = False) -> tuple[Any, int]:
        """:meth:`call` (:meth:`call_acked` if ``acked``) of a script that reads ``key``'s holder slots, with the
        ``KEYS`` and ``ARGV`` that ``encode(width)`` gives: declaring as many slots as the key last had here,
        and again with as many as the script asks for if it finds the key wider (``NEED_SLOTS``: nothing was
        written). The reply, and the replicas' count as :meth:`call_acked`'s."""
        width = self._widths.get(key, 1)
        for _ in range(3):  # a key only widens by grants of a larger limit: once, but for a race
            keys, args = encode(width)
            reply, replicas = self.call_acked(script, keys, args) if acked else (self.call(script, keys, args), 0)
            need = needed_slots(reply)
            if need is None:
                return reply, replicas
            if not width < need <= MAX_LIMIT:
                raise redis.exceptions.ResponseError(f"dramatiq-leases: {key!r} asked for {need} holder slots")
            width = need
            if len(self._widths) >= 1024:
                self._widths.clear()  # per-invoice keys must not grow it without bound
            self._widths[key] = width
        raise redis.exceptions.ResponseError(f"dramatiq-leases: {key!r} kept widening beyond {width} holder slots")

    def run_round(self, script: Any, calls: list[rounds.Call]) -> tuple[list[Any], int]:
        """Many calls of ``script`` in one round trip (on a Cluster, every master's at once; a reply is ``None``
        where its slot failed), with ``WAIT`` closing it under ``min_replicas``: the replies, and how many
        replicas acknowledged them (0 without ``min_replicas``)."""
        if self.min_replicas:  # never a Cluster: see check_replication
            return rounds.run_acked(self.client, script, calls, self.min_replicas, self.replica_timeout)
        if self.cluster:
            return cluster.run(self.client, script, calls), 0
        return rounds.run(self.client, script, calls), 0

    def node_of(self, name: str) -> Any:
        """The client for the Redis key ``name``: the master of its slot, on a Cluster (without retries)."""
        if isinstance(self.client, RedisCluster):
            return self.client.get_node_from_key(name).redis_connection  # type: ignore[no-untyped-call]
        return self.client
