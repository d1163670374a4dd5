"""Grants and releases: the scripts that give, take over, renew and end a lease, each one round trip.

:class:`Grants` is the write side of a :class:`~.store.Leases`, shared by the store and its line: it sends
a :class:`~.protocol.GrantRequest` or :class:`~.protocol.ReleaseRequest` through the store's
:class:`~.runner.ScriptRunner` and decodes the reply, with its span (:mod:`.tracing`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

from . import rounds, scripts, tracing
from .client import server_attributes, unavailable
from .errors import LeaseConfigError, LeaseUnavailableError
from .info import meta_args, text
from .keys import epoch_name, fence_name, history_name, lease_name, validate_key, wake_name
from .lease import Busy, Lease, Renewal, confirm, default_interval, margin_ms, new_token
from .numbers import check_numbers, whole_count
from .protocol import GrantRequest, Released, ReleaseRequest, Turn, Wait
from .replication import not_replicated
from .runner import ScriptRunner
from .scripts import MAX_LIMIT

logger = logging.getLogger(__name__)

_RENEW_CODES = {"1": Renewal.OK, "0": Renewal.GONE, "s": Renewal.STOLEN, "m": Renewal.MAX_HOLD}

# Span names and script names (db.stored_procedure.name) of the traced operations: see .tracing.
_ACQUIRE, _RENEW, _RELEASE = "lease.acquire", "lease.renew", "lease.release"
_ACQUIRE_SPAN, _RENEW_SPAN, _RELEASE_SPAN = f"EVALSHA {_ACQUIRE}", f"EVALSHA {_RENEW}", f"EVALSHA {_RELEASE}"
_RENEW_PIPELINE_SPAN = f"PIPELINE EVALSHA {_RENEW}"


#: The failover grace's default (ms): the middleware's default ``lock_ttl``. See :class:`~.store.Leases`.
DEFAULT_FAILOVER_GRACE = 30_000


class Grants:
    """The grants and releases of a store's keys under ``prefix`` (for the store and its line, not a user API).

    ``fence_retention`` and ``history`` are the store's (0: none); every call goes through ``runner``.
    """

    def __init__(
        self,
        runner: ScriptRunner,
        prefix: str,
        *,
        fence_retention: int,
        history: int,
        restart_grace: int = 0,
        failover_grace: int = 0,
    ) -> None:
        self.runner = runner
        self.prefix = prefix
        self.fence_retention = fence_retention
        self.history = history
        self.restart_grace = restart_grace
        self.failover_grace = failover_grace
        self._acquire = runner.register(scripts.ACQUIRE)
        self._acquire_latest = runner.register(scripts.ACQUIRE_LATEST)
        self._acquire_plain = runner.register(scripts.ACQUIRE_PLAIN)
        self._release_plain = runner.register(scripts.RELEASE_PLAIN)
        #: Whether a request without options asks the plain scripts first: not with a history, nor with
        #: ``min_replicas`` (a plain try answered NOT_PLAIN would wait for replicas for nothing); off in the
        #: tests that hold the general scripts to the same promises.
        self.plain = not history and not runner.min_replicas
        self._renew_many = runner.register(scripts.RENEW_MANY)
        self._release = runner.register(scripts.RELEASE)
        self._adopt = runner.register(scripts.ADOPT)
        self._wake = runner.register(scripts.WAKE)
        self._names: dict[str, list[str]] = {}
        # The span attributes every call of an operation shares, built once: spans are per message.
        server: dict[str, str | int] = {tracing.DB_SYSTEM: "redis", **server_attributes(runner.client)}
        self._span_attrs: dict[str, dict[str, str | int]] = {
            name: {**server, tracing.DB_OPERATION: "EVALSHA", tracing.DB_PROCEDURE: name}
            for name in (_ACQUIRE, _RENEW, _RELEASE)
        }
        self._pipeline_attrs: dict[str, str | int] = {
            **server,
            tracing.DB_OPERATION: "PIPELINE EVALSHA",
            tracing.DB_PROCEDURE: _RENEW,
        }

    def grant(self, request: GrantRequest) -> Lease | Turn:
        """Ask for the grant ``request`` describes: the :class:`Lease`, or the busy answer with the line's part.

        Raises:
          LeaseUnavailableError: as :meth:`~.store.Leases.try_acquire`.
        """
        key, ttl = request.key, request.ttl
        attributes: dict[str, str | int] = {**self._span_attrs[_ACQUIRE], tracing.TTL: ttl}
        if tracing.keys_recorded():
            attributes[tracing.KEY] = key
        with tracing.span(_ACQUIRE_SPAN, attributes) as span:
            sent_at = time.monotonic()
            with unavailable(f"acquire lease {key!r}", key):
                reply: Any = scripts.NOT_PLAIN
                if self.plain and request.plain:
                    keys, args = request.encode_plain(
                        self.prefix, self.fence_retention, grace=self.restart_grace, failover=self.failover_grace
                    )
                    reply, acked = self.runner.call_acked(self._acquire_plain, keys, args)
                if reply == scripts.NOT_PLAIN:  # busy, lined or wide: the general script decides
                    script = self._acquire_latest if request.latest else self._acquire
                    reply, acked = self.runner.call_slots(
                        key,
                        script,
                        lambda width: request.encode(
                            self.prefix,
                            self.fence_retention,
                            self.history,
                            grace=self.restart_grace,
                            failover=self.failover_grace,
                            width=width,
                        ),
                        acked=True,
                    )
            if int(reply[0]) != scripts.GRANTED:
                span.set_attributes({tracing.OUTCOME: "busy", tracing.FENCE: int(reply[2])})
                if len(reply) > 9:
                    self.wake(key, reply[9])
                return Turn.decode(key, reply)
            if len(reply) > 7:
                self.wake(key, reply[7])
            if acked < self.runner.min_replicas:
                self._not_replicated("acquire", key, request.token, acked)
            span.set_attributes({tracing.OUTCOME: "acquired", tracing.FENCE: int(reply[1])})
        # {GRANTED, fence, now[, expired[, released_ms, from_line, slot[, woken]]]}: the plain path leaves out its
        # zeros.
        granted = [int(x) for x in reply[:7]] + [0] * (7 - len(reply[:7]))
        lease = Lease(
            key=key,
            token=request.token,
            fence=granted[1],
            ttl=ttl,
            interval=request.interval or default_interval(ttl),
            max_hold=request.max_hold or None,
            acquired_at=granted[2] / 1000,
            meta=dict(request.meta),
            sent_at=sent_at,
        )
        if granted[4]:
            lease.handoff = max(0, granted[2] - granted[4]) / 1000
        lease.from_line = granted[5] == 1
        lease.slot = granted[6]
        return lease

    def wake(self, key: str, waiters: Sequence[Any]) -> None:
        """Wake ``waiters`` of ``key`` waiting in place, as a script's answer named them (``lua/wake.lua``).

        Best effort, after the script's own writes: a waiter not woken (Redis unreachable, this process gone
        in between) asks again when its block ends, which is when the holder's TTL would have ended.
        """
        if not waiters:
            return
        names = [wake_name(self.prefix, key, text(w)) for w in waiters]
        try:
            self.runner.call(self._wake, names, [])
        except Exception as exc:  # best effort: a Cluster's routing errors are not RedisError, and none may fail
            logger.debug(
                "Could not wake %d waiter(s) of %r (they ask again after their block): %s", len(names), key, exc
            )

    def _keys(self, key: str, slot: int = 0) -> list[str]:
        """The Redis keys of a lease's renewals: lease (its holder ``slot``'s), fence (the last 1 024 keys
        cached)."""
        if slot:
            return [lease_name(self.prefix, key, slot), self._keys(key)[1]]
        names = self._names.get(key)
        if names is None:
            names = [lease_name(self.prefix, key), fence_name(self.prefix, key)]
            if len(self._names) >= 1024:
                self._names.clear()  # per-invoice keys must not grow it without bound
            self._names[key] = names
        return names

    def _renew_names(self, lease: Lease) -> tuple[str, str, str]:
        """A lease's keys in a renewal: its holder slot's, its fence counter, its history (``""``: none kept)."""
        lease_key, fence = self._keys(lease.key, lease.slot)
        return lease_key, fence, history_name(self.prefix, lease.key) if self.history else ""

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
        """:meth:`~.store.Leases.adopt`."""
        validate_key(key)
        ttl, stored_interval, max_hold_ms = check_numbers(ttl, interval, max_hold)
        if not isinstance(token, str) or not token:
            raise LeaseConfigError(f"the handed-over token must be a non-empty string, got {token!r}")
        slot = whole_count(slot, "slot", maximum=MAX_LIMIT - 1)
        mine = new_token or _new_token()
        meta = dict(meta or {})
        interval_ms = stored_interval or default_interval(ttl)
        margin = margin_ms(ttl)
        args: list[Any] = [
            *(token, mine, ttl, interval_ms, margin, max_hold_ms, self.failover_grace),
            *meta_args(key, meta),
        ]
        if self.history:
            args.append(self.history)  # an odd last argument: the history cap
        sent_at = time.monotonic()
        with unavailable(f"adopt lease {key!r}", key):
            keys = [lease_name(self.prefix, key, slot), epoch_name(self.prefix, key), history_name(self.prefix, key)]
            reply, acked = self.runner.call_acked(self._adopt, keys, args)
        code = int(reply[0])
        if code == 0:
            return None
        if code == -2:  # the failover grace: not another holder's; ask again once it ends
            return Turn(key=key, ttl_left=int(reply[1]), fence=int(reply[2]), now_ms=int(reply[3]), wait=Wait.GRACE)
        if code < 0:
            return Busy(key=key, ttl_left=int(reply[1]), fence=int(reply[2]), now_ms=int(reply[3]))
        if acked < self.runner.min_replicas:
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

    def _not_replicated(self, what: str, key: str, token: str, acked: int) -> NoReturn:
        """A grant too few replicas acknowledged: a failover may lose it, so it is not trusted. Release it
        (owner-checked) and fail as if Redis had not answered."""
        try:
            released: bool | None = self.release(ReleaseRequest(key, token, slot=None)) is Released.NOW
        except LeaseUnavailableError:
            released = None
        runner = self.runner
        raise not_replicated(
            what, key, acked=acked, wanted=runner.min_replicas, timeout_ms=runner.replica_timeout, released=released
        )

    def renew_many(self, leases: Sequence[Lease], *, links: Sequence[object] = ()) -> list[Renewal]:
        """:meth:`~.store.Leases.renew_many`."""
        if not leases:
            return []
        runner = self.runner
        batches, calls = rounds.plan(
            leases,
            self._renew_names,
            cluster=runner.cluster,
            history=self.history,
        )
        # Several script calls on one connection are a pipeline: a batch in the conventions' terms.
        attributes: dict[str, str | int]
        if not runner.cluster and len(batches) > 1:
            name = _RENEW_PIPELINE_SPAN
            attributes = {**self._pipeline_attrs, tracing.DB_BATCH_SIZE: len(batches), tracing.COUNT: len(leases)}
        else:
            name, attributes = _RENEW_SPAN, {**self._span_attrs[_RENEW], tracing.COUNT: len(leases)}
        with tracing.span(name, attributes, links) as span:
            sent_at = time.monotonic()
            with unavailable(f"renew {len(leases)} lease(s)"):
                replies, acked = runner.run_round(self._renew_many, calls)
            unconfirmed = acked < runner.min_replicas  # a failover could undo these renewals
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
                            confirm(leases[i], sent_at)
            lost = len(leases) - out.count(Renewal.OK)
            span.set_attributes({tracing.OUTCOME: "ok" if not lost else "lost", tracing.LOST_COUNT: lost})
        return out

    def release(self, request: ReleaseRequest) -> Released:
        """Ask for the release ``request`` describes.

        Raises:
          LeaseUnavailableError: Redis could not be asked; the lease expires by its TTL.
        """
        key, fence = validate_key(request.key), request.fence
        attributes: dict[str, str | int] = dict(self._span_attrs[_RELEASE])
        if tracing.keys_recorded():
            attributes[tracing.KEY] = key
        if fence is not None:
            attributes[tracing.FENCE] = fence
        with tracing.span(_RELEASE_SPAN, attributes) as span:
            with unavailable(f"release lease {key!r}", key):
                reply: Any = scripts.NOT_PLAIN
                if self.plain and request.plain:
                    keys, args = request.encode_plain(self.prefix, self.fence_retention)
                    reply = self.runner.call(self._release_plain, keys, args)
                if reply == scripts.NOT_PLAIN:  # a line to hand on to, or one of several holders
                    reply, _ = self.runner.call_slots(
                        key,
                        self._release,
                        lambda width: request.encode(self.prefix, self.fence_retention, self.history, width=width),
                    )
                woken: list[Any] = []
                if isinstance(reply, list):  # {RELEASED, woken...}
                    reply, woken = reply[0], reply[1:]
                code = Released(int(reply))
            self.wake(key, woken)
            span.set_attribute(tracing.OUTCOME, "released" if code is Released.NOW else "not_held")
        return code


_new_token = new_token  # for adopt, whose parameter is named new_token
