"""Publisher confirms: a copy the middleware sends on must reach the broker before its original is acknowledged.

Sending a message back, parking it, or moving a debounced burst on enqueues a copy, then acknowledges the
delivery. Dramatiq's ``RabbitmqBroker`` returns from an enqueue once the copy is written to its socket unless
it was built with ``confirm_delivery=True``; a connection that drops before RabbitMQ handled the copy loses it,
and its original is gone too. :func:`warn_unconfirmed_sends` says so at worker boot (docs/deployment.md).
"""

from __future__ import annotations

import logging

import dramatiq

logger = logging.getLogger(__name__)


def warn_unconfirmed_sends(broker: dramatiq.Broker) -> None:
    """Log a warning if ``broker`` is a ``RabbitmqBroker`` without publisher confirms."""
    try:
        from dramatiq.brokers.rabbitmq import RabbitmqBroker
    except ImportError:  # pika is not installed: no RabbitmqBroker can exist
        return
    if not isinstance(broker, RabbitmqBroker) or broker.confirm_delivery:
        return
    logger.warning(
        "RabbitmqBroker without confirm_delivery=True: a message the lease middleware sends back or parks is "
        "acknowledged once its copy is written to the connection, and lost if the connection drops before "
        "RabbitMQ has it. Build the broker with RabbitmqBroker(..., confirm_delivery=True) (docs/deployment.md)."
    )
