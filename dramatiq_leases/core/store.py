"""Leases on keys in one Redis deployment: acquire, renew, release, adopt and inspect.

Every operation is one script and one round trip (see :mod:`.scripts`);
numbers are checked before Redis is asked. This module knows nothing of Dramatiq.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import redis
from redis.cluster import RedisCluster

from . import cluster, rounds, scripts, tracing
from .client import (
    DEFAULT_SOCKET_TIMEOUT,
    RedisClient,
    ThreadConnections,
    client_from_url,
    evalsha,
    server_attributes,
    unavailable,
)
from .errors import LeaseBusyError, LeaseConfigError, LeaseExpiredError, LeaseStateError, LeaseUnavailableError
from .history import HistoryEvent, parse
from .info import LeaseInfo, meta_args, text
from .keys import DEFAULT_PREFIX, fence_name, history_name, lease_name, order_name, validate_key, validate_prefix
from .lease import Busy, Lease, LostReason, Renewal, Wait, default_interval, new_token
from .line import DEFAULT_PARK_MS, DEFAULT_READY, PROMOTE_MS, Line
from .numbers import margin_ms, whole_count, whole_limit, whole_ms
from .reading import LineInfo, Reader, ReadGaps
from .recovery import DeadRelease, release_if_dead, target
from .replication import DEFAULT_REPLICA_TIMEOUT_MS, MAX_REPLICAS, check_replication, evalsha_acked, not_replicated
from .scripts import MAX_HISTORY, MAX_ID_LENGTH, MAX_LIMIT, MAX_ORDER, MAX_TIMESTAMP_MS

if TYPE_CHECKING:
    from .heartbeat import Heartbeat

_new_token = new_token  # for methods whose parameter is named new_token


def _check_numbers(ttl: Any, interval: Any, max_hold: Any) -> tuple[int, int, int]:
    """Validated ``(ttl, interval or 0, max_hold or 0)``: every number is checked before any write."""
    ttl = whole_ms(ttl, "ttl")
    interval = 0 if interval is None else whole_ms(interval, "interval")
    max_hold = 0 if max_hold is None else whole_ms(max_hold, "max_hold")
    return ttl, interval, max_hold


_WAITS = [Wait.NONE, Wait.IN_PLACE, Wait.PARK, Wait.SOON, Wait.DUPLICATE, Wait.SUPERSEDED, Wait.COPY_HOLDS]

_RENEW_CODES = {"1": Renewal.OK, "0": Renewal.GONE, "s": Renewal.STOLEN, "m": Renewal.MAX_HOLD}

# Span names and script names (db.stored_procedure.name) of the traced operations: see .tracing.
_ACQUIRE, _RENEW, _RELEASE = "lease.acquire", "lease.renew", "lease.release"
_ACQUIRE_SPAN, _RENEW_SPAN, _RELEASE_SPAN = f"EVALSHA {_ACQUIRE}", f"EVALSHA {_RENEW}", f"EVALSHA {_RELEASE}"
_RENEW_PIPELINE_SPAN = f"PIPELINE EVALSHA {_RENEW}"


class Leases:
    """Leases on keys, stored in one Redis deployment (standalone, Sentinel or Cluster).

    Parameters:
      client: a ``redis.Redis`` or ``redis.cluster.RedisCluster`` client.
        Give it a ``socket_timeout`` shorter than your TTLs: a renewal that
        hangs cannot confirm a lease.
      prefix: the prefix of every Redis key written. Defaults to
        ``"dramatiq-leases"``.
      thread_connections: acquire, adopt and release on a connection of the
        calling thread's own, reopened after any call that did not complete.
        For threads that asynchronous exceptions can interrupt (Dramatiq's
        worker threads): an interruption between sending a command and
        reading its reply would otherwise return a pooled connection with a
        reply still unread, which the next caller would take for its own, or
        leak the connection from the pool. Not available with RedisCluster.
      fence_retention: how long the fence counter of a key nobody has
        acquired or released is kept (whole ms); ``None`` (the default): for
        ever. A fleet leasing per-user or per-invoice keys keeps one counter
        (~100 bytes) for every key it ever leased; with a retention, idle
        counters expire and the store stays bounded. Fences stay strictly
        increasing per key across an expiry: each fence is then at least the
        server's clock in microseconds at its grant, so a counter made again
        starts above every fence the old one handed out (docs/guarantees.md, "Fences only grow",
        says what breaks it: the server's clock stepping back by more than
        the time the counter was idle). They also rise across a failover to a
        replica that had not received the last grants, which hands plain
        counters' fences out again, as long as the new primary's clock is not
        behind the old one's by more than the time between the lost grant and
        the next (docs/replication.md). Every process using the store must
        use the same setting: one without it restarts an expired counter at 1.
      min_replicas: how many replicas must acknowledge a grant before it
        counts (0, the default: none asked). Redis replicates asynchronously:
        a grant that a failing primary had not yet sent to the replica that
        replaces it is unknown there, and the key can be granted again. With
        ``min_replicas=N``, ``WAIT N replica_timeout`` follows every
        acquire, adoption and renewal round on the same connection, in the
        same round trip; a grant fewer than N replicas acknowledged in time is
        released (owner-checked) and reported as
        :class:`~.errors.LeaseUnavailableError`, and a renewal round fewer
        acknowledged confirms nothing (its leases are :attr:`Renewal.ERROR`;
        their deadlines run on). ``WAIT`` is not consensus: see
        docs/replication.md for what it adds and what it does not. Not
        available with RedisCluster.
      replica_timeout: how long ``WAIT`` waits for those acknowledgements
        (whole ms; default 500). It must be shorter than the client's
        ``socket_timeout``, and should be well under the renew interval.
      history: keep each key's history, its newest ``history`` events (0 to
        10 000; ``None`` or 0, the default: none). Every script that changes
        a key's state appends an event in the same step (granted, released,
        lost, expired, adopted, duplicate, superseded, force-released...; see
        :class:`~.history.HistoryEvent`), to a list in the key's hash slot kept
        a week after its last event; :meth:`history` reads it. Off, the
        scripts make no extra call. Give every process of the fleet the same
        setting: a process without it records nothing (an operator's
        ``release`` from the CLI appends to a history that exists).

    Example:
      >>> leases = Leases.from_url("redis://127.0.0.1:6379/1")
      >>> lease = leases.try_acquire("export:report:42", ttl=30_000)
      >>> if lease:
      ...     try:
      ...         do_export(fence=lease.fence)
      ...     finally:
      ...         leases.release(lease)
      ... else:
      ...     print(f"busy, retry in {lease.retry_after}s")
    """

    def __init__(
        self,
        client: RedisClient,
        *,
        prefix: str = DEFAULT_PREFIX,
        thread_connections: bool = False,
        fence_retention: int | None = None,
        min_replicas: int = 0,
        replica_timeout: int = DEFAULT_REPLICA_TIMEOUT_MS,
        history: int | None = None,
    ) -> None:
        self.client = client
        #: How many events each key's history keeps (0: none kept).
        self.history_cap = (
            0 if history is None else whole_count(history, "history", maximum=MAX_HISTORY, owner="Leases")
        )
        self.prefix = validate_prefix(prefix)
        self.fence_retention = (
            0 if fence_retention is None else whole_ms(fence_retention, "fence_retention", owner="Leases")
        )
        self._cluster = isinstance(client, RedisCluster)
        self.min_replicas = whole_count(min_replicas, "min_replicas", maximum=MAX_REPLICAS, owner="Leases")
        self.replica_timeout = whole_ms(replica_timeout, "replica_timeout", owner="Leases")
        if self.min_replicas:
            check_replication(client, self.replica_timeout)
        self._threads = (
            ThreadConnections(client)
            if thread_connections and isinstance(client, redis.Redis) and not self._cluster
            else None
        )
        self._acquire = client.register_script(scripts.ACQUIRE)
        self._acquire_latest = client.register_script(scripts.ACQUIRE_LATEST)
        self._renew_many = client.register_script(scripts.RENEW_MANY)
        self._release = client.register_script(scripts.RELEASE)
        self._release_if_dead = client.register_script(scripts.RELEASE_IF_DEAD)
        self._adopt = client.register_script(scripts.ADOPT)
        self._line_script = client.register_script(scripts.LINE)
        self._history_script = client.register_script(scripts.HISTORY)
        self._names: dict[str, list[str]] = {}
        # Parts, each with one idea. Every write script goes through _call (or _call_acked); reads go through
        # the reader's pipelines, master by master.
        self._reader = Reader(client, self.prefix)
        self._line = Line(self)
        # The span attributes every call of an operation shares, built once: spans are per message.
        server: dict[str, str | int] = {tracing.DB_SYSTEM: "redis", **server_attributes(client)}
        self._span_attrs: dict[str, dict[str, str | int]] = {
            name: {**server, tracing.DB_OPERATION: "EVALSHA", tracing.DB_PROCEDURE: name}
            for name in (_ACQUIRE, _RENEW, _RELEASE)
        }
        self._pipeline_attrs: dict[str, str | int] = {
            **server,
            tracing.DB_OPERATION: "PIPELINE EVALSHA",
            tracing.DB_PROCEDURE: _RENEW,
        }

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        prefix: str = DEFAULT_PREFIX,
        socket_timeout: float = DEFAULT_SOCKET_TIMEOUT,
        fence_retention: int | None = None,
        min_replicas: int = 0,
        replica_timeout: int = DEFAULT_REPLICA_TIMEOUT_MS,
        history: int | None = None,
    ) -> Leases:
        """Leases on the Redis at ``url``; its calls and connects time out after ``socket_timeout`` seconds.

        ``redis://``, ``rediss://`` and ``unix://``: one server, as redis-py reads them.

        ``redis+sentinel://[[user]:[password]@]host[:port][,host[:port]...]/service[/db][?options]``
        (``rediss+sentinel://`` with TLS): the primary that these Sentinels (port 26379 if left out)
        know as ``service``, database ``db`` (default 0), found again after a failover. The user,
        password and options (redis-py's ``redis://`` ones) are the primary's; ``sentinel_username``
        and ``sentinel_password`` log in to the Sentinels. Example:
        ``redis+sentinel://s1:26379,s2:26379,s3:26379/mymaster/0``. Replication is asynchronous:
        see ``min_replicas``.

        The other parameters are the constructor's.
        """
        client = client_from_url(url, socket_timeout=socket_timeout)
        return cls(
            client,
            prefix=prefix,
            fence_retention=fence_retention,
            min_replicas=min_replicas,
            replica_timeout=replica_timeout,
            history=history,
        )

    # Names -----------------------------------------------------------------

    def lease_name(self, key: str) -> str:
        """The Redis key holding the lease on ``key``."""
        return lease_name(self.prefix, key)

    def fence_name(self, key: str) -> str:
        """The Redis key holding the fencing counter of ``key``."""
        return fence_name(self.prefix, key)

    # Acquire, adopt, renew, release -----------------------------------------

    def try_acquire(
        self,
        key: str,
        ttl: int,
        *,
        interval: int | None = None,
        max_hold: int | None = None,
        meta: Mapping[str, str] | None = None,
        token: str | None = None,
        limit: int = 1,
    ) -> Lease | Busy:
        """Acquire ``key`` for ``ttl`` milliseconds without waiting.

        A key with a line of waiters (messages of the middleware waiting for
        it) goes to the front of its line only: this caller is answered
        :class:`Busy`, and the front is woken if the key has a free slot.

        Parameters:
          key: the lease key.
          ttl: the lease's time to live in whole milliseconds, restored by each renewal.
          interval: how often a :class:`Heartbeat` will renew it, in
            milliseconds, stored so observers can tell an overdue heartbeat.
            Leave it out for a lease nobody renews (taken in a web request
            and handed to a worker); a heartbeat that tracks it anyway
            renews every ``ttl // 3``.
          max_hold: the longest the holder may trust the lease, in
            milliseconds from now; renewals never extend it past that.
          meta: holder metadata stored with the lease (strings).
          token: the owner token to use; default a fresh random one. Choose
            it beforehand to be able to release a grant whose reply was lost.
          limit: how many may hold ``key`` at once (1 to 1 000; default 1):
            granted while fewer hold it, whatever limit they were granted
            with. Each holder has its own slot (:attr:`Lease.slot`), token,
            TTL and fence; the fences of one key only grow across all of them.

        Returns:
          a :class:`Lease` with the token and a new fence, or :class:`Busy`
          (falsy) with the holder's remaining TTL.

        Raises:
          LeaseConfigError: a number is not a whole count of milliseconds in
            range, or the metadata is not strings; checked before Redis is asked.
          LeaseUnavailableError: Redis could not be asked; nothing was
            granted. With ``min_replicas``: also a grant that too few replicas
            acknowledged in time, released again (owner-checked; if the
            release fails too, it ends by its TTL).
        """
        return self._grant(key, ttl, interval=interval, max_hold=max_hold, meta=meta, token=token, limit=limit)

    def _grant(  # noqa: PLR0913 (keyword-only: one script's arguments)
        self,
        key: str,
        ttl: int,
        *,
        interval: int | None,
        max_hold: int | None,
        meta: Mapping[str, str] | None,
        token: str | None,
        waiter: str = "",
        first_ms: int = 0,
        mode: int = 0,
        rules: tuple[int, int, int] = (DEFAULT_READY, DEFAULT_PARK_MS, PROMOTE_MS),
        limit: int = 1,
        latest: bool = False,
        order: int | None = None,
        final: bool = False,
    ) -> Lease | Busy:
        """The acquire script, for :meth:`try_acquire` (``mode`` 0: never joins the line) and
        :meth:`Line.join` (1: may park, 2: may wait in place); ``rules``: ready, park_ms, promote_ms;
        ``latest``: the key keeps only its newest such waiter, newest by ``order`` (needed then); ``final``
        (``mode`` 0): a refusal is remembered, so another copy of this waiter never runs after it."""
        validate_key(key)
        if latest and (isinstance(order, bool) or not isinstance(order, int) or not 1 <= order <= MAX_ORDER):
            raise LeaseConfigError(
                f"a latest waiter of {key!r} needs an order, a whole number from 1 to {MAX_ORDER}; got {order!r}",
                key=key,
            )
        ttl, stored_interval, max_hold_ms = _check_numbers(ttl, interval, max_hold)
        limit = whole_limit(limit, "limit", maximum=MAX_LIMIT)
        if first_ms:
            first_ms = whole_ms(first_ms, "first_ms", minimum=0, maximum=MAX_TIMESTAMP_MS)
        token = token or new_token()
        meta = dict(meta or {})
        ready, park_ms, promote_ms = rules
        policy = 2 if final else int(latest)
        line = f"{first_ms} {mode} {ready} {park_ms} {promote_ms} {self.fence_retention} {limit} {policy}"
        keys, script = self._keys(key), self._acquire
        if latest:  # its own build of the script: the message's order, and the key's order record
            line += f" {self.history_cap} {order}"
            keys, script = [*keys, order_name(self.prefix, key)], self._acquire_latest
        elif self.history_cap:
            line += f" {self.history_cap}"
        args: list[Any] = [
            token,
            ttl,
            max_hold_ms,
            stored_interval,
            margin_ms(ttl),
            waiter,
            line,
            *meta_args(key, meta),
        ]
        if waiter:  # named in the grant, so that another copy of the same message never holds a slot beside it
            args += ["waiter", waiter]
        attributes: dict[str, str | int] = {**self._span_attrs[_ACQUIRE], tracing.TTL: ttl}
        if tracing.keys_recorded():
            attributes[tracing.KEY] = key
        with tracing.span(_ACQUIRE_SPAN, attributes) as span:
            sent_at = time.monotonic()
            with unavailable(f"acquire lease {key!r}", key):
                reply, acked = self._call_acked(script, keys, args)
            if int(reply[0]) != 1:
                span.set_attributes({tracing.OUTCOME: "busy", tracing.FENCE: int(reply[2])})
                return Busy(
                    key=key,
                    ttl_left=int(reply[1]),
                    fence=int(reply[2]),
                    now_ms=int(reply[3]),
                    wait=_WAITS[int(reply[4])],
                    place=int(reply[5]),
                    line=int(reply[6]),
                    block_ms=int(reply[7]),
                    newer=text(reply[8]) if len(reply) > 8 else "",
                )
            if acked < self.min_replicas:
                self._not_replicated("acquire", key, token, acked)
            span.set_attributes({tracing.OUTCOME: "acquired", tracing.FENCE: int(reply[1])})
        lease = Lease(
            key=key,
            token=token,
            fence=int(reply[1]),
            ttl=ttl,
            interval=stored_interval or default_interval(ttl),
            max_hold=max_hold_ms or None,
            acquired_at=int(reply[2]) / 1000,
            meta=meta,
            sent_at=sent_at,
        )
        released_ms = int(reply[4])
        if released_ms:
            lease.handoff = max(0, int(reply[2]) - released_ms) / 1000
        lease.from_line = int(reply[5]) == 1
        lease.slot = int(reply[6])
        return lease

    def _keys(self, key: str, slot: int = 0) -> list[str]:
        """The Redis keys of a lease's scripts: lease (its holder ``slot``'s), fence (the last 1 024 keys cached; the
        scripts derive the line's keys from the lease's name)."""
        if slot:
            return [lease_name(self.prefix, key, slot), self._keys(key)[1]]
        names = self._names.get(key)
        if names is None:
            names = [lease_name(self.prefix, key), fence_name(self.prefix, key)]
            if len(self._names) >= 1024:
                self._names.clear()  # per-invoice keys must not grow it without bound
            self._names[key] = names
        return names

    def adopt(
        self,
        key: str,
        token: str,
        ttl: int,
        *,
        interval: int | None = None,
        max_hold: int | None = None,
        meta: Mapping[str, str] | None = None,
        new_token: str | None = None,
        slot: int = 0,
    ) -> Lease | Busy | None:
        """Take over a lease acquired elsewhere (a web request) by proving its ``token``.

        Adoption happens once: the lease gets a new owner token, so a second
        adopter presenting the same handed-over token finds the key busy. The
        fence stays the grant's (one grant, one run). The TTL becomes ``ttl``;
        the maximum hold becomes the earlier of the grant's and ``max_hold``
        from now. ``slot``: the handed lease's :attr:`Lease.slot`.

        Returns:
          the adopted :class:`Lease` (with the new token); :class:`Busy` if
          another token holds ``key`` now, including an earlier adopter;
          ``None`` if the lease is gone (expired or released) or its maximum
          hold leaves less than the safety margin.

        Raises:
          LeaseConfigError: as :meth:`try_acquire`.
          LeaseUnavailableError: Redis could not be asked; or, with
            ``min_replicas``, the adoption was acknowledged by too few replicas
            in time: the adopted lease is then released (owner-checked).
        """
        validate_key(key)
        ttl, stored_interval, max_hold_ms = _check_numbers(ttl, interval, max_hold)
        if not isinstance(token, str) or not token:
            raise LeaseConfigError(f"the handed-over token must be a non-empty string, got {token!r}")
        slot = whole_count(slot, "slot", maximum=MAX_LIMIT - 1)
        mine = new_token or _new_token()
        meta = dict(meta or {})
        interval_ms = stored_interval or default_interval(ttl)
        margin = margin_ms(ttl)
        args: list[Any] = [token, mine, ttl, interval_ms, margin, max_hold_ms, *meta_args(key, meta)]
        if self.history_cap:
            args.append(self.history_cap)  # an odd last argument: the history cap
        sent_at = time.monotonic()
        with unavailable(f"adopt lease {key!r}", key):
            reply, acked = self._call_acked(self._adopt, [lease_name(self.prefix, key, slot)], args)
        code = int(reply[0])
        if code == 0:
            return None
        if code < 0:
            return Busy(key=key, ttl_left=int(reply[1]), fence=int(reply[2]), now_ms=int(reply[3]))
        if acked < self.min_replicas:
            self._not_replicated("adopt", key, mine, acked)
        _, fence, acquired_ms, until_ms, now_ms = (int(x) for x in reply)
        adopted = Lease(
            key=key,
            token=mine,
            fence=fence,
            ttl=ttl,
            interval=interval_ms,
            # The server keeps the key until until_ms; the holder stops a margin earlier.
            max_hold=(until_ms - now_ms - margin) if until_ms else None,
            acquired_at=acquired_ms / 1000,
            meta=meta,
            sent_at=sent_at,
        )
        adopted.slot = slot
        return adopted

    def _call(self, script: Any, keys: list[str], args: list[Any]) -> Any:
        if self._cluster:
            return cluster.call(self.client, script, keys, args)
        if self._threads is None:
            return evalsha(self.client, script, keys, args)
        return self._threads.call(script, keys, args)

    def _call_acked(self, script: Any, keys: list[str], args: list[Any]) -> tuple[Any, int]:
        """:meth:`_call`, then, with ``min_replicas``, ``WAIT`` on the same connection in the same round trip:
        the reply, and how many replicas acknowledged it (``0`` without ``min_replicas``: none asked)."""
        if not self.min_replicas:
            return self._call(script, keys, args), 0
        replicas, timeout_ms = self.min_replicas, self.replica_timeout
        if self._threads is None:
            return evalsha_acked(self.client, script, keys, args, replicas=replicas, timeout_ms=timeout_ms)
        return self._threads.run(
            lambda client: evalsha_acked(client, script, keys, args, replicas=replicas, timeout_ms=timeout_ms)
        )

    def _not_replicated(self, what: str, key: str, token: str, acked: int) -> NoReturn:
        """A grant too few replicas acknowledged: a failover may lose it, so it is not trusted. Release it
        (owner-checked) and fail as if Redis had not answered."""
        try:
            released = self.release_token(key, token)
        except LeaseUnavailableError:
            released = None
        raise not_replicated(
            what, key, acked=acked, wanted=self.min_replicas, timeout_ms=self.replica_timeout, released=released
        )

    def renew(self, lease: Lease) -> Renewal:
        """Restore ``lease``'s TTL if this token still holds it. Raises :class:`LeaseUnavailableError`."""
        return self.renew_many([lease])[0]

    def renew_many(self, leases: Sequence[Lease], *, links: Sequence[object] = ()) -> list[Renewal]:
        """Renew many leases in one round trip (on a Cluster too: every master is sent its calls at once).

        Confirmed leases have their local validity extended. Returns one
        :class:`Renewal` per lease, in order. ``links``: span contexts from
        :func:`.tracing.current_context` for the round's span to link to.
        On a Redis Cluster, the leases of a slot that fails (half migrated,
        its master failing over) are :attr:`Renewal.ERROR`; the others stand.
        With ``min_replicas``, a round that fewer replicas acknowledged in
        time confirms nothing: the leases it renewed are :attr:`Renewal.ERROR`
        and their deadlines run on (those found gone or stolen are lost as ever).

        Raises:
          LeaseUnavailableError: Redis could not be asked (on a Cluster: no slot answered).
        """
        if not leases:
            return []
        batches, calls = rounds.plan(
            leases, lambda lease: self._keys(lease.key, lease.slot)[0], cluster=self._cluster, history=self.history_cap
        )
        # Several script calls on one connection are a pipeline: a batch in the conventions' terms.
        attributes: dict[str, str | int]
        if not self._cluster and len(batches) > 1:
            name = _RENEW_PIPELINE_SPAN
            attributes = {**self._pipeline_attrs, tracing.DB_BATCH_SIZE: len(batches), tracing.COUNT: len(leases)}
        else:
            name, attributes = _RENEW_SPAN, {**self._span_attrs[_RENEW], tracing.COUNT: len(leases)}
        with tracing.span(name, attributes, links) as span:
            sent_at = time.monotonic()
            with unavailable(f"renew {len(leases)} lease(s)"):
                if self.min_replicas:  # never a Cluster: see __init__
                    replies, acked = rounds.run_acked(
                        self.client, self._renew_many, calls, self.min_replicas, self.replica_timeout
                    )
                elif self._cluster:
                    replies, acked = cluster.run(self.client, self._renew_many, calls), 0
                else:
                    replies, acked = rounds.run(self.client, self._renew_many, calls), 0
            unconfirmed = acked < self.min_replicas  # a failover could undo these renewals
            out = [Renewal.ERROR] * len(leases)
            for batch, codes in zip(batches, replies):
                if codes is None:  # its slot failed (Cluster); the others' answers stand
                    continue
                for i, code in zip(batch, text(codes)):
                    out[i] = _RENEW_CODES.get(code, Renewal.STOLEN)
                    if out[i] is Renewal.OK:
                        if unconfirmed:
                            out[i] = Renewal.ERROR
                        else:
                            leases[i]._confirm(sent_at)
            lost = len(leases) - out.count(Renewal.OK)
            span.set_attributes({tracing.OUTCOME: "ok" if not lost else "lost", tracing.LOST_COUNT: lost})
        return out

    def release(self, lease: Lease) -> bool:
        """Release ``lease`` if its token still holds it; ``False`` if it did not (nothing touched).

        Raises:
          LeaseUnavailableError: Redis could not be asked; the lease expires by its TTL.
        """
        return self.release_token(lease.key, lease.token, fence=lease.fence, slot=lease.slot)

    def release_token(
        self, key: str, token: str, *, fence: int | None = None, slot: int | None = None, by: str | None = None
    ) -> bool:
        """Release the lease on ``key`` only if ``token`` holds it; ``False`` if it did not (nothing touched).

        For a holder that kept the token, not the :class:`Lease` (a web request that handed its lease on,
        an operator). ``slot`` is the grant's :attr:`Lease.slot` (``None``: the token is looked for in every
        slot of the key). The front of the key's line, if any, is woken. ``by``: who releases it in its
        holder's stead (an operator, ``user@host``): the key's history records a ``force_released`` by them,
        also from a store without ``history`` if the key has a history.

        Raises:
          LeaseConfigError: ``by`` is not a string of at most 512 bytes (UTF-8).
          LeaseUnavailableError: Redis could not be asked; the lease expires by its TTL.
        """
        return self._release_token(key, token, fence=fence, slot=slot, by=_by(by)) == 1

    def _release_token(
        self,
        key: str,
        token: str,
        *,
        fence: int | None,
        slot: int | None = 0,
        waiter: str = "",
        ready: int = DEFAULT_READY,
        promote_ms: int = PROMOTE_MS,
        by: str = "",
    ) -> int:
        """The release script, for :meth:`release_token` and :meth:`Line.release` (``waiter`` is recorded as
        having run): 1 released, 0 not held, 2 not held but recorded as released by ``fence`` (an earlier
        release of this grant, whose reply was lost). ``by``: an operator's release (see :meth:`release_token`)."""
        args: list[Any] = [
            token,
            waiter,
            ready,
            promote_ms,
            self.fence_retention,
            # A release asked again after its reply was lost finds this grant recorded as released.
            "find" if slot is None else "" if fence is None else str(fence),
        ]
        if by:
            args += [self.history_cap or -1, by]  # -1: a history the fleet keeps, even unknown to this store
        elif self.history_cap:
            args.append(self.history_cap)
        attributes: dict[str, str | int] = dict(self._span_attrs[_RELEASE])
        if tracing.keys_recorded():
            attributes[tracing.KEY] = key
        if fence is not None:
            attributes[tracing.FENCE] = fence
        with tracing.span(_RELEASE_SPAN, attributes) as span:
            with unavailable(f"release lease {key!r}", key):
                reply = self._call(self._release, self._keys(key, slot or 0), args)
                code = int(reply)
            span.set_attribute(tracing.OUTCOME, "released" if code == 1 else "not_held")
        return code

    # A with form ---------------------------------------------------------------

    @contextlib.contextmanager
    def lease(
        self,
        key: str,
        ttl: int,
        *,
        heartbeat: Heartbeat | None = None,
        on_lost: Callable[[Lease, LostReason], None] | None = None,
        interval: int | None = None,
        max_hold: int | None = None,
        meta: Mapping[str, str] | None = None,
        limit: int = 1,
    ) -> Iterator[Lease]:
        """Hold ``key`` for the ``with`` block: acquired on entry, released (owner-checked) on exit.

        With a started :class:`~dramatiq_leases.core.heartbeat.Heartbeat`, the lease is renewed while the
        block runs and ``on_lost`` is called (on a heartbeat thread) if it is lost; without one it lasts
        ``ttl`` ms from the grant. Either way :meth:`Lease.remaining` says how long the block may still rely
        on it (0 once lost). The token is chosen before Redis is asked, so an interruption anywhere
        (``KeyboardInterrupt``, a time limit) still releases what was granted. ``limit``: as
        :meth:`try_acquire` (the block then holds one of that many slots).

        Raises:
          LeaseBusyError: another owner holds ``key`` (its ``busy`` says when to retry).
          LeaseExpiredError: at the end of a block that raised nothing, if its token no longer held the key
            (expired or taken: its work may have overlapped another holder's).
          LeaseConfigError, LeaseUnavailableError: as :meth:`try_acquire`; nothing is held. A release
            that cannot reach Redis at the end is not raised (it cannot say): the lease ends by its TTL.

        Example:
          >>> with leases.lease("export:report:42", ttl=30_000, heartbeat=heartbeat) as lease:
          ...     do_export(fence=lease.fence)
        """
        if on_lost is not None and heartbeat is None:
            raise LeaseConfigError(f"lease {key!r}: on_lost is called by a heartbeat; pass heartbeat= too", key=key)
        token = new_token()
        got: Lease | Busy | None = None
        released: bool | None = None
        try:
            got = self.try_acquire(key, ttl, interval=interval, max_hold=max_hold, meta=meta, token=token, limit=limit)
            if isinstance(got, Busy):
                raise LeaseBusyError(got)
            if heartbeat is not None:
                heartbeat.track(got, on_lost or _ignore_lost)
            yield got
        finally:
            if isinstance(got, Lease) and heartbeat is not None:
                heartbeat.untrack(got)
            if not isinstance(got, Busy):  # granted, or perhaps granted by a call an interruption cut short
                with contextlib.suppress(LeaseUnavailableError):
                    # A grant whose reply never came is looked for by its token in every slot.
                    slot = got.slot if isinstance(got, Lease) else None
                    # 2: released by an earlier try whose reply was lost (redis-py sends a command again).
                    released = self._release_token(key, token, fence=got.fence if got else None, slot=slot) != 0
        if isinstance(got, Lease) and released is False:  # released: still ours, so nobody held it between
            raise LeaseExpiredError(
                f"lease {key!r} (fence {got.fence}) ended before its with block did: its work may have "
                "overlapped another holder's",
                lease=got,
            )

    # Reading and recovery: the _reader part and the recovery script -------------

    def inspect(self, key: str, *, slot: int = 0, gaps: ReadGaps | None = None) -> LeaseInfo | None:
        """What Redis holds for the lease on ``key`` in holder ``slot`` (0: the only one of a key of one holder),
        or ``None`` if there is none; :meth:`holders` reads every holder of a key held by several at once.

        ``gaps`` (every read takes one): without it, a Cluster master that does not answer fails the read
        (:class:`LeaseUnavailableError`); with it, that master is recorded there and the read goes on.
        """
        return self._reader.inspect(key, slot=whole_count(slot, "slot", maximum=MAX_LIMIT - 1), gaps=gaps)

    def holders(self, key: str, *, gaps: ReadGaps | None = None) -> list[LeaseInfo]:
        """Every holder of ``key``, ordered by slot (empty if nobody holds it): one for a key of one holder, up to
        its limit for one held by several at once (``limit``). Two round trips: the fence counter, which says
        how many slots may be held (its ``width``), then those slots."""
        return self._reader.holders(key, gaps=gaps)

    def scan(self, match: str = "*", *, count: int = 500, gaps: ReadGaps | None = None) -> Iterator[LeaseInfo]:
        """Every lease whose key matches the glob ``match``, read in batches with ``SCAN`` (never ``KEYS``): each
        holder of a key held by several at once is one (its :attr:`LeaseInfo.slot` says which); with the
        default ``match``, also any other key under the prefix's lease keys (a hand-written orphan)."""
        return self._reader.scan(match, count=count, gaps=gaps)

    def inspect_line(self, key: str, *, gaps: ReadGaps | None = None) -> LineInfo:
        """The line of waiters of ``key`` (empty if there is none)."""
        return self._reader.inspect_line(key, gaps=gaps)

    def scan_lines(self, *, count: int = 500, gaps: ReadGaps | None = None) -> Iterator[LineInfo]:
        """Every line of waiters under this prefix, read in batches with ``SCAN``."""
        return self._reader.scan_lines(count=count, gaps=gaps)

    def fence_state(self, key: str, *, gaps: ReadGaps | None = None) -> dict[str, int]:
        """The fence counter of ``key``: last ``fence`` granted, last ``released``, last ``expired``; for a key
        held by several at once, also ``width`` and each slot's ``g:<slot>`` (last granted), ``r:<slot>``
        (released) and ``e:<slot>`` (found expired): see :attr:`LeaseInfo.per_slot`. Empty if there is none."""
        return self._reader.fence_state(key, gaps=gaps)

    def fence_states(self, keys: Sequence[str], *, gaps: ReadGaps | None = None) -> list[dict[str, int]]:
        """:meth:`fence_state` of many keys in one round trip per master, in order."""
        return self._reader.fence_states(keys, gaps=gaps)

    def release_if_dead(self, key: str, *, fence: int | None = None, by: str | None = None) -> DeadRelease:
        """Release a holder of ``key`` only if it cannot still be running under its lease.

        Decided inside one script from facts the holder wrote itself: its
        deadline and the margin its actor has to stop have passed
        (:attr:`LeaseInfo.ends_ms`; the key outlived them because its TTL was
        changed by hand); or the hash does not say and the key has no TTL
        (written by hand). A holder whose heartbeat is merely overdue keeps
        its lease: it may still be running, and the key expires by itself at
        that same instant.

        ``fence``: the holder to judge, by its grant's fence (a key held by
        several at once: ``lock_limit``); ``None``: the key's only holder. The
        holders are read first (:meth:`holders`), and the script ends only
        the grant of that fence: if it ended meanwhile and another grant took
        its slot, the answer is a refusal naming that grant's fence, nothing
        touched. No holder of that fence: ``released`` is ``None``.

        The release is recorded in the key's fence counter (so the exporter
        does not count it as an expiry), keeping the counter's TTL; a counter
        that a fleet's ``fence_retention`` expired during the leak is made
        again with this store's ``fence_retention``, or for an hour when
        this store has none (the CLI's, which cannot know the fleet's): never
        without a TTL. A counter of another type is left alone.

        ``by``: who asks (an operator, ``user@host``), named in the key's history: its ``force_released``
        event is appended if the store keeps a history, or the key has one (a CLI's store cannot know).

        Raises:
          LeaseStateError: no ``fence``, and the key has several holders (named with their fences): which to
            release is never guessed.
          LeaseConfigError: ``fence`` is not a whole number from 0 (a hash without one) to 2**53, or ``by``
            is not a string of at most 512 bytes (UTF-8).
          LeaseUnavailableError: Redis could not be asked.
        """
        who = _by(by)
        if fence is not None:
            fence = whole_count(fence, "fence", maximum=2**53, owner="release_if_dead")
        holder = target(validate_key(key), self.holders(key), fence)
        if holder is None:
            return DeadRelease(None, None, 0)

        def call(keys: list[str], args: list[Any]) -> Any:
            return self._call(self._release_if_dead, keys, args)

        return release_if_dead(
            call, self.prefix, self.fence_retention, key, holder, history=self.history_cap or -1, by=who
        )

    # History -------------------------------------------------------------------

    def history(self, key: str) -> list[HistoryEvent]:
        """The history of ``key``, oldest event first (empty if it has none: the store's ``history`` is off,
        or nothing happened to the key for a week). Readable whatever this store's own ``history`` setting.

        Raises:
          LeaseStateError: the history's Redis key is of another type (written by hand).
          LeaseUnavailableError: Redis could not be asked.
        """
        name = history_name(self.prefix, validate_key(key))
        with unavailable(f"read the history of {key!r}", key):
            try:
                entries = self.client.lrange(name, 0, -1)
            except redis.ResponseError as e:
                if "WRONGTYPE" not in str(e):
                    raise
                raise LeaseStateError(f"the history of {key!r} ({name}) is not a list: {e}", key=key) from None
        return parse(entries)

    def record_history(
        self,
        key: str,
        event: str,
        *,
        fence: int = 0,
        reason: str = "",
        meta: Mapping[str, str] | None = None,
        waited_ms: int = 0,
    ) -> None:
        """Append an event decided outside the scripts (``skipped``, ``failed``, ``gave_up``) to the history of
        ``key``, stamped with the server's time; nothing (no call) if this store keeps no history. ``meta``: the
        message's metadata (``message_id``, ``actor``, ``host``, ``pid``), named in the event; ``waited_ms``:
        how long it had waited for the key.

        Raises:
          LeaseConfigError: an unknown ``event``, a ``fence`` or ``waited_ms`` that is not a whole number, a
            ``reason`` over 512 bytes (UTF-8), or ``meta`` that is not strings.
          LeaseUnavailableError: Redis could not be asked.
        """
        if not self.history_cap:
            return
        validate_key(key)
        if event not in ("skipped", "failed", "gave_up"):
            raise LeaseConfigError(f"record_history: event must be 'skipped', 'failed' or 'gave_up', got {event!r}")
        fence = whole_count(fence, "fence", maximum=2**53, owner="record_history")
        if not isinstance(reason, str) or len(reason.encode()) > MAX_ID_LENGTH:  # the scripts count bytes
            raise LeaseConfigError(f"record_history: reason must be a string of at most {MAX_ID_LENGTH} bytes")
        waited_ms = whole_ms(waited_ms, "waited_ms", minimum=0, owner="record_history")
        packed = meta_args(key, dict(meta or {}))  # checked as a lease's metadata is
        args = [self.history_cap, event, fence, reason, packed[3] if len(packed) > 2 else "", waited_ms]
        with unavailable(f"record the history of {key!r}", key):
            self._call(self._history_script, [lease_name(self.prefix, key)], args)


def _by(by: str | None) -> str:
    """An operator's name for the history (``""``: none), checked before Redis is asked."""
    if by is None:
        return ""
    if not isinstance(by, str) or len(by.encode()) > MAX_ID_LENGTH:  # the scripts count bytes
        raise LeaseConfigError(f"by must be a string of at most {MAX_ID_LENGTH} bytes (UTF-8), got {by[:64]!r}")
    return by


def _ignore_lost(lease: Lease, reason: LostReason) -> None:
    """The default ``on_lost`` of :meth:`Leases.lease`: the block learns it from :meth:`Lease.remaining`."""
