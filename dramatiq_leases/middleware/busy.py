"""A message whose key is busy and cannot wait in place: parked, sent back soon, dropped as a copy, or given up."""

from __future__ import annotations

import logging
import time
from typing import Any, NoReturn

import dramatiq
from dramatiq.middleware import Interrupt, SkipMessage

from ..core.errors import LeaseError
from ..core.metrics import LeaseMetrics
from ..core.protocol import Turn, Wait
from .backoff import backoff_delay
from .errors import LeaseWaitExceeded
from .options import ATTEMPTS_OPTION, FIRST_ATTEMPT_OPTION, SENT_BACK_OPTION, Options
from .outages import enqueue_through_outage
from .waiting import Waiting, waiter_id

logger = logging.getLogger(__name__)

#: Set on every delivery this middleware skips: Dramatiq's "was skipped" warning is muted (it logs its
#: own), and Dramatiq's Prometheus middleware is told whose skip it is (see :mod:`.dramatiq_metrics`).
SKIP_MARK = "lease_skipped"
#: Set too when the skipped message comes back (sent back or parked): it is not done yet.
REQUEUED_MARK = "lease_requeued"

#: How many interruptions a send-back absorbs (each costs one more enqueue). Dramatiq's sources raise once
#: per delivery each (TimeLimit, Shutdown); the bound keeps a misbehaving one from holding the thread.
MAX_INTERRUPTIONS = 4


class RoutineSkipFilter(logging.Filter):
    """Drops Dramatiq's WARNING for deliveries this middleware skipped on purpose (it logs its own)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and args and record.msg == "Message %s was skipped.":
            options = getattr(args[0], "options", None)
            return not (isinstance(options, dict) and options.get(SKIP_MARK))
        return True


def mark_skipped(message: Any, *, requeued: bool = False) -> None:
    """This delivery is skipped, not finished: Results must not store ``None`` for it.

    ``requeued``: a copy of the message was sent back or parked; it is counted when it runs.
    """
    message.options["store_results"] = False
    message.options[SKIP_MARK] = True
    if requeued:
        message.options[REQUEUED_MARK] = True


def skip(message: Any, reason: str) -> NoReturn:
    """Skip this delivery, marked as this middleware's skip."""
    message.options[SKIP_MARK] = True
    raise SkipMessage(reason) from None


def record_history(waiting: Waiting, key: str, event: str, meta: dict[str, str], **facts: Any) -> None:
    """Append ``event`` (decided here, not in a script) to ``key``'s history, if the store keeps one; a failure
    is logged, never raised: the message's outcome stands without it."""
    try:
        waiting.leases.record_history(key, event, meta=meta, **facts)
    except LeaseError as e:
        logger.warning("Could not record %r in the history of lease %r: %s", event, key, e)


def gives_up(opts: Options, first_ms: int, now_ms: int) -> bool:
    """Whether a message first tried at ``first_ms`` has spent its wait budget at ``now_ms`` (server ms)."""
    return opts.max_wait is not None and now_ms - first_ms >= opts.max_wait


