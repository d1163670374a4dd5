"""Script calls on a Redis Cluster, sent to each node by this module rather than by redis-py's cluster client.

A node that hangs (a partition, a stopped process) must cost a call, or a renewal round, one socket
timeout: redis-py's cluster client and pipeline retry and re-read the slot map call by call, and a
round of 60 leases with one master hung took 211 s, so the leases on the other masters lapsed too.
Here every node's calls are written first, then every node's replies read, on a connection of that
node's pool; ``ASK`` and ``MOVED`` are followed once each, and a node's failure is its calls' alone.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Any

import redis

#: One script call: its keys (all in one slot) and its arguments.
Call = tuple[list[str], list[Any]]


def call(client: Any, script: Any, keys: list[str], args: list[Any]) -> Any:
    """Run ``script`` on the node that serves ``keys``: its reply, or its error raised."""
    return run(client, script, [(keys, args)])[0]


def run(client: Any, script: Any, calls: list[Call]) -> list[Any]:
    """The replies of ``calls``, in one round trip in all (a renewal round of N leases spans ~N slots: each
    lease key is a hash tag of its own), and one socket timeout for a node that hangs.

    A call answered ``ASK`` (its slot migrating) is sent again to the target with ``ASKING``; one
    answered ``MOVED`` again to its new owner once the slot map is refreshed (as after a connection
    error, for the next round to find a promoted replica). A slot that fails (half migrated, its
    master down or failing over) fails its own calls only (``None``); the round raises if all do.
    """
    out: list[Any] = [None] * len(calls)
    errors: list[Exception] = []
    todo = _route(client, calls, [(i, None, False) for i in range(len(calls))], errors)
    for attempt in (1, 2, 3):
        again: list[tuple[int, Any, bool]] = []
        refresh = False
        for (i, node, asking), reply in zip(todo, _fan_out(todo, script, calls)):
            if attempt < 3 and isinstance(reply, redis.exceptions.MovedError):
                refresh = True
                again.append((i, None, False))  # routed again once the slot map is refreshed
            elif attempt < 3 and isinstance(reply, redis.exceptions.AskError):
                target = client.get_node(host=reply.host, port=reply.port)
                if target is None:
                    errors.append(reply)
                else:
                    again.append((i, target, True))
            elif attempt < 3 and isinstance(reply, redis.exceptions.NoScriptError):
                try:
                    node.redis_connection.script_load(script.script)  # this node lost it (a restart)
                    again.append((i, node, asking))
                except redis.RedisError as e:
                    errors.append(e)
            elif isinstance(reply, Exception):
                refresh = refresh or isinstance(reply, (redis.ConnectionError, redis.TimeoutError))
                errors.append(reply)
            else:
                out[i] = reply
        if refresh:
            _refresh(client)
        todo = _route(client, calls, again, errors)
        if not todo:
            break
    if errors and all(reply is None for reply in out):
        raise errors[0]
    return out


def _route(client: Any, calls: list[Call], todo: list[tuple[int, Any, bool]],
           errors: list[Exception]) -> list[tuple[int, Any, bool]]:
    """``todo`` with a node for each call not given one: its slot's master now (failing calls go to ``errors``)."""
    routed = []
    for i, node, asking in todo:
        try:
            routed.append((i, node or client.get_node_from_key(calls[i][0][0]), asking))
        except redis.RedisError as e:  # no node serves its slot
            errors.append(e)
    return routed


def _fan_out(todo: list[tuple[int, Any, bool]], script: Any, calls: list[Call]) -> list[Any]:
    """Send each node its calls on one connection, then read them: a reply, or the exception, per call."""
    by_node: dict[str, list[int]] = defaultdict(list)
    for n, (_, node, _) in enumerate(todo):
        by_node[node.name].append(n)
    replies: list[Any] = [None] * len(todo)
    sent: list[tuple[Any, Any, list[int]]] = []
    try:
        for positions in by_node.values():
            pool = todo[positions[0]][1].redis_connection.connection_pool
            conn = _connection(pool)
            sent.append((pool, conn, positions))
            commands: list[tuple[Any, ...]] = []
            for n in positions:
                i, _, asking = todo[n]
                keys, args = calls[i]
                commands += [("ASKING",)] if asking else []
                commands.append(("EVALSHA", script.sha, len(keys), *keys, *args))
            try:
                conn.send_packed_command(conn.pack_commands(commands))
            except (redis.ConnectionError, redis.TimeoutError, OSError) as e:
                sent.pop()
                conn.disconnect()
                pool.release(conn)
                for n in positions:
                    replies[n] = e
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


def _connection(pool: Any) -> Any:
    try:
        return pool.get_connection()
    except TypeError:  # redis-py before 5.3 wants a command name
        return pool.get_connection("EVALSHA")


def _refresh(client: Any) -> None:
    """Ask the cluster for its slot map again (a node failed or a slot moved); keep the old one if none answers."""
    with contextlib.suppress(redis.RedisError):
        client.nodes_manager.initialize()
