"""The one path every script of a store takes to Redis: the thread's connection, a Cluster's node, or the pool.

A :class:`~.store.Leases` and its parts (the grants, the line, the unique records, the history, the
recovery) share one :class:`ScriptRunner`, so a script is sent the same way whoever runs it; with
``min_replicas``, the calls that grant end with ``WAIT`` in the same round trip.
"""

from __future__ import annotations

from typing import Any

import redis
from redis.cluster import RedisCluster

from . import cluster, rounds
from .client import RedisClient, ThreadConnections, evalsha
from .numbers import whole_count, whole_ms
from .replication import MAX_REPLICAS, check_replication, evalsha_acked


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
