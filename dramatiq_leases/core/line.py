"""The line of waiters of a busy key: who waits, in which order, and how each is told its turn.

A waiter is a message (its id and retry count) that found its key busy. The
line orders waiters by their first attempt; a free key goes to its head only.
Near the head, up to ``ready`` waiters wait *in place*: a worker thread blocks
on the waiter's wake list, which the release pushes to, so the head starts at
once. Further back a waiter is *parked*: its message goes back to the broker
with a long delay, held by some worker process, which registers it here
(:meth:`Line.hold`) and is told on its channel when its turn nears (the
waiter is *promoted*) to send it back at once. A waiter whose turn came and
who does not show up within a bounded time (its deadline) has vanished and
loses its place; if it comes back later it takes its place again, by its first
attempt. A waiter that ran is remembered for an hour, so a stray copy of its
message never runs again. Every decision is taken inside one script.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from redis.cluster import RedisCluster

from .client import MAX_BLOCK_S, connection_kwargs, pool_connection, unavailable
from .errors import LeaseConfigError
from .keys import lease_name, order_name, validate_key, wake_name
from .lease import Busy, Lease
from .scripts import ORDER, WAKE_TTL_MS

if TYPE_CHECKING:
    from .store import Leases

#: How many waiters of one key may wait in place (holding a thread) by default.
DEFAULT_READY = 2

#: How long a parked waiter stays away at most, by default (ms).
DEFAULT_PARK_MS = 300_000

#: How long a waiter asked to come back (promoted) has to show up, in ms (as in ``lua/*.lua``).
PROMOTE_MS = 10_000


class Line:
    """The line of waiters of a :class:`~dramatiq_leases.core.store.Leases` (its ``_line`` part).

    For the package's integrations (the middleware, the web helpers), not a public API: joining a line
    means promising to wait as the line expects (block in place, or park a copy and listen on a channel).
    Every call goes through the store's one call path (its thread's connection, a Cluster's node, or the
    pool). ``ready``, ``park_ms`` and ``promote_ms`` are rules every process must share (the scripts
    decide for all waiters with them): callers keep the defaults; tests shorten them.
    """

    def __init__(self, store: Leases) -> None:
        self._store = store
        self.client = store.client
        self.prefix = store.prefix
        self._order_script = store.client.register_script(ORDER)

    def _call(self, script: Any, keys: list[str], args: list[Any]) -> Any:
        return self._store._call(script, keys, args)

    def _line_keys(self, key: str) -> list[str]:
        return [lease_name(self.prefix, key)]  # the script derives the line's keys from it

    def join(  # noqa: PLR0913 (keyword-only: the acquire's options and the waiter's)
        self,
        key: str,
        ttl: int,
        *,
        waiter: str,
        first_ms: int = 0,
        may_wait: bool = False,
        joins: bool = True,
        interval: int | None = None,
        max_hold: int | None = None,
        meta: Mapping[str, str] | None = None,
        token: str | None = None,
        ready: int = DEFAULT_READY,
        park_ms: int = DEFAULT_PARK_MS,
        promote_ms: int = PROMOTE_MS,
        limit: int = 1,
        latest: bool = False,
        order: int | None = None,
        final: bool = False,
    ) -> Lease | Busy:
        """:meth:`Leases.try_acquire` as ``waiter`` of ``key``'s line: granted at the head, else a place.

        ``waiter`` is a message id and its retry count; ``first_ms`` its first attempt (server Unix ms;
        0 for now), which orders the line; ``may_wait``: it may wait in place (block on its wake list)
        when among the ``ready`` first, else it parks. The :class:`Busy` answer's ``wait`` says how.
        ``joins``: ``False`` asks as ``waiter`` (a copy of one that ran is still told so) but never joins
        the line: a busy answer is then :attr:`Wait.NONE`. ``limit``: how many may hold the key at once
        (then ``ready + limit - 1`` may wait in place);
        ``latest``: the key keeps only its newest waiter that joined so (the older one's answer, or its
        holder's :meth:`hold`, becomes ``superseded``), newest by ``order`` (needed then: when its message was
        sent, :meth:`send_order`); a message whose order is below the newest that reached the lease (granted, or
        waiting so) is superseded itself, wherever it meets the key, and :attr:`Busy.newer` names that one;
        ``final`` (with ``joins=False``): a busy answer is
        remembered as this waiter's outcome, so a copy of its message asking later is told it is a duplicate.
        """
        if not isinstance(waiter, str) or not waiter:
            raise LeaseConfigError(f"a waiter of {key!r} needs a non-empty id, got {waiter!r}", key=key)
        return self._store._grant(
            key,
            ttl,
            interval=interval,
            max_hold=max_hold,
            meta=meta,
            token=token,
            waiter=waiter,
            first_ms=first_ms,
            mode=(2 if may_wait else 1) if joins else 0,
            rules=(ready, park_ms, promote_ms),
            limit=limit,
            latest=latest,
            order=order,
            final=final,
        )

    def send_order(self, key: str) -> int:
        """The order of a message of ``key`` sent now, for :meth:`join` with ``latest``: above every order handed
        out for the key before, and above every order that reached its lease; at least the Redis server's clock
        in microseconds (so an order taken after the record expired is still above the older ones)."""
        validate_key(key)
        with unavailable(f"take a send order for {key!r}", key):
            reply = self._call(self._order_script, [order_name(self.prefix, key)], [])
        return int(reply)

    def release(
        self,
        key: str,
        token: str,
        *,
        waiter: str = "",
        fence: int | None = None,
        slot: int | None = None,
        ready: int = DEFAULT_READY,
        promote_ms: int = PROMOTE_MS,
    ) -> bool:
        """:meth:`Leases.release_token` by a holder that was ``waiter`` in the line (if given): it is
        remembered as having run (for an hour), so a stray copy of its message never runs again. ``slot``: the
        grant's (``None``: looked for by token). ``True`` also when an earlier try released it (its reply lost:
        known by ``fence``, with ``slot``)."""
        code = self._store._release_token(
            key, token, fence=fence, slot=slot, waiter=waiter, ready=ready, promote_ms=promote_ms
        )
        return code != 0

    def hold(
        self,
        key: str,
        waiters: Sequence[str],
        channel: str,
        *,
        park_ms: int = DEFAULT_PARK_MS,
        ready: int = DEFAULT_READY,
        promote_ms: int = PROMOTE_MS,
    ) -> list[str]:
        """This process holds the parked copies of ``waiters`` of ``key``; tell it what to do with each.

        Returns one letter per waiter: ``"p"`` keep it parked; ``"m"`` send it
        back now (its turn is near); ``"r"`` keep it (the waiter waits in place
        elsewhere: this copy is a spare); ``"d"`` it already ran (drop it); ``"s"`` a newer waiter took its
        place (send it back: its delivery is acknowledged, logged and counted); ``"x"`` it has no place
        (send it back now to take it again).
        ``channel`` is the one this process listens on for promotions (the holder of the copies).
        """
        validate_key(key)
        with unavailable(f"hold waiters of {key!r}", key):
            args = ["hold", channel, park_ms, ready, promote_ms, *waiters]
            reply = self._call(self._store._line_script, self._line_keys(key), args)
        return [r.decode() if isinstance(r, bytes) else str(r) for r in reply]

    def leave(
        self, key: str, waiters: Sequence[str], *, ready: int = DEFAULT_READY, promote_ms: int = PROMOTE_MS
    ) -> int:
        """``waiters`` give up their places in the line of ``key``; returns how many had one."""
        validate_key(key)
        keys, args = self._line_keys(key), ["leave", "", 1, ready, promote_ms, *waiters]
        with unavailable(f"leave the line of {key!r}", key):
            return int(self._call(self._store._line_script, keys, args))

    def wake(self, key: str, waiter: str) -> None:
        """Wake ``waiter`` if it waits in place (it then asks again); for a process shutting down."""
        name = wake_name(self.prefix, validate_key(key), waiter)
        with unavailable(f"wake a waiter of {key!r}", key):
            pipe = self._node_of(name).pipeline(transaction=False)
            pipe.lpush(name, 0)
            pipe.pexpire(name, WAKE_TTL_MS)
            pipe.execute()

    def wait_turn(self, key: str, waiter: str, block_ms: int) -> bool:
        """Block until ``waiter`` is woken (its turn may have come) or ``block_ms`` passed; ``True`` if woken.

        Without per-thread connections (a Redis Cluster's client, for one) the
        block is kept under the client's own socket timeout: a read that
        times out would fail the wait, not end it. On a Cluster it is sent to
        the key's node directly: redis-py's cluster client would retry a node
        that hangs and read the slot map again (22 s measured), not fail in
        one timeout.
        """
        name = wake_name(self.prefix, key, waiter)
        with unavailable(f"wait for {key!r}", key):
            if self._store._threads is not None:
                return self._store._threads.blpop(name, block_ms)
            limit = (connection_kwargs(self.client).get("socket_timeout") or MAX_BLOCK_S + 1) - 0.5
            timeout = max(0.05, min(block_ms / 1000, limit))
            return _blpop(self._node_of(name), name, timeout)

    def _node_of(self, name: str) -> Any:
        """The client for the Redis key ``name``: the master of its slot, on a Cluster (without retries)."""
        if isinstance(self.client, RedisCluster):
            return self.client.get_node_from_key(name).redis_connection  # type: ignore[no-untyped-call]
        return self.client


def _blpop(client: Any, name: str, timeout: float) -> bool:
    """``BLPOP name timeout`` on a connection of ``client``'s pool; ``True`` if popped.

    Not ``client.blpop``: redis-py returns its connection to the pool whatever interrupts the call, and an
    asynchronous exception between sending the command and reading its reply would leave the reply for
    the connection's next user to take as its own. Here such a connection is closed first.
    """
    pool = client.connection_pool
    conn = pool_connection(pool)
    try:
        conn.send_command("BLPOP", name, timeout)
        reply = conn.read_response()
    except BaseException:
        conn.disconnect()
        raise
    finally:
        pool.release(conn)
    return reply is not None
