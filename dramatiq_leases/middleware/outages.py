"""Sending a message back to its broker, waiting out a broker outage instead of dead-lettering the message.

A message this middleware skips is acknowledged once skipped, so its copy must be in the broker
first. When the broker cannot take the copy (the same Redis as the lease store is down, a
partition, a RabbitMQ restart, a Redis refusing writes for now: :func:`is_outage`), the worker
thread keeps the delivery and tries again with backoff:
acknowledging it would lose the message, failing it would dead-letter a message that did nothing
wrong. It keeps trying through a worker shutdown, as Dramatiq keeps trying an acknowledgement:
if the process exits first, the delivery was never acknowledged and the broker delivers it again
(RabbitMQ when the connection drops, Redis when the worker's heartbeat lapses). It stops only at a
deadline set well inside the actor's time limit, whose interruption would otherwise end the
delivery as processed; the message is then failed, and goes to the dead-letter queue once the
broker answers: logged, never silently dropped. An attempt that timed out may have reached the
broker all the same: two copies then, of which only one runs (see ``SENT_BACK_OPTION``).
"""

from __future__ import annotations

import logging
import random
import re
import time
from typing import Any

import dramatiq
import redis

logger = logging.getLogger(__name__)

#: What an enqueue raises when the broker is away rather than when the message is wrong: worth waiting out.
#: Dramatiq's RabbitMQ broker raises ``ConnectionClosed`` after its own retries; its Redis broker lets redis-py's
#: connection and timeout errors through; a failover may leave a client talking to a read-only replica.
TRANSIENT_BROKER_ERRORS: tuple[type[BaseException], ...] = (
    dramatiq.errors.ConnectionClosed,
    dramatiq.errors.ConnectionFailed,
    redis.ConnectionError,
    redis.TimeoutError,
    redis.ReadOnlyError,
    redis.exceptions.OutOfMemoryError,
    OSError,
)

#: Error replies of a Redis that is up but refuses writes for now (too few replicas, a failed save, a script
#: running, a replica that lost its primary, a cluster reconfiguring, out of memory, a read-only replica).
TRANSIENT_REPLIES = (
    "NOREPLICAS",
    "MISCONF",
    "BUSY",
    "MASTERDOWN",
    "CLUSTERDOWN",
    "TRYAGAIN",
    "LOADING",
    "OOM",
    "READONLY",
)

# Before Redis 7, an error inside a script (Dramatiq's Redis broker enqueues with one) arrives wrapped:
# "Error running script (call to f_...): @user_script:1: @user_script: 1: -NOREPLICAS Not enough good replicas".
_WRAPPED_REPLY = re.compile(r"^(?:ERR )?Error running script .*?@user_script: ?\d+: -(\S+)")


def reply_code(error: BaseException) -> str:
    """The error code of a Redis error reply (``"NOREPLICAS"``), unwrapped from a script error of Redis < 7."""
    text = str(error)
    wrapped = _WRAPPED_REPLY.match(text)
    return wrapped.group(1) if wrapped else text.split(" ", 1)[0]


def is_outage(error: BaseException) -> bool:
    """Whether an enqueue failed because the broker cannot take the message for now, not because of the message."""
    if isinstance(error, TRANSIENT_BROKER_ERRORS):
        return True
    return isinstance(error, redis.ResponseError) and reply_code(error) in TRANSIENT_REPLIES


#: First pause between two attempts (s), doubled up to :data:`MAX_PAUSE_S`, with jitter.
FIRST_PAUSE_S = 0.25
#: Longest pause between two attempts (s): how late a message may go back after the broker returns.
MAX_PAUSE_S = 5.0


def enqueue_through_outage(broker: dramatiq.Broker, message: Any, delay: int, deadline: float) -> bool:
    """Enqueue ``message`` with ``delay`` (ms), trying again while the broker is unreachable.

    Returns ``True`` once enqueued, ``False`` if the broker was still unreachable at ``deadline``
    (a ``time.monotonic()`` value).

    Raises:
      Exception: whatever the enqueue raised that is not a broker outage (a middleware refusing
        the message, a message too large): trying again would not help.
    """
    started = time.monotonic()
    pause = FIRST_PAUSE_S
    attempts = 0
    while True:
        attempts += 1
        try:
            broker.enqueue(message, delay=delay)
        except Exception as e:
            if not is_outage(e):
                raise
            left = deadline - time.monotonic()
            if attempts == 1:
                logger.warning(
                    "Could not send message %s back to queue %r: %s. Trying again for up to %.0f s.",
                    message.message_id,
                    message.queue_name,
                    e,
                    max(0.0, left),
                )
            if left <= 0:
                logger.error(
                    "Gave up sending message %s back to queue %r after %d attempts over %.1f s, near its "
                    "time limit (%s): failing it. It goes to the dead-letter queue once the broker answers.",
                    message.message_id,
                    message.queue_name,
                    attempts,
                    time.monotonic() - started,
                    e,
                )
                return False
            time.sleep(min(left, random.uniform(pause / 2, pause)))
            pause = min(MAX_PAUSE_S, pause * 2)
            continue
        if attempts > 1:
            logger.warning(
                "Sent message %s back to queue %r after %d attempts over %.1f s.",
                message.message_id,
                message.queue_name,
                attempts,
                time.monotonic() - started,
            )
        return True
