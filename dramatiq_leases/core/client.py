"""Redis clients for leases: timeouts, error translation, and per-thread connections."""

from __future__ import annotations

import contextlib
import encodings.idna  # noqa: F401  # see below
import importlib.metadata
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar
from urllib.parse import parse_qsl, unquote, urlencode

import redis
from redis.cluster import RedisCluster
from redis.connection import parse_url
from redis.exceptions import RedisClusterException
from redis.sentinel import Sentinel

from .errors import LeaseUnavailableError, LeaseURLError
from .scripts import MAX_BLOCK_MS
from .tracing import DB_NAMESPACE, SERVER_ADDRESS, SERVER_PORT

# Done at import, not by a worker thread's first connection, where an exception raised into the thread mid-import
# would strand the import lock (see keys._SLOT_TAGS): a host name's first lookup imports the idna codec (above),
# and redis-py reads its version with importlib.metadata for each new connection, whose first read imports more.
with contextlib.suppress(importlib.metadata.PackageNotFoundError):  # as redis-py does
    importlib.metadata.version("redis")

T = TypeVar("T")

#: A client this package can work with.
RedisClient = redis.Redis | RedisCluster

#: Seconds a client made from a URL waits for Redis before giving up.
DEFAULT_SOCKET_TIMEOUT = 2.0


#: The longest a blocking wait lasts before the caller asks again (seconds; the scripts' ``MAX_BLOCK_MS``).
MAX_BLOCK_S = MAX_BLOCK_MS / 1000


@contextmanager
def unavailable(what: str, key: str | None = None) -> Iterator[None]:
    """Turn a Redis error into :class:`LeaseUnavailableError`, saying what could not be done (``what``)."""
    try:
        yield
    except (redis.RedisError, RedisClusterException) as e:  # the latter: a Cluster's "slot not covered", ...
        raise LeaseUnavailableError(f"could not {what}: {type(e).__name__}: {e}", key=key) from e


#: URL schemes of a Redis Cluster, and the scheme of the seed node each names.
CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}


def is_cluster_url(url: str) -> bool:
    """Whether ``url`` names a Redis Cluster (``redis+cluster://`` or ``rediss+cluster://``)."""
    scheme, sep, _ = url.partition("://")
    return bool(sep) and scheme.lower() in CLUSTER_SCHEMES


def client_from_url(url: str, *, socket_timeout: float = DEFAULT_SOCKET_TIMEOUT) -> RedisClient:
    """A client for ``url`` whose calls and connects time out (a hung renewal cannot confirm a lease).

    ``redis://``, ``rediss://`` and ``unix://`` give a ``redis.Redis``;
    ``redis+cluster://[[user]:[password]@]host:port`` (``rediss+cluster://``
    with TLS) a ``RedisCluster``: ``host:port`` is one node of the cluster (a
    seed), the others are discovered from it; query options are redis-py's,
    as for ``redis://``; the database can only be 0. Unlike a ``redis.Redis``,
    a cluster client asks the seed for the cluster's layout at once.
    ``redis+sentinel://`` (``rediss+sentinel://``) gives a client of the
    primary that Sentinels name: see :func:`sentinel_client_from_url`.

    Raises:
      LeaseUnavailableError: the cluster's seed node could not be asked.
      LeaseURLError: a URL redis-py cannot parse, or a cluster URL naming a database other than 0.
    """
    try:
        return _client_from_url(url, socket_timeout)
    except LeaseUnavailableError:
        raise
    except ValueError as e:  # redis-py's own, and ours below
        raise LeaseURLError(str(e)) from None


def _client_from_url(url: str, socket_timeout: float) -> RedisClient:
    scheme, _, rest = url.partition("://")
    if is_sentinel_url(url):
        return sentinel_client_from_url(url, socket_timeout=socket_timeout)
    if is_cluster_url(url):
        seed = f"{CLUSTER_SCHEMES[scheme.lower()]}://{rest}"
        if parse_url(seed).get("db", 0) != 0:  # type: ignore[no-untyped-call]  # ValueError if unparsable
            raise ValueError("a Redis Cluster has only database 0")
        try:
            return RedisCluster.from_url(seed, socket_timeout=socket_timeout, socket_connect_timeout=socket_timeout)
        except (redis.RedisError, RedisClusterException) as e:
            raise LeaseUnavailableError(f"could not ask the cluster for its nodes: {type(e).__name__}: {e}") from e
    return redis.Redis.from_url(url, socket_timeout=socket_timeout, socket_connect_timeout=socket_timeout)


#: URL schemes of a primary found through Redis Sentinel, and the scheme of its data nodes.
SENTINEL_SCHEMES = {"redis+sentinel": "redis", "rediss+sentinel": "rediss"}

