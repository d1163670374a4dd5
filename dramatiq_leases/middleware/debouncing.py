"""``lock_debounce``: one run per burst of sends of a key, with the newest arguments (see :mod:`..core.debounce`).

At send (``before_enqueue``), a first send of a debounced actor's message takes its sequence among its key's
sends (:data:`DEBOUNCE_OPTION`), which also extends its key's burst; once the broker has it
(``after_enqueue``), the send is confirmed. At delivery, before the lease is asked for, the key's record says
whether the message is its burst's run (it then goes on to its lease, as any message: its line, ``lock_rate``,
``lock_limit``), must come back later (sent back, due when its burst is), or gives way to a newer message
(acknowledged without running, counted ``dramatiq_lease_not_run_total{reason="debounced"}``, logged at INFO
naming that message, and recorded in the key's history). Actors without ``lock_debounce`` pay nothing.

A message's sequence is input from whoever writes to the broker: one that cannot be a send's (not a whole number
of µs within ten minutes of the message's ``message_timestamp``) is registered anew at its delivery, as a send
then; a genuine one the key's record never saw (the store lost the record) is registered at itself, so the
messages the store forgot keep their send order.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import dramatiq

from ..core.debounce import Debounces, Verdict, genuine
from ..core.errors import LeaseUnavailableError
from ..core.metrics import LeaseMetrics
from ..core.store import Leases
from .busy import mark_skipped, record_history, send_back, send_copy_back, skip
from .declarations import Declarations
from .options import FIRST_ATTEMPT_OPTION, SENT_BACK_OPTION, Options
from .waiting import LINE_OPTION, Waiting, waiter_id

logger = logging.getLogger(__name__)

#: Message option of a debounced actor's message: its sequence among its key's sends, taken at its first send
#: and kept by every later enqueue of it (a retry, a copy sent back or parked, a redelivery).
DEBOUNCE_OPTION = "lease_debounce"

#: Added to a wait: a copy due at its burst's instant by the broker's clock must not come back a moment early
#: by the Redis server's, and cost one more enqueue (ms).
_DUE_SLACK_MS = 5


class Debouncing:
    """The debounced sends and deliveries of one middleware.

    Parameters:
      declarations: the actors' lease options; leases: the store; metrics: where not-run messages are counted;
      waiting: the process's side of the line (for the history).
    """

    def __init__(self, declarations: Declarations, leases: Leases, metrics: LeaseMetrics, waiting: Waiting) -> None:
        self.declarations = declarations
        self.records = Debounces(leases.runner, leases.prefix)
        self.metrics = metrics
        self.waiting = waiting
        # The send this thread registered in before_enqueue, confirmed in after_enqueue: (message id, key, seq).
        self._sent = threading.local()

    def before_enqueue(self, broker: dramatiq.Broker, message: Any, *, resent: bool) -> None:
        """Give a first send of a debounced actor's message its sequence; it extends its key's burst."""
        self._sent.pending = None
        options = message.options
        if resent or DEBOUNCE_OPTION in options:
            return
        template = self.declarations.template(message.actor_name, options)
        if template is None:
            return
        opts = self.declarations.message_options(message, broker.get_actor(message.actor_name))
        if opts.debounce is None:
            return
        key = template.render(tuple(message.args), message.kwargs)
        try:
            stamp = self.records.send(key, message.message_id, opts.debounce, opts.debounce_max)
        except LeaseUnavailableError as e:
            # Sent without one: its delivery registers it (as a send then), rather than the send failing.
            logger.warning(
                "Message %s of actor %r is sent without a debounce sequence from Redis (%s): its delivery takes one.",
                message.message_id,
                message.actor_name,
                e,
            )
            return
        options[DEBOUNCE_OPTION] = stamp.seq
        self._sent.pending = (message.message_id, key, stamp.seq)

    def after_enqueue(self, message: Any) -> None:
        """The broker has the message: its send, registered in this thread's ``before_enqueue``, is confirmed."""
        pending = getattr(self._sent, "pending", None)
        self._sent.pending = None
        if pending is None or pending[0] != message.message_id:
            return
        try:
            self.records.confirm(pending[1], pending[2], message.message_id)
        except LeaseUnavailableError as e:
            # Older sends of the burst then wait for it a while (core.debounce.CONFIRM_MS), then run in its stead.
            logger.warning("Could not confirm the debounced send of message %s: %s", message.message_id, e)

    def delivered(self, broker: dramatiq.Broker, message: Any, key: str, opts: Options, deadline: float) -> None:
        """Return if ``message`` is its burst's run; else send it back (not due yet) or acknowledge it (a newer
        message runs instead), and skip the delivery. Redis unreachable: sent back with backoff (fail closed)."""
        assert opts.debounce is not None
        seq = message.options.get(DEBOUNCE_OPTION)
        try:
            if genuine(seq, message.message_timestamp):
                assert isinstance(seq, int)
                pick = self.records.pick(key, seq, message.message_id, opts.debounce, opts.debounce_max)
                wait_ms, by, verdict = pick.wait_ms, pick.by, pick.verdict
            else:  # none, or not one a send took: registered now, as a send now
                stamp = self.records.send(key, message.message_id, opts.debounce, opts.debounce_max, in_broker=True)
                message.options[DEBOUNCE_OPTION] = stamp.seq
                wait_ms, by, verdict = stamp.due_in_ms, "", Verdict.WAIT
        except LeaseUnavailableError as e:
            logger.warning("Could not debounce message %s of lease %r: %s. Retrying later.", message.message_id, key, e)
            send_back(broker, message, opts, deadline, count_attempt=True)
            skip(message, f"lease {key!r} unavailable: {e}")
        if verdict is Verdict.RUN:
            return
        if verdict is Verdict.WAIT:
            logger.debug("Message %s of %r comes back in %d ms (lock_debounce).", message.message_id, key, wait_ms)
            # Remembered once it runs (SENT_BACK_OPTION): a spare copy (an enqueue interrupted after the broker took
            # it, sent again) is then a duplicate, not a second run of the burst.
            copy = message.copy(options={SENT_BACK_OPTION: True})
            send_copy_back(broker, message, copy, wait_ms + _DUE_SLACK_MS, deadline)
            skip(message, f"lease {key!r}: debounced, due in {wait_ms} ms")
        meta = {"actor": message.actor_name, "queue": message.queue_name, "message_id": message.message_id}
        self.metrics.not_run(meta, "debounced")
        logger.info(
            "Message %s of actor %r did not run (debounced): a message sent after it runs instead (the newest of its "
            "burst now: %s; lock_debounce=%d ms%s); lease %r.",
            message.message_id,
            message.actor_name,
            by or "(unknown)",
            opts.debounce,
            "" if opts.debounce_max is None else f", lock_debounce_max={opts.debounce_max} ms",
            key,
        )
        record_history(self.waiting, key, "debounced", meta, reason=f"lock_debounce={opts.debounce}", by=by)
        if LINE_OPTION in message.options or FIRST_ATTEMPT_OPTION in message.options:
            # It had a place in the key's line (a copy back from a hold, or parked): given up now, or the next
            # grant would wait for it until its place lapsed.
            try:
                self.waiting.leases.line.leave(key, [waiter_id(message)])
            except Exception as e:
                logger.warning("Could not take message %s out of the line of %r: %s", message.message_id, key, e)
        mark_skipped(message)
        skip(message, f"lease {key!r}: debounced, message {by} runs instead")
