"""The producer of docker-compose.yml: ``python -m examples.compose_producer``.

Sends :func:`examples.compose_app.send_invoice` messages forever, at a modest
rate, for a handful of invoices: several messages for one invoice are often
in flight at once, so the worker's leases see contention (busy retries, waits)
that the Grafana dashboard shows.

Environment: ``BROKER_URL`` and ``REDIS_URL`` as for the worker (sending checks
each message's lease key, as any producer with ``LeaseMiddleware`` does), and

* ``INVOICES_PER_SECOND``: the send rate (default 2).
* ``INVOICE_IDS``: how many distinct invoices the messages are for (default 5).
* ``MAX_SECONDS``: the longest an invoice takes to send (default 3; at least 0.1).
"""

from __future__ import annotations

import logging
import os
import random
import signal
import threading

from .compose_app import send_invoice

logger = logging.getLogger("examples.compose_producer")


def produce(stop: threading.Event, *, rate: float, invoices: int, max_seconds: float) -> int:
    """Send messages until ``stop`` is set; returns how many were sent."""
    sent = 0
    while not stop.is_set():
        invoice_id = random.randint(1, invoices)
        send_invoice.send(invoice_id, round(random.uniform(0.1, max_seconds), 2))
        sent += 1
        if sent % 100 == 0:
            logger.info("Sent %d messages.", sent)
        stop.wait(random.expovariate(rate))  # a Poisson stream: bursts, as real traffic has
    return sent


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    rate = float(os.environ.get("INVOICES_PER_SECOND", "2"))
    invoices = int(os.environ.get("INVOICE_IDS", "5"))
    max_seconds = max(0.1, float(os.environ.get("MAX_SECONDS", "3")))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())  # `docker compose stop`
    logger.info("Sending %.1f invoices per second for invoices 1 to %d.", rate, invoices)
    try:
        sent = produce(stop, rate=rate, invoices=invoices, max_seconds=max_seconds)
    except KeyboardInterrupt:
        return
    logger.info("Stopped after %d messages.", sent)


if __name__ == "__main__":
    main()
