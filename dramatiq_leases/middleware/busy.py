"""A message whose key is busy: back to the queue after a backoff, until its wait budget runs out."""

from __future__ import annotations

import logging
import time
from typing import Any

import dramatiq

from ..core.lease import Busy
from ..core.metrics import LeaseMetrics
from .backoff import backoff_delay
from .errors import LeaseWaitExceeded
from .options import ATTEMPTS_OPTION, FIRST_ATTEMPT_OPTION, Options

logger = logging.getLogger(__name__)

#: Set on a skipped delivery so Dramatiq's "was skipped" warning can be muted: a busy lease is routine.
SKIP_MARK = "lease_skipped"


class RoutineSkipFilter(logging.Filter):
    """Drops Dramatiq's WARNING for deliveries this middleware sent back on purpose (it logs its own)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and args and record.msg == "Message %s was skipped.":
            options = getattr(args[0], "options", None)
            return not (isinstance(options, dict) and options.get(SKIP_MARK))
        return True


def mark_skipped(message: Any) -> None:
    """This delivery is skipped, not finished: Results must not store ``None`` for it."""
    message.options["store_results"] = False
    message.options[SKIP_MARK] = True


def on_busy(broker: dramatiq.Broker, message: Any, opts: Options, busy: Busy, meta: dict[str, str],
            metrics: LeaseMetrics) -> None:
    """Send ``message`` back to wait for ``busy.key``, or give up on it past ``lock_max_wait``.

    Raises:
      LeaseWaitExceeded: given up with ``lock_give_up="fail"`` (the message is dead-lettered).
    """
    # The Redis server's clock, so workers with skewed clocks agree on how long a message waited.
    now_ms = busy.now_ms or int(time.time() * 1000)
    first = message.options.get(FIRST_ATTEMPT_OPTION) or now_ms
    waited = now_ms - first
    attempts = int(message.options.get(ATTEMPTS_OPTION, 0)) + 1
    if opts.max_wait is not None and waited >= opts.max_wait:
        metrics.gave_up(meta)
        logger.error(
            "Gave up on message %s of actor %r: lease %r stayed busy for %d attempts over %.1fs "
            "(lock_max_wait=%d ms); %s.",
            message.message_id, message.actor_name, busy.key, attempts, waited / 1000, opts.max_wait,
            "moving it to the dead-letter queue" if opts.give_up == "fail" else "dropping it",
        )
        if opts.give_up == "fail":
            message.fail()
            raise LeaseWaitExceeded(
                f"lease {busy.key!r} stayed busy for {attempts} attempts over {waited / 1000:.1f}s",
                key=busy.key, actor=message.actor_name,
            )
        mark_skipped(message)
        return
    metrics.busy_retry(meta)
    logger.debug("Lease %r is busy (%d ms left); message %s goes back to the queue (attempt %d).",
                 busy.key, busy.ttl_left, message.message_id, attempts)
    send_back(broker, message, opts, count_attempt=True, first_ms=first, now_ms=now_ms, holder_ttl=busy.ttl_left)


def send_back(
    broker: dramatiq.Broker,
    message: Any,
    opts: Options,
    *,
    count_attempt: bool,
    first_ms: int | None = None,
    now_ms: int = 0,
    holder_ttl: int = -1,
) -> None:
    """Re-enqueue the same message (same id) after a backoff with full jitter; fail it if that is impossible."""
    attempts = int(message.options.get(ATTEMPTS_OPTION, 0))
    delay = backoff_delay(attempts, opts.min_backoff, opts.max_backoff, holder_ttl)
    options: dict[str, Any] = {ATTEMPTS_OPTION: attempts + 1 if count_attempt else attempts}
    if first_ms is not None:
        options[FIRST_ATTEMPT_OPTION] = first_ms
        if opts.max_wait is not None:
            # Land the last retry at the end of the budget rather than past it.
            delay = max(1, min(delay, first_ms + opts.max_wait - now_ms))
    try:
        broker.enqueue(message.copy(options=options), delay=delay)
    except Exception:
        logger.exception("Could not send message %s back to the queue; failing it instead.", message.message_id)
        message.fail()
        return
    mark_skipped(message)
