"""A Dramatiq app for the cross-process tests, configured by environment variables.

``LEASES_TEST_BROKER_URL``, ``LEASES_TEST_LEASES_URL``: Redis URLs of the broker and of the leases.
Actors record what they do as JSON in the Redis list ``runs`` of the broker's Redis.
"""

from __future__ import annotations

import json
import os
import time

import dramatiq
import redis
from dramatiq.brokers.redis import MAINTENANCE_SCALE, RedisBroker

from dramatiq_leases import LeaseMiddleware, current_lease

# Redeliver a dead worker's messages within seconds, not Dramatiq's default minute.
broker = RedisBroker(url=os.environ["LEASES_TEST_BROKER_URL"], heartbeat_timeout=3_000,
                     maintenance_chance=MAINTENANCE_SCALE)
broker.add_middleware(LeaseMiddleware(redis_url=os.environ["LEASES_TEST_LEASES_URL"], lock_min_backoff=20, lock_max_backoff=200))
dramatiq.set_broker(broker)
record = redis.Redis.from_url(os.environ["LEASES_TEST_BROKER_URL"])


def note(**event: object) -> None:
    record.rpush("runs", json.dumps({"pid": os.getpid(), "at": time.time(), **event}))


@dramatiq.actor(lock_key="k:{key}", lock_ttl=2_000)
def interval_job(key: str, seconds: float) -> None:
    start = time.time()
    time.sleep(seconds)
    note(kind="interval", key=key, start=start, end=time.time(), fence=current_lease().fence)


@dramatiq.actor(lock_key="crash:{key}", lock_ttl=2_000, max_retries=0)
def crash_job(key: str) -> None:
    lease = current_lease()
    if record.set(f"crash-started:{key}", 1, nx=True):
        note(kind="crash-holding", key=key, fence=lease.fence)
        time.sleep(60)  # SIGKILLed meanwhile
    note(kind="crash-done", key=key, fence=lease.fence)


@dramatiq.actor(lock_key="slow:{key}", lock_ttl=2_000)
def slow_job(key: str, seconds: float) -> None:
    note(kind="slow-started", key=key)
    time.sleep(seconds)
    note(kind="slow-done", key=key)
