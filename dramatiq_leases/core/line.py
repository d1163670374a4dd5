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

import time
from collections.abc import Mapping, Sequence
from typing import Any

from redis.exceptions import AskError, TryAgainError

from .client import MAX_BLOCK_S, connection_kwargs, pool_connection, unavailable
from .errors import LeaseConfigError
from .grants import Grants
from .keys import line_names, order_name, script_names, slot_names, validate_key, wake_name
from .lease import Lease, new_token
from .numbers import check_numbers
from .protocol import (
    DEFAULT_PARK_MS,
    DEFAULT_READY,
    PROMOTE_MS,
    GrantRequest,
    Join,
    Released,
    ReleaseRequest,
    Turn,
    hold_ms,
)
from .rates import Rate
from .runner import ScriptRunner
from .scripts import LINE, MAX_ID_LENGTH, ORDER, WAKE_TTL_MS

#: How long a wait in place ended by a Cluster redirection pauses before its waiter asks again (s).
REDIRECTED_PAUSE_S = 0.05

__all__ = ["DEFAULT_PARK_MS", "DEFAULT_READY", "PROMOTE_MS", "Line"]


class Line:
    """The line of waiters of a :class:`~dramatiq_leases.core.store.Leases` (its :attr:`~.store.Leases.line`).

    For the package's integrations (the middleware, the web helpers), not a public API: joining a line
    means promising to wait as the line expects (block in place, or park a copy and listen on a channel).
    Every call goes through the store's ``runner`` (its thread's connection, a Cluster's node, or the
    pool), grants and releases through its ``grants``. ``ready``, ``park_ms`` and ``promote_ms`` are rules
    every process must share (the scripts decide for all waiters with them): callers keep the defaults;
    tests shorten them.
    """

    def __init__(self, runner: ScriptRunner, grants: Grants) -> None:
        self.runner = runner
        self.grants = grants
        self.client = runner.client
        self.prefix = grants.prefix
        self._order_script = runner.register(ORDER)
        self._line_script = runner.register(LINE)

    def _call(self, script: Any, keys: list[str], args: list[Any]) -> Any:
        return self.runner.call(script, keys, args)

    def _run_line(self, key: str, args: list[Any]) -> Any:
        """``lua/line.lua`` on ``key`` for the waiters ``args[5:]``; its answer, once the waiters it woke are."""
        prefix = self.prefix

        def encode(width: int) -> tuple[list[str], list[Any]]:
            names, (_, waiters, _, _) = script_names(prefix, key), line_names(prefix, key)
            keys = [
                *(names[0], names[2], waiters, names[3], names[1]),
                *(wake_name(prefix, key, w) for w in args[5:]),
                *slot_names(prefix, key, width),
            ]
            return keys, args

        answer, woken = self.runner.call_slots(key, self._line_script, encode)[0]
        self.grants.wake(key, woken)
        return answer

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
        unique: bool = False,
        rates: tuple[Rate, ...] = (),
    ) -> Lease | Turn:
        """:meth:`Leases.try_acquire` as ``waiter`` of ``key``'s line: granted at the head, else a place.

        ``waiter`` is a message id and its retry count; ``first_ms`` its first attempt (server Unix ms;
        0 for now), which orders the line; ``may_wait``: it may wait in place (block on its wake list)
        when among the ``ready`` first, else it parks. The :class:`~.protocol.Turn` answer's ``wait`` says how.
        ``joins``: ``False`` asks as ``waiter`` (a copy of one that ran is still told so) but never joins
        the line: a busy answer is then :attr:`~.protocol.Wait.NONE`. ``limit``: how many may hold the key at once
        (then ``ready + limit - 1`` may wait in place);
        ``latest``: the key keeps only its newest waiter that joined so (the older one's answer, or its
        holder's :meth:`hold`, becomes ``superseded``), newest by ``order`` (needed then: when its message was
        sent, :meth:`send_order`); a message whose order is below the newest that reached the lease (granted, or
        waiting so) is superseded itself, wherever it meets the key, and :attr:`~.protocol.Turn.newer` names that one;
        ``final`` (with ``joins=False``): a busy answer is
        remembered as this waiter's outcome, so a copy of its message asking later is told it is a duplicate;
        ``unique``: the grant ends the message's queued unique record (``lock_unique``) in the same step;
        ``rates``: the key's rates (``lock_rate``): while they allow no more grants the key is full, and its waiters
        wait in the line as for a holder (:mod:`.rates`).
        """
        if not isinstance(waiter, str) or not waiter:
            raise LeaseConfigError(f"a waiter of {key!r} needs a non-empty id, got {waiter!r}", key=key)
        ttl, interval, max_hold = check_numbers(ttl, interval, max_hold)
        request = GrantRequest(
            key,
            token or new_token(),
            ttl,
            interval=interval,
            max_hold=max_hold,
            meta=meta or {},
            waiter=waiter,
            first_ms=first_ms,
            join=(Join.IN_PLACE if may_wait else Join.PARK) if joins else Join.NEVER,
            rules=(ready, park_ms, promote_ms),
            limit=limit,
            latest=latest,
            order=order or 0,
            final=final,
            unique=unique,
            rates=rates,
        )
        return self.grants.grant(request)

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
        request = ReleaseRequest(key, token, fence=fence, slot=slot, waiter=waiter, ready=ready, promote_ms=promote_ms)
        return self.grants.release(request) is not Released.NOT_HELD

    def hold_back(
        self,
        key: str,
        token: str,
        *,
        hold: int,
        waiter: str,
        fence: int | None = None,
        slot: int | None = None,
        promote_ms: int = PROMOTE_MS,
    ) -> bool:
        """Release ``token``'s grant of ``key`` and hold the key back for ``hold`` ms (:meth:`Leases.release`'s
        ``hold``), its message, ``waiter``, waiting at the head of the line meanwhile (its copy parked: it runs
        first once the hold ends; its place lapses ``promote_ms`` after, if it does not come). ``False`` if
        the token no longer held the key: then nothing is touched, no hold, no place.

        Raises:
          LeaseConfigError: ``hold`` is not a whole number of ms from 1 to 86 400 000, or ``waiter`` is empty or
            longer than 512 bytes.
          LeaseUnavailableError: Redis could not be asked; the lease expires by its TTL.
        """
        if not waiter or len(waiter.encode()) > MAX_ID_LENGTH:
            raise LeaseConfigError(f"hold_back: waiter must be a string of 1 to {MAX_ID_LENGTH} bytes, got {waiter!r}")
        request = ReleaseRequest(
            key, token, fence=fence, slot=slot, promote_ms=promote_ms, hold_ms=hold_ms(hold), back=waiter
        )
        return self.grants.release(request) is Released.NOW

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
            reply = self._run_line(key, ["hold", channel, park_ms, ready, promote_ms, *waiters])
        return [r.decode() if isinstance(r, bytes) else str(r) for r in reply]

    def leave(
        self, key: str, waiters: Sequence[str], *, ready: int = DEFAULT_READY, promote_ms: int = PROMOTE_MS
    ) -> int:
        """``waiters`` give up their places in the line of ``key``; returns how many had one."""
        validate_key(key)
        with unavailable(f"leave the line of {key!r}", key):
            return int(self._run_line(key, ["leave", "", 1, ready, promote_ms, *waiters]))

    def wake(self, key: str, waiter: str) -> None:
        """Wake ``waiter`` if it waits in place (it then asks again); for a process shutting down."""
        name = wake_name(self.prefix, validate_key(key), waiter)
        with unavailable(f"wake a waiter of {key!r}", key):
            pipe = self.runner.node_of(name).pipeline(transaction=False)
            pipe.lpush(name, 0)
            pipe.pexpire(name, WAKE_TTL_MS)
            pipe.execute()

    def wait_turn(self, key: str, waiter: str, block_ms: int) -> bool:
        """Block until ``waiter`` is woken (its turn may have come) or ``block_ms`` passed; ``True`` if woken,
        or if a Cluster redirection ended the block (its key's slot moved: ask again).

        Without per-thread connections (a Redis Cluster's client, for one) the
        block is kept under the client's own socket timeout: a read that
        times out would fail the wait, not end it. On a Cluster it is sent to
        the key's node directly: redis-py's cluster client would retry a node
        that hangs and read the slot map again (22 s measured), not fail in
        one timeout.
        """
        name = wake_name(self.prefix, key, waiter)
        with unavailable(f"wait for {key!r}", key):
            if self.runner.threads is not None:
                return self.runner.threads.blpop(name, block_ms)
            limit = (connection_kwargs(self.client).get("socket_timeout") or MAX_BLOCK_S + 1) - 0.5
            timeout = max(0.05, min(block_ms / 1000, limit))
            try:
                return _blpop(self.runner.node_of(name), name, timeout)
            except (AskError, TryAgainError):  # a MovedError is an AskError
                # The slot moved (or is moving) under the block: Redis ends it with a redirection. The wait is
                # over: the caller asks again, through the cluster client, which follows the slot. The pause
                # keeps a slot in mid-migration from being asked in a loop.
                time.sleep(min(REDIRECTED_PAUSE_S, timeout))
                return True


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
