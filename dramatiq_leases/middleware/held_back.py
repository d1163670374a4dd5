"""A delivery whose actor raised :class:`RateLimited`: its key held back, its message first in line after.

The release (:meth:`.runs.Runs.end`) has held the key back for ``retry_after`` and put the message's waiter at
the head of the key's line, in one script. Here the message goes back to the broker as a parked copy of that
waiter, due when the hold ends, and the delivery is skipped: acknowledged, neither failed nor retried (Retries
never sees the exception, so ``max_retries`` is not spent). A lease no longer held at the release (lost
meanwhile) holds nothing back; the copy still comes back when the hold would have ended.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, NoReturn

import dramatiq
from dramatiq.middleware import Interrupt

from ..core.line import DEFAULT_PARK_MS
from .busy import REQUEUED_MARK, send_copy_back, skip
from .context import Context
from .errors import RateLimited
from .guard import Run
from .options import ATTEMPTS_OPTION, FIRST_ATTEMPT_OPTION
from .waiting import LINE_OPTION

logger = logging.getLogger(__name__)


def rate_limited(ctx: Context, broker: dramatiq.Broker, run: Run, error: RateLimited) -> NoReturn:
    """Send ``run``'s message back, due when its key's hold ends, and skip this delivery.

    An interruption (``TimeLimitExceeded``, ``Shutdown``) while the copy is sent may come after the broker
    took it: the copy is sent again. Two copies of one waiter never both run: the first to run is remembered
    by its waiter id (its copy carries a first attempt), and the second is then a duplicate.
    """
    message = run.message
    try:
        _send_back(ctx, broker, message, run.key, error.retry_after)
    except Interrupt:
        if not message.options.get(REQUEUED_MARK):
            _send_back(ctx, broker, message, run.key, error.retry_after)
    why = f"rate limited: lease {run.key!r} is held back for {error.retry_after} ms"
    try:
        skip(message, why)
    except Interrupt:
        skip(message, why)


def _send_back(ctx: Context, broker: dramatiq.Broker, message: Any, key: str, hold_ms: int) -> None:
    """Count and log the hold, then park a copy of ``message`` that comes back when it ends (see busy.py)."""
    meta = {"actor": message.actor_name, "queue": message.queue_name}
    ctx.metrics.not_run(meta, "rate_limited")
    logger.info(
        "Message %s of actor %r was rate limited (RateLimited): lease %r is held back for %d ms, and the message "
        "runs again first, without spending a retry.",
        message.message_id,
        message.actor_name,
        key,
        hold_ms,
    )
    limit = ctx.declarations.time_limit(message, broker.get_actor(message.actor_name))
    deadline = time.monotonic() + (math.inf if limit is None else limit / 2000)
    # Its wait budget (lock_max_wait) starts again; its place is the head of the line, kept by the release.
    options = {ATTEMPTS_OPTION: 1, FIRST_ATTEMPT_OPTION: int(time.time() * 1000), LINE_OPTION: key}
    # A hold longer than a park comes back and parks again, until the hold ends (the line's front).
    delay = min(hold_ms, DEFAULT_PARK_MS)
    send_copy_back(broker, message, message.copy(options=options), delay, deadline)
