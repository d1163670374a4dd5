"""One delivery's way to its lease: acquire (or adopt), wait in place, or send the message back and skip it.

Runs in a worker thread, inside ``LeaseMiddleware.before_process_message``, where Dramatiq may raise an
interruption between any two bytecodes: the run is registered before Redis is asked (the after-hooks then
release by its token), and a place to wait in place is given back however the attempt ends.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from typing import Any, NoReturn

import dramatiq

from ..core.errors import LeaseUnavailableError
from ..core.lease import Lease, new_token
from ..core.protocol import Turn, Wait
from ..core.scripts import MAX_LIMIT
from .busy import SKIP_MARK, gives_up, mark_skipped, on_busy, record_history, send_back, skip
from .context import Context
from .declarations import latest_handoff
from .errors import LeaseBusyFailed, LeaseLimitError, LeaseOptionError
from .guard import Run
from .options import (
    ATTEMPTS_OPTION,
    FIRST_ATTEMPT_OPTION,
    HELD_BACK_OPTION,
    LEASE_OPTION,
    SENT_BACK_OPTION,
    Options,
)
from .ordering import order_of
from .waiting import LINE_OPTION, MAX_IN_PLACE, waiter_id

logger = logging.getLogger(__name__)


class Acquisition:
    """The acquisition of one delivery's lease on ``key``; :meth:`acquire` returns the lease or skips the delivery.

    Every way out but a grant sends the message back (or fails it) and raises ``SkipMessage``, marked as
    this middleware's skip. TimeLimit counts the hook: a thread waits in place for a quarter of the
    message's time limit at most, then parks it; a send-back through a broker outage may take until half.
    """

    def __init__(
        self,
        ctx: Context,
        broker: dramatiq.Broker,
        message: Any,
        *,
        actor: Any,
        key: str,
        opts: Options,
        limit: int,
        hook_started: float,
    ) -> None:
        self.ctx = ctx
        self.broker = broker
        self.message = message
        self.key = key
        self.opts = opts
        self.limit = limit
        self.meta = {
            "actor": message.actor_name,
            "queue": message.queue_name,
            "message_id": message.message_id,
            "host": ctx.host,
            "pid": str(os.getpid()),
        }
        # Registered before Redis is asked: if anything interrupts us from here on, the
        # after-hooks release by this token (an owner-checked no-op if nothing was granted).
        self.run = Run(key, new_token(), threading.get_ident())
        self.run.message = message
        # A unique record's end, at the message's ack, looks at whether its lease is still held: released first.
        self.run.release_inline = opts.unique is not None
        ctx.runs.register(self.run)
        declarations = ctx.declarations
        self.max_hold = declarations.max_hold(opts, message, actor)
        self.waiter = waiter_id(message)
        self.first = int(message.options.get(FIRST_ATTEMPT_OPTION) or 0)
        if self.first:
            self.meta["first_attempt_ms"] = str(self.first)
        time_limit = declarations.time_limit(message, actor)
        self.budget = MAX_IN_PLACE if time_limit is None else min(MAX_IN_PLACE, time_limit / 4000)
        self.send_back_by = hook_started + (math.inf if time_limit is None else time_limit / 2000)
        self.in_place = 0.0
        self.front = False  # told it is among the next to run, with no place here: may take a front place
        self.started = hook_started  # the last acquire call's start
        self.order: int | None = None  # lock_on_busy="latest": when it was sent (see .ordering)

    def acquire(self) -> Lease:
        """Ask until granted, waiting in place while near the head of the line; else send back and skip."""
        waiting = self.ctx.waiting
        if self.opts.on_busy == "latest":
            try:
                self.order = order_of(self.message)
                if self.message.options.get(LEASE_OPTION) is not None:  # a producer without the middleware
                    raise LeaseOptionError(latest_handoff(self.message.actor_name), actor=self.message.actor_name)
            except LeaseOptionError as e:
                self.ctx.runs.not_granted()
                self.ctx.unique.release_handed(self.message, self.key)  # never adopted: not held until its TTL
                refuse(self.message, e)
        try:
            while True:
                may_wait = self.in_place < self.budget and waiting.reserve(self.key, self.waiter, front=self.front)
                self.started = time.monotonic()
                try:
                    result = self._ask(may_wait)
                except Exception as e:
                    self._unavailable(e)
                if isinstance(result, Lease):
                    return result
                self._busy(result)
        finally:
            waiting.forget_thread()  # its place to wait in place, however the attempt ends

    def _ask(self, may_wait: bool) -> Lease | Turn:
        """Adopt the lease handed over with the message, if it still holds; else join the key's line."""
        key, opts, options = self.key, self.opts, self.message.options
        handed = options.get(LEASE_OPTION)
        slot = handed.get("slot", 0) if isinstance(handed, dict) else 0
        if not (isinstance(slot, int) and not isinstance(slot, bool) and 0 <= slot < MAX_LIMIT):
            slot = -1  # not a slot: input from whoever wrote the message, never a key name
        if isinstance(handed, dict) and handed.get("key") == key and handed.get("token") and slot >= 0:
            adopted = self.ctx.leases.adopt(
                key,
                handed["token"],
                opts.ttl,
                interval=opts.renew_interval,
                max_hold=self.max_hold,
                meta=self.meta,
                new_token=self.run.token,
                slot=slot,
            )
            if isinstance(adopted, Lease):
                return adopted
            if isinstance(adopted, Turn) and adopted.wait is Wait.GRACE:
                return adopted  # sent back with its token, to adopt the lease once the grace is over
            # Ended, or held by another token (an earlier adopter: a token replaced never holds again). Its
            # copies must not carry it: the message waits in the key's line like any other.
            options.pop(LEASE_OPTION, None)
            logger.info(
                "Lease %r handed over with message %s has %s; acquiring anew.",
                key,
                self.meta["message_id"],
                "ended" if adopted is None else "been adopted or taken by another holder",
            )
        # A copy back from its hold (RateLimited) waits for the hold's end in the line, whatever lock_on_busy says.
        held = HELD_BACK_OPTION in options
        return self.ctx.leases.line.join(
            key,
            opts.ttl,
            interval=opts.renew_interval,
            max_hold=self.max_hold,
            meta=self.meta,
            token=self.run.token,
            waiter=self.waiter,
            first_ms=self.first,
            may_wait=may_wait,
            joins=held or opts.on_busy in ("wait", "latest"),
            limit=self.limit,
            latest=opts.on_busy == "latest",
            order=self.order,
            # A copy sent back (a Redis error, an interruption) may have a sibling in the broker: refused, it
            # is the message's outcome, and the sibling must not run after it.
            final=not held and opts.on_busy in ("skip", "fail") and bool(options.get(SENT_BACK_OPTION)),
            # Its queued unique record ends with the grant; an actor without lock_unique pays nothing for it.
            unique=opts.unique is not None,
            rates=opts.rates,
        )

    def _unavailable(self, error: Exception) -> NoReturn:
        """Redis could not be asked. Fail closed: no lease, no run; back later, with growing backoff."""
        ctx, message = self.ctx, self.message
        ctx.metrics.acquire(self.meta, "error", time.monotonic() - self.started)
        ctx.metrics.redis_error("acquire")
        # One WARNING per message, not per round: an outage would otherwise log one every backoff.
        repeated = bool(message.options.get(SENT_BACK_OPTION))
        logger.log(
            logging.DEBUG if repeated else logging.WARNING,
            "Could not acquire lease %r for message %s: %s. Retrying later%s.",
            self.key,
            message.message_id,
            error,
            " (again)" if repeated else ", with growing backoff",
        )
        ctx.waiting.forget_thread()
        send_back(self.broker, message, self.opts, self.send_back_by, count_attempt=True, remember=True)
        skip(message, f"lease {self.key!r} unavailable: {error}")

    def _busy(self, result: Turn) -> None:
        """The key is busy: wait in place (then ask again) if near the head, else go back to the broker."""
        ctx, message, opts = self.ctx, self.message, self.opts
        if result.wait is Wait.GRACE:  # not busy for skip or fail: the store cannot vouch for the key yet
            self._unavailable(
                LeaseUnavailableError(
                    f"the lease store restarted or failed over and may have forgotten grants: it grants none of "
                    f"this key for {result.ttl_left} ms more (restart_grace, failover_grace)",
                    key=self.key,
                )
            )
        ctx.metrics.acquire(self.meta, "busy", time.monotonic() - self.started)
        if result.wait is Wait.SUPERSEDED or (result.wait is Wait.NONE and opts.on_busy in ("skip", "fail")):
            self._not_run(result)
        if not self.first:
            self.first = result.now_ms
            self.meta["first_attempt_ms"] = str(self.first)  # stored with the lease it gets: how long it waited
            message.options[FIRST_ATTEMPT_OPTION] = self.first  # its place, if it is interrupted and sent back
        if (
            result.wait is Wait.SOON
            and result.place < self.limit
            and not self.front
            and self.in_place < self.budget
            and not ctx.waiting.stopping
        ):
            # Among the next to run but no place here: parked, it would leave a slot idle until its copy came
            # back (two enqueues). Asked again at once, it may take a place of the front.
            self.front = True
            return
        if result.wait is Wait.IN_PLACE and not gives_up(opts, self.first, result.now_ms) and not ctx.waiting.stopping:
            block_ms = min(result.block_ms, max(1, int((self.budget - self.in_place) * 1000)))
            if opts.max_wait is not None:  # wake up in time to give up
                block_ms = max(1, min(block_ms, self.first + opts.max_wait - result.now_ms))
            if opts.unique is not None:  # its unique record outlives the wait (a grant or a park is kept again)
                ctx.unique.waiting(message, self.key, opts.unique_ttl, block_ms)
            started = time.monotonic()
            try:
                ctx.waiting.wait_in_place(self.key, self.waiter, block_ms)
            except LeaseUnavailableError as e:
                # Ask once more, not waiting in place again: Redis away sends the message back with backoff,
                # as a failed acquire does. Raised from here, the error would fail the message: Dramatiq logs
                # it and calls the actor, whose guard fails it for want of a lease.
                ctx.metrics.redis_error("acquire")
                logger.warning(
                    "Could not wait in place for lease %r for message %s: %s.", self.key, message.message_id, e
                )
                self.in_place = self.budget
                return
            self.in_place += time.monotonic() - started
            return
        ctx.waiting.forget_thread()
        ctx.runs.not_granted()
        on_busy(
            self.broker,
            message,
            opts,
            result,
            meta=self.meta,
            metrics=ctx.metrics,
            waiting=ctx.waiting,
            first_ms=self.first,
            deadline=self.send_back_by,
        )
        skip(message, f"lease {self.key!r} is busy")

    def _not_run(self, result: Turn) -> NoReturn:
        """The key is full and this message's policy says it does not run: acknowledged (skip, superseded) or
        dead-lettered (fail), with an INFO line naming the key's holders and a count by reason."""
        ctx, message, opts = self.ctx, self.message, self.opts
        ctx.waiting.forget_thread()
        ctx.runs.not_granted()
        reason = "superseded" if result.wait is Wait.SUPERSEDED else "skipped" if opts.on_busy == "skip" else "failed"
        said = f"lock_on_busy={opts.on_busy!r}"
        if opts.rates and reason != "superseded":  # the rate may be why (full until it allows one more start)
            said += f"; lock_rate {', '.join(map(str, opts.rates))}: next start in {result.ttl_left} ms at the latest"
        not_run(ctx, message, self.key, reason, said, meta=self.meta, newer=result.newer)
        if reason != "superseded":  # a superseded waiter is recorded by the script that replaced it
            waited = max(0, result.now_ms - self.first) if self.first else 0
            why = f"lock_on_busy={opts.on_busy}"
            if opts.rates:  # full for its holders, or for its rate: the rate is named, as in the log line
                why += f"; lock_rate={','.join(map(str, opts.rates))}"
            record_history(ctx.waiting, self.key, reason, self.meta, reason=why, waited_ms=waited)
        if reason == "failed":
            message.fail()
            message.options[SKIP_MARK] = True
            raise LeaseBusyFailed(result, actor=message.actor_name, limit=self.limit)
        mark_skipped(message)
        skip(message, f"lease {self.key!r} is busy: not run ({reason})")

    def granted(self, lease: Lease) -> None:
        """Hand the granted ``lease`` to the run, count it, and clear the delivery's wait clock."""
        ctx, message, first = self.ctx, self.message, self.first
        if first or lease.from_line or message.options.get(SENT_BACK_OPTION):
            # It waited in the line (this delivery or another copy of it), or was sent back: remembered as
            # having run when released, so a copy of it parked or sent back twice never runs again.
            self.run.waiter = self.waiter
        ctx.runs.granted(self.run, lease)
        ctx.metrics.acquire(self.meta, "acquired", time.monotonic() - self.started)
        if lease.handoff is not None:
            ctx.metrics.handoff(self.meta, lease.handoff)
        # The wait clock belongs to this delivery: a retry of it (Retries) starts a new one.
        for name in (FIRST_ATTEMPT_OPTION, ATTEMPTS_OPTION, SENT_BACK_OPTION, LINE_OPTION, HELD_BACK_OPTION):
            message.options.pop(name, None)
        ctx.metrics.wait(self.meta, max(0.0, lease.acquired_at - first / 1000) if first else 0.0)
        logger.debug("Acquired lease %r (fence %d) for message %s.", self.key, lease.fence, message.message_id)


