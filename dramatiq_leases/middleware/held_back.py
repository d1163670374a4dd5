"""A delivery whose actor raised :class:`RateLimited`: its key held back, its message first in line after.

The release (:meth:`.runs.Runs.end`) has held the key back for ``retry_after`` and put the message's waiter at
the head of the key's line, in one script. Here the message goes back to the broker as a parked copy of that
waiter, due when the hold ends, and the delivery is skipped: acknowledged, neither failed nor retried (Retries
never sees the exception, so ``max_retries`` is not spent). The copy waits for the hold's end in the key's line
whatever its ``lock_on_busy`` says, and its wait budget starts then. A lease no longer held at the release (lost
meanwhile) holds nothing back; the message still comes back when the hold would have ended, as any message.
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
from .options import ATTEMPTS_OPTION, FIRST_ATTEMPT_OPTION, HELD_BACK_OPTION, SENT_BACK_OPTION
from .waiting import LINE_OPTION

logger = logging.getLogger(__name__)


def rate_limited(ctx: Context, broker: dramatiq.Broker, run: Run, error: RateLimited) -> NoReturn:
    """Send ``run``'s message back, due when its key's hold ends, and skip this delivery.

    An interruption (``TimeLimitExceeded``, ``Shutdown``) while the copy is sent may come after the broker
    took it: the copy is sent again. Two copies of one waiter never both run: the first to run is remembered
    by its waiter id (its copy is marked sent back), and the second is then a duplicate.
    """
    message, key, hold_ms = run.message, run.key, error.retry_after
    meta = {"actor": message.actor_name, "queue": message.queue_name}
    ctx.metrics.not_run(meta, "rate_limited")
    logger.info(
        "Message %s of actor %r was rate limited (RateLimited): %s; it runs again in %d ms, without spending a retry.",
        message.message_id,
        message.actor_name,
        f"lease {key!r} is held back until then, the message first in its line"
        if run.held
        else f"lease {key!r} was no longer held, so nothing is held back",
        hold_ms,
    )
    limit = ctx.declarations.time_limit(message, broker.get_actor(message.actor_name))
    deadline = time.monotonic() + (math.inf if limit is None else limit / 2000)
    try:
        _send_back(broker, message, key, hold_ms, run.held, deadline)
    except Interrupt:
        if not message.options.get(REQUEUED_MARK):
            _send_back(broker, message, key, hold_ms, run.held, deadline)
    why = f"rate limited: lease {key!r}, back in {hold_ms} ms"
    try:
        skip(message, why)
    except Interrupt:
        skip(message, why)


def _send_back(broker: dramatiq.Broker, message: Any, key: str, hold_ms: int, held: bool, deadline: float) -> None:
    """Park a copy of ``message`` that comes back when the hold ends (see busy.py); not held (the lease was lost
    first), a copy delayed as long, which asks for the key as any message."""
    now_ms = int(time.time() * 1000)
    options: dict[str, Any] = {SENT_BACK_OPTION: True}
    delay = hold_ms
    if held:
        # Its place is the head of the line, kept by the release; its wait budget (lock_max_wait) starts when the
        # hold ends, and it waits in the line whatever lock_on_busy says. A hold longer than a park comes back
        # and parks again until it ends.
        options.update(
            {
                ATTEMPTS_OPTION: 1,
                FIRST_ATTEMPT_OPTION: now_ms + hold_ms,
                LINE_OPTION: key,
                HELD_BACK_OPTION: now_ms + hold_ms,
            }
        )
        delay = min(hold_ms, DEFAULT_PARK_MS)
    send_copy_back(broker, message, message.copy(options=options), delay, deadline)
