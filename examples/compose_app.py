"""The worker of docker-compose.yml: ``dramatiq examples.compose_app``.

A small invoicing app. :func:`send_invoice` must never run twice at once for one
invoice (the customer would get two emails), so it holds the lease
``invoice:{invoice_id}`` while it runs; messages for an invoice that is being
sent wait their turn in the queue. The producer (``examples/compose_producer.py``)
sends more work than there are invoices, so they often do.

Environment (set by docker-compose.yml):

* ``BROKER_URL``: the broker's Redis (default ``redis://127.0.0.1:6379/0``).
* ``REDIS_URL``: the leases' Redis (default ``redis://127.0.0.1:6379/1``), the one
  ``dramatiq-leases exporter`` and ``dramatiq-leases list`` read.

Metrics: Dramatiq's own ``Prometheus`` middleware serves Dramatiq's metrics and
the lease metrics of every worker process on one endpoint, port 9191
(``dramatiq_prom_port``), which Prometheus scrapes as job ``dramatiq``.
"""

from __future__ import annotations

import logging
import os
import random
import time

import dramatiq
from dramatiq.brokers.redis import RedisBroker
from dramatiq.middleware.prometheus import Prometheus

from dramatiq_leases import LeaseMiddleware, current_lease

BROKER_URL = os.environ.get("BROKER_URL", "redis://127.0.0.1:6379/0")
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/1")

logger = logging.getLogger("examples.compose_app")

broker = RedisBroker(url=BROKER_URL)  # type: ignore[no-untyped-call]
broker.add_middleware(Prometheus())
broker.add_middleware(LeaseMiddleware(redis_url=REDIS_URL))
dramatiq.set_broker(broker)


@dramatiq.actor(
    queue_name="invoices",
    lock_key="invoice:{invoice_id}",
    # Renewed every 5 s while the invoice is being sent; if this worker dies, the
    # invoice is free again (and its message redelivered) within 15 s.
    lock_ttl=15_000,
    lock_renew_interval=5_000,
    # Give up on a message that could not get its invoice for 2 minutes: it goes
    # to the dead-letter queue, and the alert DramatiqLeaseGaveUp fires.
    lock_max_wait=120_000,
    max_retries=3,
    time_limit=60_000,
)
def send_invoice(invoice_id: int, seconds: float = 1.0) -> None:
    """Render and email invoice ``invoice_id`` (here: take ``seconds``), once at a time per invoice."""
    lease = current_lease()
    logger.info("Sending invoice %d (fence %d).", invoice_id, lease.fence)
    time.sleep(seconds)
    if random.random() < 0.02:
        # The mail server refused it now and then: Retries sends the message again later.
        raise ConnectionError(f"the mail server refused invoice {invoice_id}")
    logger.info("Sent invoice %d.", invoice_id)