_NOT_RUN_WHY = {
    "skipped": "its key was full",
    "failed": "its key was full; moving it to the dead-letter queue",
    "superseded": "a newer message of its key took its place",
}


def not_run(
    ctx: Context, message: Any, key: str, reason: str, said: str, *, meta: dict[str, str], newer: str = ""
) -> None:
    """The trace of a message that does not run: an INFO line (actor, message, key, its holders, the reason and
    the option that said so; ``newer``: the newest message of the key, of a superseded one) and
    ``dramatiq_lease_not_run_total{reason}``."""
    ctx.metrics.not_run(meta, reason)
    why = _NOT_RUN_WHY[reason]
    if newer:
        why += f" (message {newer}, the newest of the key to reach the lease)"
    logger.info(
        "Message %s of actor %r did not run (%s): %s (%s); lease %r is held by %s.",
        message.message_id,
        message.actor_name,
        reason,
        why,
        said,
        key,
        holders_of(ctx, key),
    )


def holders_of(ctx: Context, key: str) -> str:
    """Who holds ``key`` now, for a log line: each holder's message id and actor (read once, best effort)."""
    try:
        infos = ctx.leases.holders(key)
    except Exception as e:
        return f"holders unknown ({type(e).__name__})"
    if not infos:
        return "nobody now"
    return ", ".join(
        f"message {info.meta.get('message_id', '?')} of actor {info.meta.get('actor', '?')!r} (fence {info.fence})"
        for info in infos
    )