def on_busy(
    broker: dramatiq.Broker,
    message: Any,
    opts: Options,
    busy: Turn,
    *,
    meta: dict[str, str],
    metrics: LeaseMetrics,
    waiting: Waiting,
    first_ms: int,
    deadline: float,
) -> None:
    """Park ``message`` (or send it back soon) to wait for ``busy.key``; give up on it past ``lock_max_wait``.

    ``deadline`` (``time.monotonic()``): how long a broker outage may be waited out to send it back.

    Raises:
      LeaseWaitExceeded: given up with ``lock_give_up="fail"`` (the message is dead-lettered).
    """
    if busy.wait is Wait.DUPLICATE:
        logger.info(
            "Message %s is a copy of one that already ran, or was refused by lock_on_busy, under lease %r; "
            "not running it.",
            message.message_id,
            busy.key,
        )
        metrics.not_run(meta, "duplicate")
        mark_skipped(message)
        return
    now_ms = busy.now_ms or int(time.time() * 1000)
    attempts = int(message.options.get(ATTEMPTS_OPTION, 0)) + 1
    if gives_up(opts, first_ms, now_ms):
        waited = now_ms - first_ms
        try:
            waiting.leases.line.leave(busy.key, [waiter_id(message)])
        except Exception as e:  # its place then lapses by its deadline
            logger.warning("Could not take message %s out of the line of %r: %s", message.message_id, busy.key, e)
        metrics.gave_up(meta)
        metrics.not_run(meta, "gave_up")
        record_history(waiting, busy.key, "gave_up", meta, reason=f"lock_max_wait={opts.max_wait}", waited_ms=waited)
        logger.error(
            "Gave up on message %s of actor %r: lease %r stayed busy for %d attempts over %.1fs "
            "(lock_max_wait=%d ms); %s.",
            message.message_id,
            message.actor_name,
            busy.key,
            attempts,
            waited / 1000,
            opts.max_wait,
            "moving it to the dead-letter queue" if opts.give_up == "fail" else "dropping it",
        )
        if opts.give_up == "fail":
            message.fail()
            message.options[SKIP_MARK] = True
            raise LeaseWaitExceeded(
                f"lease {busy.key!r} stayed busy for {attempts} attempts over {waited / 1000:.1f}s",
                key=busy.key,
                actor=message.actor_name,
            )
        mark_skipped(message)
        return
    metrics.busy_retry(meta)
    # Near the front with no thread to wait in place: parked, and called back at the next release. But not
    # from a worker shutting down: its copy comes back by itself soon, not through promotions to a process
    # that is stopping.
    if busy.wait in (Wait.NONE, Wait.COPY_HOLDS) or (busy.wait is Wait.SOON and waiting.stopping):
        logger.debug(
            "Lease %r is busy; message %s (place %d of %d) comes again soon.",
            busy.key,
            message.message_id,
            busy.place,
            busy.line,
        )
        send_back(
            broker,
            message,
            opts,
            deadline,
            count_attempt=True,
            first_ms=first_ms,
            now_ms=now_ms,
            holder_ttl=busy.ttl_left,
        )
        return
    logger.debug(
        "Lease %r is busy; message %s parks at place %d of %d.", busy.key, message.message_id, busy.place, busy.line
    )
    # Near the front of a key over its rate: back when the rate allows, since no release may call it forward.
    back_ms = busy.ttl_left if opts.rates and busy.wait is Wait.SOON else None
    copy, delay = waiting.parked_copy(message, busy.key, busy, first_ms, opts.max_wait, back_ms=back_ms)
    send_copy_back(broker, message, copy, delay, deadline)


def send_back(
    broker: dramatiq.Broker,
    message: Any,
    opts: Options,
    deadline: float,
    *,
    count_attempt: bool,
    first_ms: int | None = None,
    now_ms: int = 0,
    holder_ttl: int = -1,
    remember: bool = False,
) -> None:
    """Re-enqueue the same message (same id) after a backoff with full jitter, waiting out a broker outage.

    ``remember``: its run is remembered (:data:`SENT_BACK_OPTION`); a copy with ``first_ms`` always is.
    """
    attempts = int(message.options.get(ATTEMPTS_OPTION, 0))
    delay = backoff_delay(attempts, opts.min_backoff, opts.max_backoff, holder_ttl)
    options: dict[str, Any] = {ATTEMPTS_OPTION: attempts + 1 if count_attempt else attempts}
    if remember:
        options[SENT_BACK_OPTION] = True
    if first_ms is not None:
        options[FIRST_ATTEMPT_OPTION] = first_ms
        if opts.max_wait is not None:
            # Land the last retry at the end of the budget rather than past it.
            delay = max(1, min(delay, first_ms + opts.max_wait - now_ms))
    send_copy_back(broker, message, message.copy(options=options), delay, deadline)


def send_copy_back(broker: dramatiq.Broker, message: Any, copy: Any, delay: int, deadline: float) -> None:
    """Skip this delivery once ``copy`` is in the broker; fail it if the copy cannot get there (see :mod:`.outages`).

    An interruption (``Shutdown``, ``TimeLimitExceeded``) while the broker is asked does not end this: the
    enqueue it cut short may have been applied all the same, so the copy is sent again and the delivery is
    skipped. A second copy never runs (its run is remembered by its waiter id, see ``SENT_BACK_OPTION``);
    failing the delivery instead would dead-letter a message whose copy runs, and raising the interruption
    on would make Retries send a retry (a new waiter id) beside the copy: a double run.
    """
    sent = False
    for _ in range(MAX_INTERRUPTIONS + 1):
        try:
            sent = enqueue_through_outage(broker, copy, delay, deadline)
            break
        except Interrupt as e:
            logger.info(
                "Sending message %s back was interrupted (%s); sending it again.", message.message_id, type(e).__name__
            )
        except Exception:
            logger.exception("Could not send message %s back to the queue; failing it instead.", message.message_id)
            break
    if not sent:
        message.fail()  # not acknowledged as skipped: that would lose it
        return
    mark_skipped(message, requeued=True)
