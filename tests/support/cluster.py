"""A real Redis Cluster for tests: 3 masters with 1 replica each, on free ports, and a slot migration done by hand.

``RedisClusterNodes`` starts six ``redis-server`` processes (cluster mode,
each with a private directory), joins them with ``redis-cli --cluster create
--cluster-replicas 1`` and waits until every node says ``cluster_state:ok`` and
agrees on who serves which slot. :meth:`RedisClusterNodes.close` stops them
all, whatever happened before.

:class:`SlotMove` moves one hash slot from its master to another the way
``redis-cli --cluster reshard`` does (``CLUSTER SETSLOT IMPORTING/MIGRATING``,
``MIGRATE``, ``CLUSTER SETSLOT NODE``), one step per call, so a test can hold
the slot half-moved while leases in it are renewed.
"""

from __future__ import annotations

import contextlib
import functools
import re
import socket
import subprocess
import time
from collections.abc import Iterable
from typing import Any

import redis
from redis.cluster import RedisCluster
from redis.crc import key_slot

from dramatiq_leases.embedded import EmbeddedRedis, free_port

#: Milliseconds without an answer before a node is considered failing (Redis' default is 15 000).
NODE_TIMEOUT_MS = 5_000


def _node_args(bus_port: int | None) -> tuple[str, ...]:
    # The bus port is chosen where the server lets us (Redis 7+): the default, port + 10 000, may be taken.
    chosen_bus = ("--cluster-port", str(bus_port)) if bus_port is not None else ()
    return (
        "--cluster-enabled",
        "yes",
        "--cluster-config-file",
        "nodes.conf",
        *chosen_bus,
        "--cluster-node-timeout",
        str(NODE_TIMEOUT_MS),
    )


@functools.cache
def _bus_port_settable() -> bool:
    """Whether the ``redis-server`` on ``PATH`` takes ``--cluster-port`` (Redis 7+, Valkey; not Redis 6.2)."""
    line = subprocess.run(["redis-server", "--version"], capture_output=True, text=True, timeout=10, check=True).stdout
    found = re.search(r"v=(\d+)\.", line)
    return found is not None and int(found[1]) >= 7


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _start_node() -> EmbeddedRedis:
    """One cluster-enabled ``redis-server`` on a free port and a free bus port (another pair if taken meanwhile)."""
    for _ in range(20):
        port = free_port()
        if _bus_port_settable():
            bus: int | None = free_port()
            if port == bus:
                continue
        elif port + 10_000 > 65_535 or not _port_free(port + 10_000):
            continue  # Redis 6.2 listens for its bus on port + 10 000, which must be a port and free
        else:
            bus = None
        node = EmbeddedRedis(port, extra_args=_node_args(bus))
        try:
            return node.start()
        except RuntimeError:
            node.close()
    raise RuntimeError("could not start a cluster node on free ports")


