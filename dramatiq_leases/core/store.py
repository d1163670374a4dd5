"""Leases on keys in one Redis deployment: acquire, renew, release, adopt and inspect.

Every operation is one script and one round trip (see :mod:`.scripts`);
numbers are checked before Redis is asked. This module knows nothing of Dramatiq.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence

from .client import DEFAULT_SOCKET_TIMEOUT, RedisClient, client_from_url
from .errors import LeaseBusyError, LeaseConfigError, LeaseExpiredError, LeaseUnavailableError
from .grants import DEFAULT_FAILOVER_GRACE, Grants
from .history import Histories, History
from .keys import DEFAULT_PREFIX, fence_name, lease_name, validate_prefix
from .lease import Busy, Lease, LostReason, Renewal, Tracker, new_token
from .line import Line
from .numbers import check_numbers, whole_count, whole_ms
from .protocol import GrantRequest, Released, ReleaseRequest, Turn, hold_ms, operator_name
from .rates import parse_rates
from .reading import Reader, Reads
from .recovery import DeadRelease, Recovery
from .replication import DEFAULT_REPLICA_TIMEOUT_MS
from .runner import ScriptRunner
from .scripts import MAX_HISTORY


class Leases(Reads, Histories):
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
      restart_grace: for a store without persistence (whole ms; ``None`` or
        0, the default: none). A Redis restart without persistence forgets
        every grant while its holders run on until their next renewal; with
        ``restart_grace`` set to the longest TTL in use, a key the store
        knows nothing of (no fence counter) is not granted until the server
        has been up that long: its grant answers busy for the rest of the
        grace, so a holder the store forgot stops at its deadline before
        anyone else starts. The price: after every start of the server, new
        keys wait up to the grace; and the first grant of each new key asks
        the server's ``INFO``. Every process granting the store's keys (the
        workers, the web app, a ``Leader``) needs the setting.
      failover_grace: whole ms, default 30 000 (``None`` or 0: none). When the
        server's replication id changes under records it kept (a replica
        promoted by a failover, a restart from a snapshot or an append-only
        file), the store may have lost grants and renewals whose holders run
        on: no key of a Cluster slot is granted (nor a handed-over lease
        adopted) until this long after the first grant asked of that slot
        since the change. Set it to the longest TTL in use, in every process
        that grants the store's keys. The price: one ``INFO`` per grant (a
        user whose ACL denies it gets no grace), and keys that wait up to the
        grace after a failover (see docs/guarantees.md).

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
        restart_grace: int | None = None,
        failover_grace: int | None = DEFAULT_FAILOVER_GRACE,
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
        self._runner = ScriptRunner(
            client, thread_connections=thread_connections, min_replicas=min_replicas, replica_timeout=replica_timeout
        )
        self.min_replicas = self._runner.min_replicas
        self.replica_timeout = self._runner.replica_timeout
        # Parts, each with one idea, sharing the one call path (the runner); reads go through the reader's
        # pipelines, master by master.
        #: The restart grace in ms (0: none).
        self.restart_grace = (
            0 if restart_grace is None else whole_ms(restart_grace, "restart_grace", minimum=0, owner="Leases")
        )
        #: The failover grace in ms (0: none).
        self.failover_grace = (
            0 if failover_grace is None else whole_ms(failover_grace, "failover_grace", minimum=0, owner="Leases")
        )
        self._grants = Grants(
            self._runner,
            self.prefix,
            fence_retention=self.fence_retention,
            history=self.history_cap,
            restart_grace=self.restart_grace,
            failover_grace=self.failover_grace,
        )
        reader = Reader(client, self.prefix)
        Reads.__init__(self, reader)
        Histories.__init__(self, History(self._runner, self.prefix, self.history_cap))
        self._line = Line(self._runner, self._grants)
        self._recovery = Recovery(
            self._runner, reader, self.prefix, fence_retention=self.fence_retention, history=self.history_cap
        )

    @property
    def runner(self) -> ScriptRunner:
        """How this store sends its scripts (the parts' one call path): for the package's integrations, not a
        user API."""
        return self._runner

    @property
    def grants(self) -> Grants:
        """This store's grants and releases (the scripts' write side): for the package's integrations and tests,
        not a user API."""
        return self._grants

    @property
    def line(self) -> Line:
        """The lines of waiters of this store's keys: for the package's integrations (the middleware, the web
        helpers), not a user API."""
        return self._line

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
        restart_grace: int | None = None,
        failover_grace: int | None = DEFAULT_FAILOVER_GRACE,
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
            restart_grace=restart_grace,
            failover_grace=failover_grace,
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
        rate: str | Sequence[str] | None = None,
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
          rate: at most N grants of ``key`` in any window of a given length: ``"10/s"``, ``"5/10s"``,
            ``"5000/d"``, or a list of such that all hold (see :mod:`~.rates`). A grant the rate does not allow
            yet is :class:`Busy`, its ``ttl_left`` the time until it does.

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
        ttl, interval, max_hold = check_numbers(ttl, interval, max_hold)
        rates = parse_rates(rate)
        got = self._grants.grant(
            GrantRequest(
                key,
                token or new_token(),
                ttl,
                interval=interval,
                max_hold=max_hold,
                meta=meta or {},
                limit=limit,
                rates=rates,
            )
        )
        return got.busy() if isinstance(got, Turn) else got

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
          another token holds ``key`` now, including an earlier adopter, or
          within the store's failover grace (then ``fence`` is the handed
          lease's own and ``ttl_left`` the grace left: ask again after it);
          ``None`` if the lease is gone (expired or released) or its maximum
          hold leaves less than the safety margin.

        Raises:
          LeaseConfigError: as :meth:`try_acquire`.
          LeaseUnavailableError: Redis could not be asked; or, with
            ``min_replicas``, the adoption was acknowledged by too few replicas
            in time: the adopted lease is then released (owner-checked).
        """
        return self._grants.adopt(
            key, token, ttl, interval=interval, max_hold=max_hold, meta=meta, new_token=new_token, slot=slot
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
        return self._grants.renew_many(leases, links=links)

    def release(self, lease: Lease, *, hold: int | None = None) -> bool:
        """Release ``lease`` if its token still holds it; ``False`` if it did not (nothing touched).

        ``hold``: hold the key back that long (ms, up to a day) once released: nobody is granted any slot of
        it before (a downstream answered 429 with ``Retry-After``; the middleware's :class:`RateLimited`).
        Its line keeps its order and is called forward once the hold ends.

        Raises:
          LeaseConfigError: ``hold`` is not a whole number of ms from 1 to 86 400 000.
          LeaseUnavailableError: Redis could not be asked; the lease expires by its TTL.
        """
        return self.release_token(lease.key, lease.token, fence=lease.fence, slot=lease.slot, hold=hold)

    def release_token(
        self,
        key: str,
        token: str,
        *,
        fence: int | None = None,
        slot: int | None = None,
        by: str | None = None,
        hold: int | None = None,
    ) -> bool:
        """Release the lease on ``key`` only if ``token`` holds it; ``False`` if it did not (nothing touched).

        For a holder that kept the token, not the :class:`Lease` (a web request that handed its lease on,
        an operator). ``slot`` is the grant's :attr:`Lease.slot` (``None``: the token is looked for in every
        slot of the key). The front of the key's line, if any, is woken. ``by``: who releases it in its
        holder's stead (an operator, ``user@host``): the key's history records a ``force_released`` by them,
        also from a store without ``history`` if the key has a history. ``hold``: as :meth:`release`'s (not
        with ``by``: only the holder may hold its key back).

        Raises:
          LeaseConfigError: ``by`` is not a string of at most 512 bytes (UTF-8), or ``hold`` is not a whole
            number of ms from 1 to 86 400 000, or both are given.
          LeaseUnavailableError: Redis could not be asked; the lease expires by its TTL.
        """
        request = ReleaseRequest(key, token, fence=fence, slot=slot, by=operator_name(by), hold_ms=hold_ms(hold))
        if request.hold_ms and request.by:
            raise LeaseConfigError("release_token: only the holder may hold its key back (hold), not an operator (by)")
        return self._grants.release(request) is Released.NOW

    # A with form ---------------------------------------------------------------

    @contextlib.contextmanager
    def lease(
        self,
        key: str,
        ttl: int,
        *,
        heartbeat: Tracker | None = None,
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
                    request = ReleaseRequest(key, token, fence=got.fence if got else None, slot=slot)
                    released = self._grants.release(request) is not Released.NOT_HELD
        if isinstance(got, Lease) and released is False:  # released: still ours, so nobody held it between
            raise LeaseExpiredError(
                f"lease {key!r} (fence {got.fence}) ended before its with block did: its work may have "
                "overlapped another holder's",
                lease=got,
            )

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
        return self._recovery.release_if_dead(key, fence=fence, by=by)


def _ignore_lost(lease: Lease, reason: LostReason) -> None:
    """The default ``on_lost`` of :meth:`Leases.lease`: the block learns it from :meth:`Lease.remaining`."""
