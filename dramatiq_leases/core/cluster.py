"""Script calls on a Redis Cluster, sent to each node by this module rather than by redis-py's cluster client.

A node that hangs (a partition, a stopped process) must cost a call, or a renewal round, one socket
timeout: redis-py's cluster client and pipeline retry and re-read the slot map call by call, and a
round of 60 leases with one master hung took 211 s, so the leases on the other masters lapsed too.
Here every node's calls are written first, then every node's replies read, on a connection of that
node's pool; redirections are followed, and a node's failure is its calls' alone.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from typing import Any, NamedTuple

import redis

from .client import pool_connection

#: One script call: its keys (all in one slot) and its arguments.
Call = tuple[list[str], list[Any]]


#: Replies that say a node is away, or the cluster down: the slot map is read again.
_NODE_DOWN = (redis.ConnectionError, redis.TimeoutError, redis.exceptions.ClusterDownError)


def _try_again(reply: Exception) -> bool:
    """A call that met its slot mid-migration: its keys split between two nodes (``TRYAGAIN``), or, sent
    with ``ASKING`` to the importing node, a key the script derives (a line's) not there yet."""
    return isinstance(reply, redis.exceptions.TryAgainError) or (
        isinstance(reply, redis.ResponseError) and "non local key" in str(reply)
    )


#: How long a call answered ``TRYAGAIN`` waits before it goes again (s), as redis-py's cluster client does.
TRYAGAIN_PAUSE_S = 0.05


class _Retry(NamedTuple):
    """A call to send (again): to ``node`` (``None``: its slot's master in the slot map), with ``ASKING``."""

    call: int
    node: Any = None
    asking: bool = False
    error: Exception | None = None  # why it goes again: kept as its error if it cannot
    failed: str = ""  # the node that could not be reached: it goes again only to another


def call(client: Any, script: Any, keys: list[str], args: list[Any]) -> Any:
    """Run ``script`` on the node that serves ``keys``: its reply, or its error raised."""
    return run(client, script, [(keys, args)])[0]


def run(client: Any, script: Any, calls: list[Call]) -> list[Any]:  # noqa: C901, PLR0912 (one pass loop over a round's states; split, they would cross functions)
    """The replies of ``calls``, in one round trip in all (a renewal round of N leases spans ~N slots: each
    lease key is a hash tag of its own), and one socket timeout for a node that hangs.

    Up to three passes: a call answered ``ASK`` (its slot migrating) goes again to the target with
    ``ASKING``; ``MOVED``, to the node named, and the slot map is read again; ``TRYAGAIN`` (a
    multi-key call during a migration, see :func:`_try_again`), again after a pause; ``NOSCRIPT``,
    again once the node has the script. A node that cannot be reached, or a cluster that says it is
    down, fails its calls unless the slot map read again names another node for them (a failover):
    then they go there.
    A call that still fails is ``None``; the round raises if all do.
    """
    out: list[Any] = [None] * len(calls)
    errors: list[Exception] = []
    todo = _route(client, calls, [_Retry(i) for i in range(len(calls))], errors)
    for attempt in (1, 2, 3):
        again: list[_Retry] = []
        refresh = pause = False
        loaded: set[str] = set()
        for (i, node, asking), reply in zip(todo, _fan_out(todo, script, calls)):
            final = attempt == 3
            if not isinstance(reply, Exception):
                out[i] = reply
            elif not final and isinstance(reply, redis.exceptions.AskError):  # MOVED too: a subclass
                moved = isinstance(reply, redis.exceptions.MovedError)
                refresh = refresh or moved
                target = client.get_node(host=reply.host, port=reply.port)
                if target is None and not moved:
                    errors.append(reply)  # an ASK to a node not in the slot map
                else:  # MOVED to a node not in it: to its slot's master once the map is read again
                    again.append(_Retry(i, target, asking=not moved, error=reply))
            elif not final and _try_again(reply):
                pause = True
                again.append(_Retry(i, node, asking, error=reply))
            elif not final and isinstance(reply, redis.exceptions.NoScriptError):
                if node.name not in loaded:
                    try:
                        node.redis_connection.script_load(script.script)  # this node lost it (a restart)
                    except redis.RedisError as e:
                        errors.append(e)
                        continue
                    loaded.add(node.name)
                again.append(_Retry(i, node, asking, error=reply))
            elif not final and isinstance(reply, _NODE_DOWN):
                refresh = True
                again.append(_Retry(i, error=reply, failed=node.name))
            else:
                errors.append(reply)
                refresh = refresh or isinstance(reply, _NODE_DOWN)
        if refresh:
            _refresh(client)
        if pause:
            time.sleep(TRYAGAIN_PAUSE_S)
        todo = _route(client, calls, again, errors)
        if not todo:
            break
    if errors and all(reply is None for reply in out):
        raise errors[0]
    return out


def _route(client: Any, calls: list[Call], todo: list[_Retry], errors: list[Exception]) -> list[tuple[int, Any, bool]]:
    """``(call, node, asking)`` for each call of ``todo`` that can go (again); the others' errors to ``errors``."""
    routed = []
    for retry in todo:
        node = retry.node
        if node is None:
            try:
                node = client.get_node_from_key(calls[retry.call][0][0])
            except (redis.RedisError, redis.exceptions.RedisClusterException) as e:  # no node serves its slot
                errors.append(e)
                continue
        if node is None or node.name == retry.failed:
            errors.append(retry.error or redis.RedisError("no node for the call"))
            continue
        routed.append((retry.call, node, retry.asking))
    return routed


def _fan_out(todo: list[tuple[int, Any, bool]], script: Any, calls: list[Call]) -> list[Any]:  # noqa: C901, PLR0912 (its write and read loops must share one try: an interruption leaves no reply unread)
    """Send each node its calls on one connection, then read them: a reply, or the exception, per call.

    A node that cannot be reached fails its own calls only. Whatever interrupts this (an asynchronous
    exception in a worker thread) leaves no connection in a pool with replies unread.
    """
    by_node: dict[str, list[int]] = defaultdict(list)
    for n, (_, node, _) in enumerate(todo):
        by_node[node.name].append(n)
    replies: list[Any] = [None] * len(todo)
    sent: list[tuple[Any, Any, list[int]]] = []
    try:
        for positions in by_node.values():
            pool = todo[positions[0]][1].redis_connection.connection_pool
            commands: list[tuple[Any, ...]] = []
            for n in positions:
                i, _, asking = todo[n]
                keys, args = calls[i]
                commands += [("ASKING",)] if asking else []
                commands.append(("EVALSHA", script.sha, len(keys), *keys, *args))
            conn = None
            try:
                conn = pool_connection(pool)  # connects, and greets the node, if it must: may time out too
                conn.send_packed_command(conn.pack_commands(commands))
            except (redis.ConnectionError, redis.TimeoutError, OSError) as e:
                if conn is not None:
                    conn.disconnect()
                    pool.release(conn)
                for n in positions:
                    replies[n] = e
                continue
            sent.append((pool, conn, positions))
        for _, conn, positions in sent:
            for k, n in enumerate(positions):
                try:
                    if todo[n][2]:
                        _read(conn)  # ASKING's OK (if it failed, so does the call)
                    replies[n] = _read(conn)
                except (redis.ConnectionError, redis.TimeoutError, OSError) as e:
                    conn.disconnect()  # the rest of its replies are unread: nobody may read them as theirs
                    for m in positions[k:]:
                        replies[m] = e
                    break
    except BaseException:
        for _, conn, _ in sent:
            conn.disconnect()
        raise
    finally:
        for pool, conn, _ in sent:
            pool.release(conn)
    return replies


def _read(conn: Any) -> Any:
    try:
        return conn.read_response()
    except redis.ResponseError as e:
        return e


def _refresh(client: Any) -> None:
    """Read the slot map again (a node failed, a slot moved); keep the old one if no node answers."""
    with contextlib.suppress(redis.RedisError, redis.exceptions.RedisClusterException):
        client.nodes_manager.initialize()