#: The port of a Sentinel named without one.
DEFAULT_SENTINEL_PORT = 26379

#: Query options of a Sentinel URL that apply to the Sentinels themselves, not to the data nodes.
_SENTINEL_OPTIONS = {"sentinel_username": "username", "sentinel_password": "password"}


def is_sentinel_url(url: str) -> bool:
    """Whether ``url`` names a primary through Sentinel (``redis+sentinel://`` or ``rediss+sentinel://``)."""
    scheme, sep, _ = url.partition("://")
    return bool(sep) and scheme.lower() in SENTINEL_SCHEMES


def _sentinel_address(member: str) -> tuple[str, int]:
    host, port = member, ""
    if member.startswith("["):  # an IPv6 address: [::1]:26379
        host, _, after = member[1:].partition("]")
        if after and not after.startswith(":"):
            raise ValueError(f"invalid Sentinel address {member!r}")
        port = after[1:]
    elif ":" in member:
        host, _, port = member.rpartition(":")
    if not host or (port and not port.isdigit()):
        raise ValueError(f"invalid Sentinel address {member!r}")
    return unquote(host), int(port) if port else DEFAULT_SENTINEL_PORT


def sentinel_client_from_url(url: str, *, socket_timeout: float = DEFAULT_SOCKET_TIMEOUT) -> redis.Redis:
    """A client of the primary that the Sentinels of ``url`` name, following failovers.

    The URL: ``redis+sentinel://[[user]:[password]@]host[:port][,host[:port]...]/service[/db][?options]``
    (``rediss+sentinel://``: TLS to the data nodes and to the Sentinels). Each ``host:port`` is a
    Sentinel (port 26379 if left out), ``service`` the name they know the primary by
    (``sentinel monitor <service> ...``), ``db`` the database (0 if left out). The user and password,
    and every query option, are redis-py's ``redis://`` ones, for the primary; ``sentinel_username``
    and ``sentinel_password`` log in to the Sentinels themselves. An IPv6 Sentinel is written in
    brackets (``[::1]:26379``). This is the grammar Prefect documents for ``redis+sentinel://``, and
    a subset of the ``redis-sentinel-url`` package's.

    Both the primary's and the Sentinels' connections get ``socket_timeout`` (for connects too) unless
    the URL sets its own. Nothing is asked until the first command: the client asks a Sentinel where the
    primary is whenever it connects, so it follows a failover (a call in flight during one fails).

    Raises:
      ValueError: no Sentinel, no service name, a port or database that is not a number, or an
        option redis-py cannot parse.
    """
    scheme, _, rest = url.partition("://")
    base = SENTINEL_SCHEMES[scheme.lower()]
    netloc, _, tail = rest.partition("/")
    path, _, query = tail.partition("?")
    userinfo, at, members = netloc.rpartition("@")
    segments = path.split("/")
    if "?" in netloc or "#" in url or not segments[0] or len(segments) > 2:
        raise ValueError(f"a Sentinel URL is {scheme}://[user:password@]host[:port][,host[:port]...]/service[/db]")
    sentinels = [_sentinel_address(m) for m in members.split(",")]
    db = segments[1] if len(segments) == 2 and segments[1] else "0"
    if not db.isdigit():
        raise ValueError(f"the database of a Sentinel URL must be a number, got {db!r}")
    pairs = parse_qsl(query, keep_blank_values=True)
    # The data nodes' options: redis-py's own parsing, of the URL's credentials, database and options.
    node: dict[str, Any] = {"socket_timeout": socket_timeout, "socket_connect_timeout": socket_timeout}
    node.update(
        parse_url(
            f"{base}://{userinfo}{at}sentinel-primary/{db}?"  # type: ignore[no-untyped-call]
            + urlencode([(k, v) for k, v in pairs if k not in _SENTINEL_OPTIONS])
        )
    )
    for name in ("host", "port", "connection_class"):  # found through the Sentinels; TLS below
        node.pop(name, None)
    own = {k: v for k, v in node.items() if k.startswith(("socket_", "ssl"))}
    own.update({_SENTINEL_OPTIONS[k]: v for k, v in pairs if k in _SENTINEL_OPTIONS})
    if base == "rediss":
        node["ssl"] = own["ssl"] = True
    sentinel: Any = Sentinel  # untyped in redis-py
    client: redis.Redis = sentinel(sentinels, sentinel_kwargs=own, **node).master_for(unquote(segments[0]))
    return client


