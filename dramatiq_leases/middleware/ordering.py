"""Which message of a key is the newest (``lock_on_busy="latest"``): the one sent last, by its order.

A message of an actor with ``lock_on_busy="latest"`` takes its order at its first send, in ``before_enqueue``
(:func:`stamp`): a number from Redis (``Line.send_order``, one script on the key's order record, in the key's
hash slot), the server's clock in microseconds raised above every order the key handed out and every order
that reached its lease. So the orders of one key follow the order in which Redis saw the sends, one clock for
every producer, two sends in one millisecond included; and a message sent after another reached the lease is
always newer than it. The order lives in the message's options (:data:`ORDER_OPTION`): a retry, a copy sent
back or parked, a redelivery and a re-drive from the dead letters all carry it. Other actors pay nothing.

A message sent without one (its producer had no LeaseMiddleware, or Redis could not be asked: the send goes
on, with a WARNING) is ordered by its ``message_timestamp`` (its producer's clock, in ms) read as
microseconds: on the same scale, so the two kinds compare, exactly up to the skew between that producer's
clock and the Redis server's (and its millisecond: two sends of one millisecond tie, and a tie goes by message
id). An order more than a minute ahead of the server's clock (``scripts.ORDER_AHEAD_MS``) counts as a minute
ahead: one clock far ahead cannot hold a key's newer messages back for longer.

The order is input from whoever writes to the broker: a whole number from 1 to ``scripts.MAX_ORDER``, else the
message is refused (dead-lettered, with an ERROR naming actor, option and value), as any message option that
cannot work is: treated as the oldest it would be dropped for a typo, as the newest it would hold newer
messages back.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import dramatiq

from ..core.errors import LeaseUnavailableError
from ..core.scripts import MAX_ORDER
from .errors import LeaseOptionError
from .options import ATTEMPTS_OPTION, FIRST_ATTEMPT_OPTION, ORDER_OPTION, SENT_BACK_OPTION
from .waiting import LINE_OPTION

if TYPE_CHECKING:
    from .hooks import LeaseMiddleware

logger = logging.getLogger(__name__)

#: Options that only an enqueue after the first send carries (a retry, a copy sent back or parked).
_LATER = (ATTEMPTS_OPTION, FIRST_ATTEMPT_OPTION, SENT_BACK_OPTION, LINE_OPTION, "retries")


def stamp(mw: LeaseMiddleware, broker: dramatiq.Broker, message: Any, delay: int | None) -> None:
    """Give a first send of a ``lock_on_busy="latest"`` message its order; check one it carries already.

    A later enqueue (a retry, a copy sent back or parked, a delayed copy leaving its delay queue) keeps what
    the first send had, order or none: taken now, it would make an old message the newest.

    Raises:
      LeaseOptionError: the message carries an order that is not one (set by hand).
    """
    options = message.options
    if ORDER_OPTION in options:
        order_of(message)
        return
    if any(name in options for name in _LATER) or (delay is None and "eta" in options):
        return
    declarations = mw.declarations
    template = declarations.template(message.actor_name, options)
    if template is None:
        return
    opts = declarations.message_options(message, broker.get_actor(message.actor_name))
    if opts.on_busy != "latest":
        return
    key = template.render(tuple(message.args), message.kwargs)
    try:
        options[ORDER_OPTION] = mw.leases._line.send_order(key)
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
