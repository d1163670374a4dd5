"""A Dramatiq app for the wait-line tests, configured by environment variables.

``LINE_TEST_BROKER_URL`` (``redis://`` or ``amqp://``), ``LINE_TEST_LEASES_URL``, ``LINE_TEST_RECORD_URL`` (a
Redis URL where runs and enqueues are recorded), ``LINE_TEST_QUEUE`` (the queue name, unique per test).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import dramatiq
import redis
from dramatiq.middleware import Middleware

from dramatiq_leases import LeaseMiddleware, current_lease

BROKER_URL = os.environ["LINE_TEST_BROKER_URL"]
QUEUE = os.environ.get("LINE_TEST_QUEUE", "default")
record = redis.Redis.from_url(os.environ["LINE_TEST_RECORD_URL"])

broker: dramatiq.Broker
if BROKER_URL.startswith("amqp"):
    from dramatiq.brokers.rabbitmq import RabbitmqBroker

    broker = RabbitmqBroker(url=BROKER_URL, confirm_delivery=True)  # as docs/deployment.md says
else:
    from dramatiq.brokers.redis import MAINTENANCE_SCALE, RedisBroker

    # Redeliver a dead worker's messages within seconds, not Dramatiq's default minute.
    broker = RedisBroker(url=BROKER_URL, heartbeat_timeout=3_000, maintenance_chance=MAINTENANCE_SCALE)  # type: ignore[no-untyped-call]  # dramatiq leaves RedisBroker unannotated


class CountEnqueues(Middleware):
    """Counts every enqueue of every message (the send, parks, sends back) in the record Redis."""

    def after_enqueue(self, broker: dramatiq.Broker, message: Any, delay: int | None) -> None:
        record.hincrby("enqueues", message.message_id, 1)


broker.add_middleware(CountEnqueues())
broker.add_middleware(LeaseMiddleware(redis_url=os.environ["LINE_TEST_LEASES_URL"]))
dramatiq.set_broker(broker)


def note(**event: object) -> None:
    record.rpush("runs", json.dumps({"pid": os.getpid(), **event}))


def _run(key: str, n: int, seconds: float) -> None:
    start = time.time()
    lease = current_lease()
    time.sleep(seconds)
    first = int(lease.meta.get("first_attempt_ms") or lease.acquired_at * 1000)
    note(
        kind="run",
        key=key,
        n=n,
        start=start,
        end=time.time(),
        fence=lease.fence,
        first=first,
        message_id=lease.meta["message_id"],
    )


@dramatiq.actor(queue_name=QUEUE, lock_key="{key}", lock_ttl=2_000, max_retries=0)
def job(key: str, n: int, seconds: float) -> None:
    """One job of the line."""
    _run(key, n, seconds)


@dramatiq.actor(queue_name=f"{QUEUE}-hold", lock_key="{key}", lock_ttl=2_000, max_retries=0)
def hold(key: str) -> None:
    """Holds ``key`` for a minute the first time (the test kills or wipes it meanwhile); runs as n=-1 after."""
    if record.set(f"held-once:{key}", 1, nx=True):
        note(kind="holding", fence=current_lease().fence)
        time.sleep(60)
    _run(key, -1, 0.0)
