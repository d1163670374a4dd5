"""A primary, its replica and three Sentinels for tests: replication that can be cut, and a real failover.

:class:`Replicated` starts a primary and one replica (``redis-server`` each, on free ports, data in a private
directory) and, if asked, three Sentinels (quorum 2) watching them under the name :data:`SERVICE`. The
Sentinels are told of each other and of the replica in their configuration (``known-sentinel``,
``known-replica``), so they agree from the start instead of discovering each other over a few seconds.

Replication is cut deterministically, with Redis' own access control: the replica logs in to the primary as
a user of its own (``masteruser``/``masterauth``). :meth:`Replicated.cut` disables that user and closes the
replica's link: the replica cannot log in again, so nothing written on the primary afterwards reaches it; it is
not held in a socket buffer either (a replica stopped with ``SIGSTOP``, or a link whose packets are dropped,
would still receive what the kernel buffered, or what an orphaned socket of a killed primary retransmits).
:meth:`Replicated.heal` enables the user: the replica logs in again within a second and catches up from the
primary's backlog. :meth:`Replicated.kill_primary` is a ``SIGKILL``: whatever the replica had not received
is lost, and :meth:`Replicated.wait_promoted` waits for the Sentinels to promote the replica.

:meth:`Replicated.close` stops every process it started (by its own handle) and deletes their data.
"""

from __future__ import annotations

import contextlib
import secrets
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import redis
from redis.sentinel import Sentinel

from dramatiq_leases.embedded import EmbeddedRedis, free_port, redis_server_binary

#: The name the Sentinels know the primary by.
SERVICE = "leases"
#: How long a Sentinel waits for the primary to answer before it counts it down.
DOWN_AFTER_MS = 1000
#: Sentinel's failover timeout: kept small, so a failover that stalls is tried again soon.
FAILOVER_TIMEOUT_MS = 3000

_USER, _PASSWORD = "replicator", "replication-secret"

#: The key :meth:`Replicated.wait_in_sync` writes to see the replica acknowledge.
PROBE_KEY = "tests:replication-probe"