class RedisClusterNodes:
    """Six ``redis-server`` processes forming one cluster: ``masters`` masters, each with ``replicas`` replicas."""

    def __init__(self, masters: int = 3, replicas: int = 1) -> None:
        self.masters_wanted = masters
        self.replicas = replicas
        self.nodes: list[EmbeddedRedis] = []

    # Life -------------------------------------------------------------------------------------------

    def start(self, timeout: float = 60.0) -> RedisClusterNodes:
        """Start the nodes, create the cluster, and wait until every node agrees it is ok."""
        try:
            for _ in range(self.masters_wanted * (1 + self.replicas)):
                self.nodes.append(_start_node())
            done = subprocess.run(
                [
                    "redis-cli",
                    "--cluster",
                    "create",
                    *(f"127.0.0.1:{n.port}" for n in self.nodes),
                    "--cluster-replicas",
                    str(self.replicas),
                    "--cluster-yes",
                ],
                capture_output=True,
                text=True,
                timeout=timeout,
            )
            if done.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed:\n{done.stdout}\n{done.stderr}")
            self.wait_consistent(timeout)
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Stop every node and delete its data (safe to call twice, or after a failed start)."""
        for node in self.nodes:
            with contextlib.suppress(Exception):  # the others must still stop
                node.close()
        self.nodes = []

    def __enter__(self) -> RedisClusterNodes:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # Reading the cluster's state --------------------------------------------------------------------

    def node(self, port: int) -> redis.Redis:
        """A plain client of one node (not cluster-aware: it sees MOVED and ASK as errors)."""
        return redis.Redis(port=port, socket_timeout=5, decode_responses=True)

    def _ask_each(self, command: str, *args: Any) -> dict[int, Any]:
        out = {}
        for n in self.nodes:
            client = self.node(n.port)
            try:
                out[n.port] = client.execute_command(command, *args)  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated
            finally:
                client.close()
        return out

    def slot_owners(self, port: int) -> dict[int, int]:
        """Slot -> port of its master, as the node on ``port`` sees it."""
        client = self.node(port)
        try:
            ranges = client.execute_command("CLUSTER", "SLOTS")  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated
        finally:
            client.close()
        owners: dict[int, int] = {}
        for entry in ranges:
            start, end, master = int(entry[0]), int(entry[1]), entry[2]
            for slot in range(start, end + 1):
                owners[slot] = int(master[1])
        return owners

    def masters(self) -> list[int]:
        """The ports of the masters, sorted."""
        return sorted(set(self.slot_owners(self.nodes[0].port).values()))

    def master_of(self, redis_key: str) -> int:
        """The port of the master serving ``redis_key``'s slot now."""
        return self.slot_owners(self.nodes[0].port)[key_slot(redis_key.encode())]

    def wait_consistent(self, timeout: float = 30.0) -> None:
        """Wait until every node says ``cluster_state:ok``, knows every node, and all agree on each slot's master."""
        deadline = time.monotonic() + timeout
        problem = "not asked yet"
        while time.monotonic() < deadline:
            try:
                problem = self._inconsistency()
            except redis.RedisError as e:
                problem = f"{type(e).__name__}: {e}"
            if not problem:
                return
            time.sleep(0.05)
        raise RuntimeError(f"the cluster did not settle within {timeout}s: {problem}")

    def _inconsistency(self) -> str:
        infos = self._ask_each("CLUSTER", "INFO")
        for port, raw in infos.items():
            info = dict(line.split(":", 1) for line in raw.split() if ":" in line)
            if info.get("cluster_state") != "ok":
                return f"node {port}: cluster_state {info.get('cluster_state')}"
            if int(info.get("cluster_known_nodes", 0)) != len(self.nodes):
                return f"node {port} knows {info.get('cluster_known_nodes')} nodes"
            if int(info.get("cluster_slots_assigned", 0)) != 16384:
                return f"node {port}: {info.get('cluster_slots_assigned')} slots assigned"
        views = {port: self.slot_owners(port) for port in infos}
        first = next(iter(views.values()))
        if len(set(first.values())) != self.masters_wanted:
            return f"{len(set(first.values()))} masters serve slots"
        for port, view in views.items():
            if view != first:
                return f"node {port} sees another slot map"
        roles = self._ask_each("ROLE")
        replicas = [r for r in roles.values() if r[0] == "slave"]
        if len(replicas) != self.masters_wanted * self.replicas:
            return f"{len(replicas)} replicas"
        if any(r[3] != "connected" for r in replicas):
            return "a replica is not connected to its master yet"
        return ""

    # Clients ----------------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """The cluster URL this package reads (``redis+cluster://``), through the first node."""
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def client(self, **kwargs: Any) -> RedisCluster:
        """A cluster-aware client (MOVED and ASK followed)."""
        kwargs.setdefault("socket_timeout", 2)
        kwargs.setdefault("socket_connect_timeout", 2)
        return RedisCluster(host="127.0.0.1", port=self.nodes[0].port, **kwargs)

    def commandstats(self) -> dict[int, dict[str, int]]:
        """Calls per command on each master (``INFO commandstats``), by port."""
        out = {}
        for port in self.masters():
            client = self.node(port)
            try:
                stats = client.info("commandstats")
            finally:
                client.close()
            out[port] = {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}
        return out

    def node_id(self, port: int) -> str:
        client = self.node(port)
        try:
            return str(client.execute_command("CLUSTER", "MYID"))  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated
        finally:
            client.close()

    def reshard(self, source: int, target: int, slots: int = 1, timeout: float = 30.0) -> None:
        """Move the ``slots`` lowest slots of ``source`` to ``target`` with ``redis-cli --cluster reshard``."""
        done = subprocess.run(
            [
                "redis-cli",
                "--cluster",
                "reshard",
                f"127.0.0.1:{source}",
                "--cluster-from",
                self.node_id(source),
                "--cluster-to",
                self.node_id(target),
                "--cluster-slots",
                str(slots),
                "--cluster-yes",
            ],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if done.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster reshard failed:\n{done.stdout}\n{done.stderr}")
        self.wait_consistent(timeout)

    # Choosing keys ----------------------------------------------------------------------------------

    @staticmethod
    def in_slot(name_of: Any, slot: int, count: int, candidates: Iterable[str]) -> list[str]:
        """The first ``count`` of ``candidates`` whose ``name_of(key)`` hashes to ``slot``."""
        found = []
        for key in candidates:
            if key_slot(name_of(key).encode()) == slot:
                found.append(key)
                if len(found) == count:
                    return found
        raise AssertionError(f"not enough candidates in slot {slot}")

    def spread(self, name_of: Any, per_master: int, candidates: Iterable[str]) -> dict[int, list[str]]:
        """``per_master`` of ``candidates`` on each master (port -> keys), placed by ``name_of(key)``'s slot."""
        owners = self.slot_owners(self.nodes[0].port)
        out: dict[int, list[str]] = {port: [] for port in set(owners.values())}
        for key in candidates:
            keys = out[owners[key_slot(name_of(key).encode())]]
            if len(keys) < per_master:
                keys.append(key)
            if all(len(v) == per_master for v in out.values()):
                return out
        raise AssertionError(f"not enough candidates for {per_master} keys on each master: {out}")


class SlotMove:
    """Moves ``slot`` from its master to ``target`` step by step, as ``redis-cli --cluster reshard`` does.

    :meth:`begin` marks the slot importing on the target and migrating on the
    source; :meth:`migrate` moves some of its keys (``MIGRATE ... KEYS``);
    :meth:`finish` moves the rest and assigns the slot to the target on every
    master. Between the steps the slot is half-moved: commands on keys still
    at the source run there, the others get ``ASK`` (or ``TRYAGAIN`` when a
    multi-key command finds some keys here and some there).
    """

    def __init__(self, cluster: RedisClusterNodes, slot: int, target: int) -> None:
        self.cluster = cluster
        self.slot = slot
        self.source = cluster.slot_owners(cluster.nodes[0].port)[slot]
        self.target = target
        assert self.source != target, "the slot is already there"
        self.moved: list[str] = []

    def begin(self) -> None:
        target, source = self.cluster.node(self.target), self.cluster.node(self.source)
        try:
            target.execute_command("CLUSTER", "SETSLOT", self.slot, "IMPORTING", self.cluster.node_id(self.source))  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated
            source.execute_command("CLUSTER", "SETSLOT", self.slot, "MIGRATING", self.cluster.node_id(self.target))  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated
        finally:
            target.close()
            source.close()

    def keys(self) -> list[str]:
        """The keys of the slot still at the source."""
        source = self.cluster.node(self.source)
        try:
            return list(source.execute_command("CLUSTER", "GETKEYSINSLOT", self.slot, 1000))  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated
        finally:
            source.close()

    def migrate(self, keys: list[str]) -> None:
        """Move ``keys`` (of the slot, at the source) to the target in one ``MIGRATE``."""
        if not keys:
            return
        source = self.cluster.node(self.source)
        try:
            source.execute_command("MIGRATE", "127.0.0.1", self.target, "", 0, 5000, "KEYS", *keys)  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated
        finally:
            source.close()
        self.moved += keys

    def finish(self) -> None:
        """Move whatever is left, then give the slot to the target on every master (target first, as redis-cli)."""
        self.migrate(self.keys())
        target_id = self.cluster.node_id(self.target)
        for port in [
            self.target,
            self.source,
            *(p for p in self.cluster.masters() if p not in (self.target, self.source)),
        ]:
            client = self.cluster.node(port)
            try:
                client.execute_command("CLUSTER", "SETSLOT", self.slot, "NODE", target_id)  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated
            finally:
                client.close()
        self.cluster.wait_consistent()