def client_like(client: redis.Redis, *, socket_timeout: float = DEFAULT_SOCKET_TIMEOUT) -> redis.Redis:
    """A client of the server and database ``client`` connects to, with its connection settings (credentials,
    TLS, socket options, a Sentinel-managed primary) but a connection pool of its own, never its connections.

    A socket timeout (call or connect) the settings leave unset is ``socket_timeout``: a renewal hanging on a
    socket without one could never confirm a lease.
    """
    pool = client.connection_pool
    kwargs = _settings(pool)
    for name in ("socket_timeout", "socket_connect_timeout"):
        if kwargs.get(name) is None:
            kwargs[name] = socket_timeout
    return redis.Redis(connection_pool=redis.ConnectionPool(connection_class=pool.connection_class, **kwargs))


def _settings(pool: Any) -> dict[str, Any]:
    """A pool's connection settings, without the state it adds for its own connections (redis-py 7+: the
    maintenance-notification handler and the timeouts it restores, the HIMPORT registry): a new pool makes its
    own, and shares none of another's."""
    return {
        name: value
        for name, value in pool.connection_kwargs.items()
        if not (name.startswith("orig_") or name.endswith("_handler") or name == "himport_registry")
    }


def connection_kwargs(client: Any) -> dict[str, Any]:
    """The keyword arguments ``client`` makes its connections with (``socket_timeout``, ...); a Redis Cluster's
    too, whose connections are per node. Empty when the client does not say (a Sentinel client before use)."""
    if isinstance(client, RedisCluster):
        kwargs = client.get_connection_kwargs()  # type: ignore[no-untyped-call]
    else:
        kwargs = getattr(getattr(client, "connection_pool", None), "connection_kwargs", None)
    return kwargs if isinstance(kwargs, dict) else {}


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


def pool_connection(pool: Any) -> Any:
    """A connection taken from a redis-py connection pool (release it with ``pool.release``)."""
    try:
        return pool.get_connection()
    except TypeError:  # redis-py before 5.3 wants a command name
        return pool.get_connection("EVALSHA")


def pipelined(client: Any, commands: Sequence[Sequence[Any]]) -> list[Any]:
    """Send ``commands`` on one connection in one write, then read their replies in order: one round trip.

    An error reply is returned as its exception, not raised, so that every reply is read. The connection
    is the client's own if it has one (a single-connection client, as :class:`ThreadConnections` makes),
    else one of its pool's for the time of the call.
    """
    conn: Any = client.connection
    if conn is None:
        pipe = client.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        return list(pipe.execute(raise_on_error=False))
    try:
        conn.send_packed_command(conn.pack_commands(commands))
        replies: list[Any] = []
        for _ in commands:
            try:
                replies.append(conn.read_response())
            except redis.ResponseError as e:
                replies.append(e)
    except BaseException:
        conn.disconnect()  # replies may be left unread: nobody may read them as theirs
        raise
    return replies


class ThreadConnections:
    """Runs scripts on a connection of the calling thread's own, reopened after any call that did not complete.

    For threads that asynchronous exceptions can interrupt (Dramatiq's worker
    threads): an interruption between sending a command and reading its reply
    would otherwise return a pooled connection with a reply still unread,
    which the next caller would take for its own, or leak the connection.

    Parameters:
      client: a ``redis.Redis`` client whose pool the connections come from. A
        client of a Sentinel pool (``Sentinel(...).master_for(...)``) works too:
        a connection reopened after a call that did not complete asks the
        Sentinels where the primary is now.
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
            client = local.client = redis.Redis(
                connection_pool=self.client.connection_pool, single_connection_client=True
            )
        elif local.dirty:
            client.connection.disconnect()  # the last call did not complete: never read its reply as ours
            _reconnect(client)
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
            kwargs = {**_settings(pool), "socket_timeout": MAX_BLOCK_S + 2}
            client = local.blocking = redis.Redis(
                connection_pool=redis.ConnectionPool(connection_class=pool.connection_class, **kwargs),
                single_connection_client=True,
            )
        elif local.blocking_dirty:
            client.connection.disconnect()
            _reconnect(client)
        local.blocking_dirty = True
        reply = client.blpop([name], timeout=min(timeout_ms, MAX_BLOCK_S * 1000) / 1000)
        local.blocking_dirty = False
        return reply is not None


def _reconnect(client: redis.Redis) -> None:
    """Connect ``client``'s own connection again through ``connect()``, which a Sentinel-managed connection
    overrides to ask the Sentinels where the primary is now. redis-py reconnects a connection that lost its
    server from the address it had, so a single-connection client of a Sentinel pool would never follow a
    failover otherwise (a pooled connection goes through ``connect()`` each time it is taken from the pool)."""
    connection: Any = client.connection
    connection.connect()
