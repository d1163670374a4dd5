"""Unique sends (``lock_unique``): a send refused while another message of its key is queued, or not done.

The record is taken at send time, before the broker has the message, for a short grace (:data:`GRACE_MS`);
once the broker has it (``after_enqueue``) it lives ``lock_unique_ttl`` past each sign of life of its
message: its send (plus its delay), a delivery that takes the lease, a later enqueue of it (a retry, a
parked copy, a re-drive from its dead letters, which takes the record again if the key has room; a delayed
copy leaving its delay queue, kept before the broker has the copy, since the copy may run and be
acknowledged before the enqueue's after-hooks). Its message's own acknowledgement or dead-lettering ends it (ran,
failed for good, skipped, superseded, given up, a duplicate), unless that delivery enqueued it again or
was a delayed copy moving on. A "queued" record ends when its message is granted its lease, in the
grant's own step. A message purged from its queue or deleted by hand ends its record ``lock_unique_ttl``
after its last sign of life at the latest. Only a message's own id ends its record: a retry or a stray
copy of another message never touches it.
"""

from __future__ import annotations

import logging
import math
import sys
import threading
from typing import Any, NamedTuple, cast

import dramatiq

from ..core.errors import LeaseError, LeaseUnavailableError
from ..core.metrics import LeaseMetrics
from ..core.scripts import MAX_MS
from ..core.store import Leases
from ..core.unique import MODE_CODES, Mode, UniqueRecords
from .declarations import Declarations
from .errors import DuplicateMessage, LeaseSendUnavailableError
from .options import LEASE_OPTION, MAX_DELAY, UNIQUE_OPTION, Options
from .waiting import moving_on

__all__ = ["GRACE_MS", "Sent", "Uniqueness", "try_send", "try_send_with_options"]

logger = logging.getLogger(__name__)

#: How long (ms) a record taken at send time lives before the broker is known to have its message, at most
#: (never longer than ``lock_unique_ttl``): a send whose broker call fails leaves a record that ends this soon.
GRACE_MS = 30_000