def refuse(message: Any, error: Exception) -> NoReturn:
    """Fail a message whose lease options or key cannot work, to the dead-letter queue, and skip it.

    Reached when the producer could not refuse it at send time: it had no LeaseMiddleware, or its actor's
    ``lock_limit`` callable answered there but returns a bad value here. A callable that *raises* here is a
    passing failure, not a refusal: see :func:`limit_failed`.
    """
    logger.error("Message %s cannot run: %s. Moving it to the dead-letter queue.", message.message_id, error)
    message.fail()
    skip(message, str(error))


def limit_failed(ctx: Context, message: Any, key: str, error: LeaseLimitError) -> NoReturn:
    """The actor's ``lock_limit`` callable raised: the message fails as if its actor had raised, without its lease.

    ``error`` is raised on, out of ``before_process_message``: a ``MiddlewareError``, so Dramatiq neither
    swallows it nor calls the actor; it logs the failure and hands it to ``after_process_message``, where
    Retries sends a retry with its backoff, or past ``max_retries`` fails the message (dead-lettered). The
    message is not failed here: Retries does not look at ``message.failed``, and the delivery would be both
    dead-lettered and retried. Its unique record, if any, lives on through the retry (see :mod:`.unique`).
    """
    error.key = key
    meta = {"actor": message.actor_name, "queue": message.queue_name}
    ctx.metrics.not_run(meta, "limit_error")
    if message.failed:  # already failed by an earlier middleware: dead-lettered, so never retried
        refuse(message, error)
    cause = error.__cause__
    logger.warning(
        "Message %s of actor %r did not run (limit_error): lock_limit %r raised %s for key %r; it fails as if its "
        "actor had raised: Retries retries it, or dead-letters it past max_retries.",
        message.message_id,
        message.actor_name,
        error.limit,
        f"{type(cause).__name__}: {cause}" if cause is not None else error,
        key,
    )
    if FIRST_ATTEMPT_OPTION in message.options or LINE_OPTION in message.options:
        # It had a place in the key's line; the retry is a new waiter (a new retry count). Left now, or the
        # key's next grant could wait for it until its place lapses.
        try:
            ctx.leases.line.leave(key, [waiter_id(message)])
        except Exception as e:
            logger.warning("Could not take message %s out of the line of %r: %s", message.message_id, key, e)
    raise error
