"""A Dramatiq app for the cross-process tests, configured by environment variables.

``LEASES_TEST_BROKER_URL``: the broker, ``redis://`` or ``amqp://``; ``LEASES_TEST_LEASES_URL``: the Redis of
the leases; ``LEASES_TEST_RECORD_URL``: a Redis where actors record what they do, as JSON in the list ``runs``
(default: the broker's, when it is a Redis); ``LEASES_TEST_QUEUE``: the actors' queue (default ``default``;
unique per test on the shared RabbitMQ); ``LEASES_TEST_SLOW_BOOT``: seconds a middleware added after
LeaseMiddleware spends in ``after_worker_boot`` (Dramatiq runs after-hooks in reverse order, so before
LeaseMiddleware's; its consumers and worker threads already run meanwhile).
"""

from __future__ import annotations

import json
import os
import time

import dramatiq
import redis
from dramatiq.middleware import Middleware

from dramatiq_leases import LeaseMiddleware, current_lease

BROKER_URL = os.environ["LEASES_TEST_BROKER_URL"]
QUEUE = os.environ.get("LEASES_TEST_QUEUE", "default")

broker: dramatiq.Broker
if BROKER_URL.startswith("amqp"):
    from dramatiq.brokers.rabbitmq import RabbitmqBroker

    # RabbitMQ redelivers a dead worker's unacknowledged messages as soon as its connection drops. Confirmed
    # sends: a sender's process exits right after its sends, and RabbitMQ drops what it had not yet handled.
    broker = RabbitmqBroker(url=BROKER_URL, confirm_delivery=True)
else:
    from dramatiq.brokers.redis import MAINTENANCE_SCALE, RedisBroker

    # Redeliver a dead worker's messages within seconds, not Dramatiq's default minute.
    broker = RedisBroker(url=BROKER_URL, heartbeat_timeout=3_000, maintenance_chance=MAINTENANCE_SCALE)  # type: ignore[no-untyped-call]  # dramatiq leaves RedisBroker unannotated
broker.add_middleware(
    LeaseMiddleware(redis_url=os.environ["LEASES_TEST_LEASES_URL"], lock_min_backoff=20, lock_max_backoff=200)
)


class SlowBoot(Middleware):
    """A middleware whose worker boot takes a while (connecting somewhere, warming a cache...)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def after_worker_boot(self, broker: dramatiq.Broker, worker: dramatiq.Worker) -> None:
        time.sleep(self.seconds)


if float(os.environ.get("LEASES_TEST_SLOW_BOOT", 0)):
    broker.add_middleware(SlowBoot(float(os.environ["LEASES_TEST_SLOW_BOOT"])))
dramatiq.set_broker(broker)
record = redis.Redis.from_url(os.environ.get("LEASES_TEST_RECORD_URL", BROKER_URL))


def note(**event: object) -> None:
    record.rpush("runs", json.dumps({"pid": os.getpid(), "at": time.time(), **event}))


def _lease() -> dict[str, object]:
    lease = current_lease()
    return {"fence": lease.fence, "acquired": lease.acquired_at, "message_id": lease.meta["message_id"]}


@dramatiq.actor(queue_name=QUEUE, lock_key="k:{key}", lock_ttl=2_000)
def interval_job(key: str, seconds: float) -> None:
    start = time.time()
    time.sleep(seconds)
    note(kind="interval", key=key, start=start, end=time.time(), **_lease())


@dramatiq.actor(queue_name=QUEUE, lock_key="crash:{key}", lock_ttl=2_000, max_retries=0)
def crash_job(key: str) -> None:
    start = time.time()
    if record.set(f"crash-started:{key}", 1, nx=True):
        note(kind="crash-holding", key=key, start=start, **_lease())
        time.sleep(60)  # SIGKILLed meanwhile
    note(kind="crash-done", key=key, start=start, end=time.time(), **_lease())


@dramatiq.actor(queue_name=QUEUE, lock_key="slow:{key}", lock_ttl=2_000)
def slow_job(key: str, seconds: float) -> None:
    start = time.time()
    note(kind="slow-started", key=key, start=start, **_lease())
    time.sleep(seconds)
    note(kind="slow-done", key=key, start=start, end=time.time(), **_lease())


@dramatiq.actor(queue_name=QUEUE, lock_key="gated:{key}", lock_ttl=2_000)
def gated_job(key: str) -> None:
    """Runs until the test opens the gate of ``key`` (a minute at most); at once once it is open."""
    start = time.time()
    note(kind="gated-started", key=key, start=start, **_lease())
    deadline = time.monotonic() + 60
    while not record.exists(f"gate:{key}") and time.monotonic() < deadline:
        time.sleep(0.01)
    note(kind="gated-done", key=key, start=start, end=time.time(), **_lease())