class Uniqueness:
    """The middleware's side of ``lock_unique``: takes records at send, keeps them, ends them at the end.

    Parameters:
      declarations: the actors' declarations (keys, options).
      leases: the lease store, which holds the records too.
      metrics: where duplicates are counted.
    """

    def __init__(self, declarations: Declarations, leases: Leases, metrics: LeaseMetrics) -> None:
        self.declarations = declarations
        self.leases = leases
        self.metrics = metrics
        self.records = UniqueRecords(leases)
        self._taken = threading.local()
        # The delivery each worker thread processes: an enqueue of the same message from that thread (a Retries
        # retry, a parked copy, a send-back) marks it, so that its ack keeps the record.
        self._current = threading.local()

    def _unique(self, broker: dramatiq.Broker, message: Any) -> tuple[Mode, str, Options] | None:
        """(mode, key, options) of a leased message with ``lock_unique``, else ``None``."""
        declarations = self.declarations
        template = declarations.template(message.actor_name, message.options)
        if template is None:
            return None
        opts = declarations.message_options(message, broker.get_actor(message.actor_name))
        if opts.unique is None:
            return None
        key = template.render(tuple(message.args), message.kwargs)
        return cast(Mode, opts.unique), key, opts

    def _limit(self, opts: Options, message: Any) -> int | None:
        """The message's ``lock_limit``, or ``None`` if its actor's callable fails now (raises, or answers a bad
        value): a message already sent is never refused for it (its delivery fails or refuses it)."""
        try:
            return self.declarations.limit(opts, message)
        except LeaseError as e:
            logger.info("The lock_limit of message %s is unknown now: %s.", message.message_id, e)
            return None

    def before_enqueue(self, broker: dramatiq.Broker, message: Any, delay: int | None, *, resent: bool = False) -> None:
        """A new send takes its record (or raises :class:`DuplicateMessage`); a later enqueue of a message already
        sent (a retry, a parked copy, a delayed copy moving on, a re-drive) is never refused: see
        :meth:`after_enqueue`. ``resent``: sent before without a record (its producer had no LeaseMiddleware): it
        takes one if its ``lock_limit`` is known now."""
        self._taken.key = None
        if message.options.get(UNIQUE_OPTION):
            delivery = getattr(self._current, "delivery", None)
            if delivery is not None and delivery.message_id == message.message_id:
                # Its own message enqueued again (a retry): if an interruption cuts the enqueue short, the broker
                # may have the copy all the same, and the ack must not end its record (see settled).
                delivery.lease_unique_enqueuing = delay  # one attribute store: whole under interruption
            elif moving_on():
                # A delayed copy leaving its delay queue: kept now, before the broker has the copy. Kept after,
                # the copy could already have run and been acknowledged (another consumer fetches it at once),
                # and this keep would take its ended record again. Its delayed message stays until acknowledged
                # after this enqueue: an enqueue the broker refuses leaves it to be moved on again.
                self._keep_again(broker, message, delay, exact=False)
            return
        found = self._unique(broker, message)
        if found is None:
            return
        mode, key, opts = found
        if resent:
            known = self._limit(opts, message)
            if known is None:
                return
            limit = known
        else:
            limit = self.declarations.send_limit(opts, message)
        ttl = opts.unique_ttl
        try:
            holder = self.records.take(
                key,
                message.message_id,
                mode=mode,
                limit=limit,
                grace=min(GRACE_MS, ttl),
                attempt=_attempt(message),
                actor=message.actor_name,
            )
        except LeaseUnavailableError as e:
            raise LeaseSendUnavailableError(
                f"actor {message.actor_name!r}: message {message.message_id} not sent: its unique record on "
                f"{key!r} could not be asked for ({e})",
                key=key,
                actor=message.actor_name,
            ) from e
        if holder is not None:
            self.release_handed(message, key)
            self.metrics.not_run({"actor": message.actor_name, "queue": message.queue_name}, "duplicate")
            logger.info(
                "Message %s of actor %r was not sent (duplicate): key %r already has message %s (lock_unique=%r).",
                message.message_id,
                message.actor_name,
                key,
                holder,
                mode,
            )
            raise DuplicateMessage(
                key=key, message_id=holder, actor=message.actor_name, refused_id=message.message_id, mode=mode
            )
        message.options[UNIQUE_OPTION] = MODE_CODES[mode]
        self._taken.key = (message.message_id, key, _lives(delay, ttl))

    def release_handed(self, message: Any, key: str) -> None:
        """A refused message handed a lease (``lease=``, a web request's) will never adopt it: released now
        (owner-checked), so the key is not held for nothing until its TTL."""
        handed = message.options.get(LEASE_OPTION)
        if not isinstance(handed, dict) or not isinstance(handed.get("token"), str):
            return
        try:
            self.leases.release_token(key, handed["token"], slot=handed.get("slot") or None)
        except LeaseUnavailableError as e:
            logger.warning("Could not release the lease handed to refused message %s: %s.", message.message_id, e)

    def after_enqueue(self, broker: dramatiq.Broker, message: Any, delay: int | None) -> None:
        """The broker has the message: its record lives ``lock_unique_ttl`` (plus its delay) from now.

        A message enqueued again is kept only now, once the broker has the copy: an enqueue the broker refused
        (a retry, a park) leaves nothing of the message, and the acknowledgement of its delivery must then end
        the record (neither a newer attempt nor a mark may keep it). A copy of the delivery this thread
        processes marks that delivery, so that its acknowledgement keeps the record.
        """
        taken, self._taken.key = getattr(self._taken, "key", None), None
        if taken is None or taken[0] != message.message_id:
            if message.options.get(UNIQUE_OPTION) and not moving_on():  # a move was kept before its enqueue
                self._enqueued_again(broker, message, delay)
            return
        _, key, ms = taken
        try:
            self.records.keep(key, message.message_id, ms)
        except LeaseUnavailableError as e:
            logger.warning(
                "Could not confirm the unique record of message %s on %r (%s): it ends within %d s.",
                message.message_id,
                key,
                e,
                GRACE_MS // 1000,
            )

    def _enqueued_again(self, broker: dramatiq.Broker, message: Any, delay: int | None) -> None:
        delivery = getattr(self._current, "delivery", None)
        mine = delivery is not None and delivery.message_id == message.message_id
        self._keep_again(broker, message, delay, exact=mine)
        # Marked once kept: an interruption before this leaves it unmarked, and its ack keeps it (see settled).
        if mine and delivery is not None:
            delivery.lease_unique_requeued = True  # one attribute store: whole under interruption

    def _keep_again(self, broker: dramatiq.Broker, message: Any, delay: int | None, *, exact: bool) -> None:
        """The record of a message enqueued again lives ``lock_unique_ttl`` past its delay (taken again if it has
        none and the key has room: a re-drive, a retry of a started "queued" message). ``exact``: enqueued by
        its own delivery, whose run is over: the run's longest hold no longer counts (a purged retry frees the
        key ``lock_unique_ttl`` past its delay, not past the run's hold)."""
        try:
            found = self._unique(broker, message)
            if found is None:
                return
            mode, key, opts = found
            # Taken again only if the key's room is known now; a record it still has is kept all the same.
            limit = self._limit(opts, message)
            self.records.keep(
                key,
                message.message_id,
                _lives(delay, opts.unique_ttl),
                retake=None if limit is None else mode,
                limit=limit or 1,
                attempt=_attempt(message),
                exact=exact,
            )
        except Exception as e:  # an after-hook: the message is enqueued; never fail its sender for this
            logger.warning("Could not keep the unique record of message %s: %s.", message.message_id, e)

    def granted(self, broker: dramatiq.Broker, message: Any, key: str, mode: str, ttl: int) -> None:
        """The message holds its lease: a "queued" record of an adopted lease ends; an "until_done" one is kept
        for the longest the run may hold its lease, plus ``ttl``."""
        if not message.options.get(UNIQUE_OPTION):
            return
        try:
            if mode == "queued":
                if message.options.get(LEASE_OPTION) is not None:  # adopted: no grant script ended it
                    self.records.end(key, message.message_id)
            else:
                # Nothing writes the record while the run lasts: kept only `ttl`, the sorted set's own TTL would
                # end it mid-run (and an adopted lease's hash names no waiter to count it as running). Unbounded
                # runs (no lock_max_hold, no time limit) are kept for MAX_DELAY: still an end.
                actor = broker.get_actor(message.actor_name)
                hold = self.declarations.max_hold(self.declarations.message_options(message, actor), message, actor)
                ms = min(MAX_MS, ttl + (MAX_DELAY if hold is None else hold))
                self.records.keep(key, message.message_id, ms, attempt=_attempt(message))
        except LeaseUnavailableError as e:
            logger.warning("Could not update the unique record of message %s on %r: %s.", message.message_id, key, e)

    def delivered(self, message: Any) -> None:
        """A worker thread starts on ``message`` (before anything can enqueue it again)."""
        self._current.delivery = message

    def processing(self, message: Any) -> bool:
        """Whether ``message`` is (a copy of) the delivery this worker thread processes."""
        delivery = getattr(self._current, "delivery", None)
        return delivery is not None and delivery.message_id == message.message_id

    def waiting(self, message: Any, key: str, ttl: int, wait_ms: int) -> None:
        """A delivery of a unique message about to wait in place ``wait_ms`` for its lease: a sign of life. Its
        record lives ``ttl`` past the wait (then it is granted, parked or sent back: kept again, or ended)."""
        if not message.options.get(UNIQUE_OPTION):
            return
        try:
            self.records.keep(key, message.message_id, min(MAX_MS, ttl + wait_ms), attempt=_attempt(message))
        except LeaseUnavailableError as e:  # the acquisition that follows meets the same outage
            logger.warning("Could not keep the unique record of message %s on %r: %s.", message.message_id, key, e)

    def settled(self, broker: dramatiq.Broker, message: Any) -> None:
        """Acknowledged or dead-lettered: the record ends, unless a copy of the message lives on."""
        if not message.options.get(UNIQUE_OPTION):
            return
        if getattr(message, "lease_unique_requeued", False) or message.queue_name.endswith(".DQ"):
            return  # enqueued again while processed, or a delayed copy moved on to its queue
        enqueuing = getattr(message, "lease_unique_enqueuing", False)
        cut = sys.exc_info()[1]  # what propagates through this ack (it runs in the worker's `finally`)
        if enqueuing is not False and cut is not None and not isinstance(cut, Exception):
            # An interruption (TimeLimit, Shutdown) cut this delivery's own re-enqueue short, Retries' retry: the
            # broker may have the copy (the reply was being read), so the record is kept as if it had, bounded by
            # the copy's delay plus lock_unique_ttl. (A refusal by the broker is an Exception, caught by Dramatiq
            # before this ack: the record then ends.)
            self._keep_again(broker, message, enqueuing, exact=True)
            return
        try:
            found = self._unique(broker, message)
            if found is not None:
                self.records.end(found[1], message.message_id, attempt=_attempt(message))
        except Exception as e:  # an after-hook: never let it break the worker's acks
            logger.warning("Could not end the unique record of message %s: %s.", message.message_id, e)


