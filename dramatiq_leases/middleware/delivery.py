"""A delivery's start (``before_process_message``): its key and options, then its lease, or it is skipped.

A message refused (bad options, an unrenderable key, a bad ``lock_limit``) is dead-lettered; one interrupted
(``Shutdown``, ``TimeLimitExceeded``) before its actor started goes back to the broker, keeping its place.
The hook itself catches the interruption: a call in between would be one more place for it to land.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, NoReturn

import dramatiq
from dramatiq.middleware import Interrupt

from ..core.errors import LeaseConfigError, LeaseKeyError
from .acquiring import Acquisition, limit_failed, refuse
from .busy import REQUEUED_MARK, send_back, skip
from .context import Context
from .errors import LeaseLimitError, LeaseOptionError
from .options import FIRST_ATTEMPT_OPTION

logger = logging.getLogger(__name__)


def interrupted(ctx: Context, broker: dramatiq.Broker, message: Any, error: Interrupt) -> NoReturn:
    """``Shutdown`` or ``TimeLimitExceeded`` before the actor started: the message goes back, keeping its place.

    Raised on, the interruption would reach Retries, which sends a retry with a new retry count: a new
    waiter that has lost its place, and beside a copy already sent back, a double run. A lease the
    interrupted call may have been granted is released by the after-hooks (by this delivery's token).
    """
    declarations = ctx.declarations
    if message.actor_name not in declarations.actors:
        raise error  # not a leased actor: Dramatiq's usual handling
    ctx.waiting.forget_thread()  # its place to wait in place, if it held one: given back at once
    if not (message.options.get(REQUEUED_MARK) or message.failed):  # else: settled before the interruption
        logger.info(
            "Message %s was interrupted (%s) before its actor started; sending it back.",
            message.message_id,
            type(error).__name__,
        )
        try:
            actor = broker.get_actor(message.actor_name)
            opts = declarations.message_options(message, actor)
            limit = declarations.time_limit(message, actor)
        except Exception as e:  # options the interruption came before checking: refused, as they would be
            refuse(message, e)
        first = int(message.options.get(FIRST_ATTEMPT_OPTION) or 0)
        send_back(
            broker,
            message,
            opts,
            time.monotonic() + (math.inf if limit is None else limit / 2000),
            count_attempt=True,
            first_ms=first or None,
            now_ms=int(time.time() * 1000),
            remember=True,
        )
    skip(message, f"interrupted ({type(error).__name__}) before the actor started")


def acquire_or_skip(ctx: Context, broker: dramatiq.Broker, message: Any) -> None:
    """Acquire (or adopt) the message's lease; else send it back, or refuse it, and skip it."""
    hook_started = time.monotonic()
    declarations = ctx.declarations
    ctx.unique.delivered(message)
    # Until a lease is registered below, the guarded actor refuses to run in this thread.
    ctx.runs.pending()
    ctx.waiting.forget_thread()
    try:
        template = declarations.template(message.actor_name, message.options)
    except LeaseOptionError as e:
        refuse(message, e)
    if template is None:
        ctx.runs.unleased()
        return
    actor = broker.get_actor(message.actor_name)
    try:
        opts = declarations.message_options(message, actor)
        key = template.render(tuple(message.args), message.kwargs)
    except (LeaseConfigError, LeaseKeyError) as e:
        refuse(message, e)
    try:
        limit = declarations.limit(opts, message)
    except LeaseLimitError as e:  # the callable raised: a passing failure, for Retries
        limit_failed(ctx, message, key, e)
    except LeaseOptionError as e:  # it returned a bad value: a bad setting, dead-lettered
        ctx.metrics.not_run({"actor": message.actor_name, "queue": message.queue_name}, "limit_error")
        refuse(message, e)
    if opts.debounce is not None:  # its burst's run, or sent back, or given way to a newer message (skipped)
        time_limit = declarations.time_limit(message, actor)
        deadline = hook_started + (math.inf if time_limit is None else time_limit / 2000)
        ctx.debouncing.delivered(broker, message, key, opts, deadline)
    attempt = Acquisition(ctx, broker, message, actor=actor, key=key, opts=opts, limit=limit, hook_started=hook_started)
    attempt.granted(attempt.acquire())
    if opts.unique is not None:
        ctx.unique.granted(broker, message, key, opts.unique, opts.unique_ttl)
