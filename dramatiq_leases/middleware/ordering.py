"""Which message of a key is the newest (``lock_on_busy="latest"``): the one sent last, by its order.

A message of an actor with ``lock_on_busy="latest"`` takes its order at its first send, in ``before_enqueue``
(:func:`stamp`): a number from Redis (``Line.send_order``: ``lua/order.lua``, one script on the key's order
record, in the key's hash slot), the server's clock in microseconds raised above every order the key handed out
and every order that reached its lease. The order lives in the message's options (:data:`ORDER_OPTION`): a
retry, a copy sent back or parked, a redelivery and a re-drive from the dead letters all carry it. The acquire
of a latest message (``scripts.ACQUIRE_LATEST``) records the newest order that reached the lease; one older
than it supersedes itself. Other actors pay nothing: no round trip at send, the plain acquire script.

Why a round trip at send time, and not ``message_timestamp`` alone. ``message_timestamp`` is its producer's
clock, in milliseconds. (1) Two sends of one producer in one millisecond (a loop saving revisions) tie, and
a tie can only be broken by something unrelated to the send (the message id): the older may be kept. (2) Two
producers' clocks differ by their skew, and a clock steps back under NTP: a message sent after another one
already reached the lease, by a producer whose clock is behind by more than the gap, would look older and be
acknowledged without running: the newest revision lost, silently, which is the bug this ordering exists to
fix. One clock for every producer (the Redis server's, which also orders the scripts one at a time) has
neither problem, and ``order.lua`` raising each order above the key's last ones makes them strictly grow,
across a restart of the record too. The price is one ``EVALSHA`` per first send of a latest actor's message
(``lock_unique`` pays the same), none for any other actor.

A message sent without an order (its producer had no LeaseMiddleware, or Redis could not be asked: the send
goes on, with a WARNING, rather than failing for want of an ordering hint) is ordered by its
``message_timestamp`` read as microseconds: on the same scale, so the two kinds compare, exactly up to the skew
between that producer's clock and the Redis server's (and its millisecond). An order more than
``scripts.ORDER_AHEAD_MS`` (a minute) ahead of the server's clock counts, at each attempt, as that far ahead: a
clock far ahead makes its message newer than those sent up to a minute after it, not newer than all of them.

The order is input from whoever writes to the broker: a whole number from 1 to ``scripts.MAX_ORDER``, else the
message is refused, as any message option that cannot work is (at send: ``LeaseOptionError``; at the worker:
dead-lettered with an ERROR), naming actor, option and value. Treated as the oldest, a typo would drop the
message; as the newest, it would hold newer messages back.
"""

from __future__ import annotations

import logging
from typing import Any

import dramatiq

from ..core.errors import LeaseUnavailableError
from ..core.scripts import MAX_ORDER
from .context import Context
from .errors import LeaseOptionError
from .options import ATTEMPTS_OPTION, FIRST_ATTEMPT_OPTION, ORDER_OPTION, SENT_BACK_OPTION
from .waiting import LINE_OPTION

logger = logging.getLogger(__name__)

#: Options that only an enqueue after the first send carries (a retry, a copy sent back or parked).
_LATER = (ATTEMPTS_OPTION, FIRST_ATTEMPT_OPTION, SENT_BACK_OPTION, LINE_OPTION, "retries")


def stamp(ctx: Context, broker: dramatiq.Broker, message: Any, delay: int | None, *, resent: bool = False) -> None:
    """Give a first send of a ``lock_on_busy="latest"`` message its order; check one it carries already.

    A later enqueue (a retry, a copy sent back or parked, a delayed copy leaving its delay queue) keeps what
    the first send had, order or none: taken now, it would make an old message the newest. ``resent``: the
    middleware's judgement that this enqueue is such a one (``LeaseMiddleware._resent``); a delayed copy
    leaving its delay queue carries none of the options below (Dramatiq drops its ``eta``), only that.

    Raises:
      LeaseOptionError: the message carries an order that is not one (set by hand).
    """
    options = message.options
    if resent:
        # Its order, if bad, is refused at its delivery (dead-lettered with an ERROR): raised here, it would
        # crash the consumer thread moving a delayed copy on, again at each redelivery.
        return
    if ORDER_OPTION in options:
        order_of(message)
        return
    if any(name in options for name in _LATER) or (delay is None and "eta" in options):
        return
    declarations = ctx.declarations
    template = declarations.template(message.actor_name, options)
    if template is None:
        return
    opts = declarations.message_options(message, broker.get_actor(message.actor_name))
    if opts.on_busy != "latest":
        return
    key = template.render(tuple(message.args), message.kwargs)
    try:
        options[ORDER_OPTION] = ctx.leases.line.send_order(key)
    except LeaseUnavailableError as e:
        logger.warning(
            "Message %s of actor %r is sent without an order from Redis (%s): lock_on_busy='latest' orders it by "
            "its producer's clock (message_timestamp).",
            message.message_id,
            message.actor_name,
            e,
        )


def order_of(message: Any) -> int:
    """The order of ``message`` among its key's: the one its send took, else its ``message_timestamp`` (ms) in µs.

    Raises:
      LeaseOptionError: naming the actor, the option and the value, if it is not a whole number from 1 to
        ``MAX_ORDER`` (input from whoever wrote the message).
    """
    value = message.options.get(ORDER_OPTION)
    if value is None:
        sent = message.message_timestamp
        if _whole(sent, MAX_ORDER // 1000):
            return int(sent) * 1000
        said = f"message_timestamp={sent!r} (it has no {ORDER_OPTION})"
    elif _whole(value, MAX_ORDER):
        return int(value)
    else:
        said = f"message option {ORDER_OPTION}={value!r}"
    raise LeaseOptionError(
        f"actor {message.actor_name!r}: {said} is not an order (a whole number from 1 to {MAX_ORDER}, taken at "
        "send time); lock_on_busy='latest' cannot tell whether it is the newest",
        actor=message.actor_name,
    )


def _whole(value: Any, maximum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= maximum