def _lives(delay: Any, ttl: int) -> int:
    """How long (ms) the record of a message enqueued with ``delay`` lives: the delay, rounded up (Dramatiq takes
    a float as well, ``seconds * 1000``), plus ``ttl``; within what a script accepts."""
    ms = math.ceil(delay) if isinstance(delay, (int, float)) and math.isfinite(delay) and delay > 0 else 0
    return min(MAX_MS, ms + ttl)


def _attempt(message: Any) -> int:
    """The message's attempt: Dramatiq's retry count (a bad value, from whoever wrote the message, is 0)."""
    retries = message.options.get("retries", 0)
    return retries if isinstance(retries, int) and not isinstance(retries, bool) and 0 <= retries <= 2**31 else 0


class Sent(NamedTuple):
    """What :func:`try_send` did: ``sent`` is whether a message was enqueued; ``message_id`` is its id, or the
    id of the message already holding the key's unique record; ``message`` is the enqueued message, if any."""

    sent: bool
    message_id: str
    message: dramatiq.Message[Any] | None


def try_send(actor: dramatiq.Actor[Any, Any], *args: Any, **kwargs: Any) -> Sent:
    """``actor.send(*args, **kwargs)``, answering a ``lock_unique`` refusal instead of raising it."""
    return try_send_with_options(actor, args=args, kwargs=kwargs)


def try_send_with_options(
    actor: dramatiq.Actor[Any, Any],
    *,
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    delay: int | None = None,
    **options: Any,
) -> Sent:
    """``actor.send_with_options(...)``, answering a ``lock_unique`` refusal (:class:`DuplicateMessage`) with
    ``Sent(False, <the holder's message id>, None)`` instead of raising it."""
    try:
        message = actor.send_with_options(args=args, kwargs=kwargs, delay=delay, **options)
    except DuplicateMessage as e:
        return Sent(False, e.message_id, None)
    return Sent(True, message.message_id, message)