def _wait(predicate: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    problem: object = "not asked yet"
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except redis.RedisError as e:
            value, problem = None, f"{type(e).__name__}: {e}"
        if value:
            return value
        time.sleep(0.02)
    raise RuntimeError(f"{what} did not happen within {timeout}s (last error: {problem})")


def _info(client: redis.Redis, section: str) -> dict[str, Any]:
    return dict(client.info(section))


class SentinelProcess:
    """One ``redis-server --sentinel`` on a free port, its configuration file in a private directory."""

    def __init__(self) -> None:
        self.port = free_port()
        self.myid = secrets.token_hex(20)
        self.dir = Path(tempfile.mkdtemp(prefix="dramatiq-leases-sentinel-"))
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, primary_port: int, replica_port: int, others: list[SentinelProcess], quorum: int) -> None:
        """Write the configuration and start; raises ``RuntimeError`` if it does not answer PING in time."""
        lines = [
            f"port {self.port}",
            "bind 127.0.0.1",
            f'dir "{self.dir}"',
            "daemonize no",
            "loglevel warning",
            f"sentinel myid {self.myid}",
            f"sentinel monitor {SERVICE} 127.0.0.1 {primary_port} {quorum}",
            f"sentinel down-after-milliseconds {SERVICE} {DOWN_AFTER_MS}",
            f"sentinel failover-timeout {SERVICE} {FAILOVER_TIMEOUT_MS}",
            f"sentinel parallel-syncs {SERVICE} 1",
            f"sentinel known-replica {SERVICE} 127.0.0.1 {replica_port}",
            *(f"sentinel known-sentinel {SERVICE} 127.0.0.1 {o.port} {o.myid}" for o in others),
        ]
        config = self.dir / "sentinel.conf"
        config.write_text("\n".join(lines) + "\n")
        self.process = subprocess.Popen(
            [redis_server_binary(), str(config), "--sentinel"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        client = self.client()
        try:
            _wait(
                lambda: self.process is not None and self.process.poll() is None and client.ping(),
                10,
                f"sentinel on port {self.port} answering",
            )
        finally:
            client.close()

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=1, decode_responses=True)

    def master_address(self) -> tuple[str, int] | None:
        """The primary's address as this Sentinel sees it now."""
        client = self.client()
        try:
            address = client.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE)  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated
        finally:
            client.close()
        return (str(address[0]), int(address[1])) if address else None

    def close(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None
        shutil.rmtree(self.dir, ignore_errors=True)


class Replicated:
    """A primary and one replica replicating from it, and ``sentinels`` Sentinels watching them (0: none)."""

    def __init__(self, *, sentinels: int = 3, quorum: int = 2) -> None:
        self.sentinel_count = sentinels
        self.quorum = quorum
        self.primary: EmbeddedRedis | None = None
        self.replica: EmbeddedRedis | None = None
        self.sentinels: list[SentinelProcess] = []
        self._clients: list[Any] = []

    # Life ----------------------------------------------------------------------------------------------

    def start(self, timeout: float = 30.0) -> Replicated:
        """Start the primary, the replica (and wait until it is in sync), then the Sentinels."""
        try:
            # No diskless-sync delay: the replica's first full sync starts at once, not after 5 s.
            self.primary = EmbeddedRedis(
                extra_args=(
                    "--repl-diskless-sync-delay",
                    "0",
                    "--user",
                    _USER,
                    "on",
                    f">{_PASSWORD}",
                    "+psync",
                    "+replconf",
                    "+ping",
                )
            ).start()
            self.replica = EmbeddedRedis(
                extra_args=(
                    "--replicaof",
                    "127.0.0.1",
                    str(self.primary.port),
                    "--masteruser",
                    _USER,
                    "--masterauth",
                    _PASSWORD,
                )
            ).start()
            self.wait_in_sync(timeout)
            self.sentinels = [SentinelProcess() for _ in range(self.sentinel_count)]
            for sentinel in self.sentinels:
                sentinel.start(
                    self.primary.port, self.replica.port, [o for o in self.sentinels if o is not sentinel], self.quorum
                )
            for sentinel in self.sentinels:
                _wait(
                    lambda s=sentinel: s.master_address() == ("127.0.0.1", self.primary_port),
                    timeout,
                    f"sentinel {sentinel.port} watching the primary",
                )
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Stop everything started (safe to call twice, or after a failed start)."""
        for client in self._clients:
            with contextlib.suppress(Exception):
                client.close()
        self._clients = []
        for sentinel in self.sentinels:
            with contextlib.suppress(Exception):
                sentinel.close()
        self.sentinels = []
        for node in (self.replica, self.primary):
            if node is not None:
                with contextlib.suppress(Exception):
                    node.close()
        self.primary = self.replica = None

    def __enter__(self) -> Replicated:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # Clients -------------------------------------------------------------------------------------------

    @property
    def primary_port(self) -> int:
        assert self.primary is not None
        return self.primary.port

    @property
    def replica_port(self) -> int:
        assert self.replica is not None
        return self.replica.port

    def node(self, port: int, **kwargs: Any) -> redis.Redis:
        """A plain client of one server (closed with the set-up)."""
        client = redis.Redis(port=port, **{"socket_timeout": 2, "socket_connect_timeout": 2, **kwargs})
        self._clients.append(client)
        return client

    def sentinel(self, **kwargs: Any) -> Sentinel:
        """A ``redis.sentinel.Sentinel`` knowing every Sentinel of the set-up."""
        return Sentinel([("127.0.0.1", s.port) for s in self.sentinels], **kwargs)

    def master_client(self, socket_timeout: float = 2.0) -> redis.Redis:
        """``Sentinel(...).master_for(SERVICE, socket_timeout=...)``: what users pass as ``client=``."""
        client: redis.Redis = self.sentinel(socket_timeout=socket_timeout).master_for(
            SERVICE, socket_timeout=socket_timeout, socket_connect_timeout=socket_timeout
        )
        self._clients.append(client)
        return client

    def url(self, db: int = 0) -> str:
        """The ``redis+sentinel://`` URL of database ``db`` of the watched primary."""
        return f"redis+sentinel://{','.join(f'127.0.0.1:{s.port}' for s in self.sentinels)}/{SERVICE}/{db}"

    # Replication ---------------------------------------------------------------------------------------

    def wait_in_sync(self, timeout: float = 10.0) -> None:
        """Wait until the replica acknowledges a write made now: it has everything the primary wrote.

        A write and ``WAIT``, not ``INFO``: after a full sync, ``INFO`` calls the replica online (offsets
        equal) up to a second before the primary streams to it, which starts at the replica's first ack.
        """
        primary = self.node(self.primary_port)

        def synced() -> bool:
            primary.incr(PROBE_KEY)
            return int(primary.execute_command("WAIT", 1, 100)) >= 1  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated

        _wait(synced, timeout, "the replica catching up with the primary")

    def cut(self, timeout: float = 10.0) -> None:
        """Cut replication: nothing the primary writes from now on reaches the replica, until :meth:`heal`."""
        primary, replica = self.node(self.primary_port), self.node(self.replica_port)
        primary.execute_command("ACL", "SETUSER", _USER, "off")  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated
        primary.execute_command("CLIENT", "KILL", "TYPE", "replica")  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated
        _wait(
            lambda: (
                _info(primary, "replication").get("connected_slaves") == 0
                and _info(replica, "replication").get("master_link_status") == "down"
            ),
            timeout,
            "replication cut",
        )

    def heal(self, timeout: float = 10.0) -> None:
        """Let the replica log in again, and wait until it has caught up."""
        self.node(self.primary_port).execute_command("ACL", "SETUSER", _USER, "on")  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated
        self.wait_in_sync(timeout)

    # Failover ------------------------------------------------------------------------------------------

    def kill_primary(self) -> None:
        """``SIGKILL`` the primary: what the replica has not received is lost."""
        assert self.primary is not None and self.primary.process is not None
        self.primary.process.kill()
        self.primary.process.wait()
        self.primary.process = None

    def wait_promoted(self, timeout: float = 30.0) -> float:
        """Wait until every Sentinel names the replica as the primary and it says so itself; seconds waited."""
        started = time.monotonic()
        replica = self.node(self.replica_port)
        expected = ("127.0.0.1", self.replica_port)
        _wait(
            lambda: (
                all(s.master_address() == expected for s in self.sentinels)
                and replica.execute_command("ROLE")[0] in (b"master", "master")  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated
            ),
            timeout,
            "the replica's promotion",
        )
        return time.monotonic() - started


__all__ = ["DOWN_AFTER_MS", "PROBE_KEY", "SERVICE", "Replicated", "SentinelProcess"]
