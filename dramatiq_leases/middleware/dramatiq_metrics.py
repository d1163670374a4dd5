"""Dramatiq's own ``Prometheus`` middleware, kept from counting this middleware's busy rounds.

A message whose lease is busy is skipped and comes back later: sent back after a backoff, or parked in
the key's line (both are delayed copies with the same message id). Left alone, Dramatiq's
``Prometheus`` (2.x) would count each such round:

* ``after_skip_message = after_process_message``: every busy skip is a processed message
  (``dramatiq_messages_total``) and a near-zero sample of ``dramatiq_message_duration_milliseconds``;
  and when ``Prometheus`` comes after this middleware, whose ``SkipMessage`` stops the
  ``before_process_message`` chain, it decrements ``dramatiq_messages_inprogress`` for a delivery it
  never incremented it for: the gauge sinks below zero.
* ``dramatiq_delayed_messages_inprogress`` goes up (label ``queue.DQ``) in the process whose delay
  queue takes a copy, and down (label ``queue``) only if the same process later runs it: with
  several processes, or a parked copy dropped, it drifts.
* ``after_enqueue`` counts a retry (``dramatiq_message_retries_total``) for every enqueue of a
  message carrying ``retries``: each send-back of a once-retried message, and its move out of the
  delay queue, would count as two more retries.

:class:`DramatiqPrometheus` replaces, on each ``Prometheus`` instance of the broker only, the hooks
involved (instance attributes, so other middleware and other brokers are untouched), for this
middleware's own skips and copies only; everything else goes to Dramatiq's own methods. A skip that
ends the message (given up, a copy of one that already ran, refused) still counts as processed, as
Dramatiq counts every skip; only a skip whose message comes back does not: it is counted when it
runs. Tested with Dramatiq 2.2 (``dramatiq<3``): it reads the middleware's attributes
``message_start_times``, ``delayed_messages``, ``inprogress_messages``,
``inprogress_delayed_messages``, ``total_messages`` and ``message_durations``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import dramatiq
from dramatiq.common import dq_name, q_name
from dramatiq.middleware import Middleware

from .busy import REQUEUED_MARK, SKIP_MARK
from .options import ATTEMPTS_OPTION

logger = logging.getLogger(__name__)

#: The attributes of Dramatiq's ``Prometheus`` read or adjusted here (Dramatiq 2.x).
_READS = (
    "message_start_times",
    "delayed_messages",
    "inprogress_messages",
    "inprogress_delayed_messages",
    "total_messages",
    "message_durations",
)
#: Set on an adjusted ``Prometheus`` instance, so that a second boot does not wrap its hooks twice.
ADJUSTED = "_dramatiq_leases_adjusted"


def is_our_copy(message: Any) -> bool:
    """Whether ``message`` is a copy this middleware sent back or parked (or that copy leaving the delay queue)."""
    return ATTEMPTS_OPTION in message.options


class DramatiqPrometheus:
    """The Dramatiq ``Prometheus`` middlewares of one broker, adjusted for a :class:`LeaseMiddleware`.

    Parameters:
      lease_middleware: the middleware whose skips and copies are discounted.
    """

    def __init__(self, lease_middleware: Middleware) -> None:
        self.lease_middleware = lease_middleware
        self.instances: list[Any] = []

    def adjust(self, broker: dramatiq.Broker) -> None:
        """Adjust every Dramatiq ``Prometheus`` in ``broker``'s middleware (call at process boot; idempotent)."""
        from dramatiq.middleware.prometheus import Prometheus

        stack = list(broker.middleware)
        ours = next((i for i, m in enumerate(stack) if m is self.lease_middleware), None)
        for position, middleware in enumerate(stack):
            if not isinstance(middleware, Prometheus) or any(m is middleware for m in self.instances):
                continue
            prom: Any = middleware
            missing = [name for name in _READS if not hasattr(prom, name)]
            if missing:
                # Another Dramatiq version: leave its accounting alone rather than guess.
                logger.warning(
                    "Dramatiq's Prometheus middleware has no %s: its metrics will count busy rounds "
                    "of leased actors as processed messages.",
                    ", ".join(missing),
                )
                continue
            self.instances.append(prom)
            if getattr(prom, ADJUSTED, False):
                continue  # another LeaseMiddleware of this broker did it
            # Our SkipMessage stops the before-hooks: Prometheus's ran for a skipped delivery only if it comes first.
            counted_in = ours is not None and position < ours
            prom.after_skip_message = _after_skip(prom.after_skip_message, prom, counted_in)
            prom.after_enqueue = _after_enqueue(prom.after_enqueue)
            setattr(prom, ADJUSTED, True)
            logger.debug(
                "Dramatiq's Prometheus middleware adjusted for lease requeues (it comes %s LeaseMiddleware).",
                "before" if counted_in else "after",
            )

    def left_delay_queue(self, message: Any) -> None:
        """A delayed copy of ours left this process's delay queue (sent on to its queue, or dropped).

        Dramatiq would take it off ``dramatiq_delayed_messages_inprogress`` only if this process runs
        it (another one may); it is taken off here, with the label it was counted under, before it
        can be run anywhere: Prometheus's ``before_process_message`` then finds nothing to take off.
        Called on consumer and line threads, which no asynchronous exception targets.
        """
        if not self.instances or not is_our_copy(message):
            return
        labels = (dq_name(q_name(message.queue_name)), message.actor_name)
        for prom in self.instances:
            try:
                prom.delayed_messages.remove(message.message_id)  # one step: only one taker decrements
            except KeyError:
                continue  # not held here, or already taken off
            prom.inprogress_delayed_messages.labels(*labels).dec()


def _after_skip(original: Callable[..., None], prom: Any, counted_in: bool) -> Callable[[dramatiq.Broker, Any], None]:
    """``prom``'s ``after_skip_message`` (``original``), for our skips undoing what its ``before_process_message`` did.

    ``counted_in``: whether its ``before_process_message`` ran before ours (it comes first in the broker's
    middleware), i.e. raised the in-progress gauge and noted the start time of the skipped delivery.
    """

    def after_skip_message(broker: dramatiq.Broker, message: Any) -> None:
        options = message.options
        if not options.get(SKIP_MARK):
            original(broker, message)  # someone else's skip: Dramatiq's own accounting
            return
        requeued = bool(options.get(REQUEUED_MARK))
        if counted_in and not requeued:
            original(broker, message)  # done, and seen from the start: Dramatiq's own accounting is right
            return
        labels = (message.queue_name, message.actor_name)
        if counted_in:
            # It comes back and is counted then: only undo the in-progress part. The gauge first: an
            # interruption landing after it leaves at worst a stale start time (one dict entry, replaced
            # by a later delivery of this id here); before it, the same as one before Dramatiq's own hook.
            prom.inprogress_messages.labels(*labels).dec()
            prom.message_start_times.pop(message.message_id, None)
        elif not requeued:
            # Done, but never seen in progress: count it, as Dramatiq would, without lowering the gauge
            # (its start time is not this delivery's either: the duration is 0, as Dramatiq's default).
            prom.message_durations.labels(*labels).observe(0)
            prom.total_messages.labels(*labels).inc()
        # Requeued and never seen: nothing happened as far as Prometheus knows.

    return after_skip_message


def _after_enqueue(original: Callable[..., None]) -> Callable[..., None]:
    """``after_enqueue`` that does not count our copies (sent back, parked, or leaving the delay queue) as retries."""

    def after_enqueue(broker: dramatiq.Broker, message: Any, delay: int | None) -> None:
        if not is_our_copy(message):
            original(broker, message, delay)

    return after_enqueue
