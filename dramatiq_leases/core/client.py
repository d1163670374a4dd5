"""Redis clients for leases: timeouts, error translation, and per-thread connections."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import redis
from redis.cluster import RedisCluster

from .errors import LeaseUnavailableError
from .tracing import DB_NAMESPACE, SERVER_ADDRESS, SERVER_PORT

T = TypeVar("T")

#: A client this package can work with.
RedisClient = redis.Redis | RedisCluster

#: Seconds a client made from a URL waits for Redis before giving up.
DEFAULT_SOCKET_TIMEOUT = 2.0


#: The longest a blocking wait lasts before the caller asks again (seconds).
MAX_BLOCK_S = 10


@contextmanager
def unavailable(what: str, key: str | None = None) -> Iterator[None]:
    """Turn a Redis error into :class:`LeaseUnavailableError`, saying what could not be done (``what``)."""
    try:
        yield
    except redis.RedisError as e:
        raise LeaseUnavailableError(f"could not {what}: {type(e).__name__}: {e}", key=key) from e


def client_from_url(url: str, *, socket_timeout: float = DEFAULT_SOCKET_TIMEOUT) -> redis.Redis:
    """A client for ``url`` whose calls and connects time out (a hung renewal cannot confirm a lease)."""
    return redis.Redis.from_url(url, socket_timeout=socket_timeout, socket_connect_timeout=socket_timeout)


def server_attributes(client: Any) -> dict[str, str | int]:
    """The server a client was configured with, as span attributes (``server.address``, ``server.port``,
    ``db.namespace``); empty when its pool does not say (a Redis Cluster, or Sentinel, which finds its
    server at connection time). Never the password or the rest of the URL."""
    kwargs = getattr(getattr(client, "connection_pool", None), "connection_kwargs", None)
    if not isinstance(kwargs, dict):
        return {}
    out: dict[str, str | int] = {}
    if isinstance(kwargs.get("path"), str):  # a Unix socket: its path is the address, and there is no port
        out[SERVER_ADDRESS] = kwargs["path"]
    elif isinstance(kwargs.get("host"), str):
        out[SERVER_ADDRESS] = kwargs["host"]
        if isinstance(kwargs.get("port"), int):
            out[SERVER_PORT] = kwargs["port"]
    else:
        return {}
    if isinstance(kwargs.get("db"), int):
        out[DB_NAMESPACE] = str(kwargs["db"])
    return out


def evalsha(client: Any, script: Any, keys: list[str], args: list[Any]) -> Any:
    """Run a registered ``script`` by its SHA, loading it only if Redis lost it (a restart).

    redis-py's ``Script.__call__`` does the same through a few more layers; this is the hot path.
    """
    try:
        return client.evalsha(script.sha, len(keys), *keys, *args)
    except redis.exceptions.NoScriptError:
        client.script_load(script.script)
        return client.evalsha(script.sha, len(keys), *keys, *args)


class ThreadConnections:
    """Runs scripts on a connection of the calling thread's own, reopened after any call that did not complete.

    For threads that asynchronous exceptions can interrupt (Dramatiq's worker
    threads): an interruption between sending a command and reading its reply
    would otherwise return a pooled connection with a reply still unread,
    which the next caller would take for its own, or leak the connection.

    Parameters:
      client: a ``redis.Redis`` client whose pool the connections come from.
    """

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self._local = threading.local()

    def call(self, script: Any, keys: list[str], args: list[Any]) -> Any:
        """Run the registered ``script`` with ``keys`` and ``args`` on this thread's connection."""
        return self.run(lambda client: evalsha(client, script, keys, args))

    def run(self, fn: Callable[[redis.Redis], T]) -> T:
        """Call ``fn`` with this thread's client; a call that did not complete makes the next reconnect."""
        local = self._local
        client = getattr(local, "client", None)
        if client is None:
            client = local.client = redis.Redis(connection_pool=self.client.connection_pool,
                                                single_connection_client=True)
        elif local.dirty:
            client.connection.disconnect()  # the last call did not complete: never read its reply as ours
        # Two single stores around the call: an interruption anywhere in between leaves dirty set.
        local.dirty = True
        reply = fn(client)
        local.dirty = False
        return reply

    def blpop(self, name: str, timeout_ms: int) -> bool:
        """``BLPOP name`` for up to ``timeout_ms`` on this thread's blocking connection; ``True`` if popped.

        That connection's reads wait a little longer than the block, so a
        long block is not cut short by the client's ``socket_timeout``.
        """
        local = self._local
        client = getattr(local, "blocking", None)
        if client is None:
            pool = self.client.connection_pool
            kwargs = {**pool.connection_kwargs, "socket_timeout": MAX_BLOCK_S + 2}
            client = local.blocking = redis.Redis(
                connection_pool=redis.ConnectionPool(connection_class=pool.connection_class, **kwargs),
                single_connection_client=True,
            )
        elif local.blocking_dirty:
            client.connection.disconnect()
        local.blocking_dirty = True
        reply = client.blpop([name], timeout=min(timeout_ms, MAX_BLOCK_S * 1000) / 1000)
        local.blocking_dirty = False
        return reply is not None
